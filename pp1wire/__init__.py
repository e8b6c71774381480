"""pp1wire: transport, validation and exact verification for sampled speculative decoding.

The public API (``docs/embedding.md``), each name loaded on first use. Clients: AsyncClient,
SyncClient, Request, ProposalBatch, SparkConfig. Verification: step_prefixes, verify_step,
StepRound, RequestVerifier, RoundResult, Outcome, TARGET_FAILURES, derive_seed, Proposal.
Errors: Pp1Error (its ErrorCode in ``.code``), UsageError, RefusedError, ConnectionLostError,
ProposalUnavailableError, VerifyError. Flat layout: flatten_drafts, target_rows, pack_outputs.
toy_target: the built-in toy target. With the ``tp`` extra (torch, so not in ``__all__``):
GroupCoordinator, SparkGroup, GroupItem, GroupFailedError.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from pp1wire.aio.client import AsyncClient
    from pp1wire.aio.handles import (
        ConnectionLostError,
        ProposalBatch,
        ProposalUnavailableError,
        RefusedError,
        Request,
        flatten_drafts,
        pack_outputs,
        target_rows,
    )
    from pp1wire.aio.sync import SyncClient
    from pp1wire.apps.models import toy_target
    from pp1wire.errors import ErrorCode, Pp1Error, UsageError, VerifyError
    from pp1wire.q.proposal import Proposal
    from pp1wire.q.rng import derive_seed
    from pp1wire.q.verify import (
        TARGET_FAILURES,
        Outcome,
        RequestVerifier,
        RoundResult,
        StepRound,
        step_prefixes,
        verify_step,
    )
    from pp1wire.tp.coordinator import GroupCoordinator as GroupCoordinator
    from pp1wire.tp.coordinator import GroupFailedError as GroupFailedError
    from pp1wire.tp.fanout import Item as GroupItem  # noqa: F401 (exported, not in __all__)
    from pp1wire.tp.group import SparkGroup as SparkGroup
    from pp1wire.wire.spark_core import SparkConfig


def _by_module(names: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, str]]:
    """``{module: names}`` as ``{name: (module, name)}``."""
    return {name: (module, name) for module, listed in names.items() for name in listed}


# name -> (module, attribute in it)
_EXPORTS: dict[str, tuple[str, str]] = _by_module(
    {
        "pp1wire.aio.client": ("AsyncClient",),
        "pp1wire.aio.sync": ("SyncClient",),
        "pp1wire.wire.spark_core": ("SparkConfig",),
        "pp1wire.aio.handles": (
            "Request",
            "ProposalBatch",
            "RefusedError",
            "ConnectionLostError",
            "ProposalUnavailableError",
            "flatten_drafts",
            "target_rows",
            "pack_outputs",
        ),
        "pp1wire.q.proposal": ("Proposal",),
        "pp1wire.q.verify": (
            "RequestVerifier",
            "RoundResult",
            "Outcome",
            "TARGET_FAILURES",
            "StepRound",
            "step_prefixes",
            "verify_step",
        ),
        "pp1wire.q.rng": ("derive_seed",),
        "pp1wire.errors": ("ErrorCode", "Pp1Error", "UsageError", "VerifyError"),
        "pp1wire.apps.models": ("toy_target",),
    }
)

# Public, but they import torch: loaded on use, kept out of __all__.
_TP_EXPORTS: dict[str, tuple[str, str]] = {
    "GroupCoordinator": ("pp1wire.tp.coordinator", "GroupCoordinator"),
    "GroupFailedError": ("pp1wire.tp.coordinator", "GroupFailedError"),
    "GroupItem": ("pp1wire.tp.fanout", "Item"),
    "SparkGroup": ("pp1wire.tp.group", "SparkGroup"),
}

__all__ = [
    "TARGET_FAILURES",
    "AsyncClient",
    "ConnectionLostError",
    "ErrorCode",
    "Outcome",
    "Pp1Error",
    "Proposal",
    "ProposalBatch",
    "ProposalUnavailableError",
    "RefusedError",
    "Request",
    "RequestVerifier",
    "RoundResult",
    "SparkConfig",
    "StepRound",
    "SyncClient",
    "UsageError",
    "VerifyError",
    "derive_seed",
    "flatten_drafts",
    "pack_outputs",
    "step_prefixes",
    "target_rows",
    "toy_target",
    "verify_step",
]


def __getattr__(name: str) -> Any:
    """Load a public name's module on first use.

    Raises:
        AttributeError: for a name the package does not export.
    """
    where = _EXPORTS.get(name) or _TP_EXPORTS.get(name)
    if where is None:
        raise AttributeError(f"module 'pp1wire' has no attribute {name!r}")
    value = getattr(importlib.import_module(where[0]), where[1])
    globals()[name] = value  # the next use is a plain attribute
    return value


def __dir__() -> list[str]:
    """Every public name, the torch-backed ones included."""
    return sorted([*globals(), *_EXPORTS, *_TP_EXPORTS])
