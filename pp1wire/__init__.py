"""pp1wire: transport, validation and exact verification for sampled speculative decoding.

The public API is what this package exports; everything else is internal
(its modules may change without notice). An engine's sampler needs only::

    from pp1wire import SparkConfig, SyncClient, derive_seed, step_prefixes, verify_step

* **Clients**: :class:`AsyncClient` (asyncio) and :class:`SyncClient` (blocking)
  connect to a ``pp1-worker``; :class:`Request` is a request open on one slot
  (its slot and its :class:`RequestVerifier`); ``propose_many`` returns a
  :class:`ProposalBatch` of :class:`Proposal` or :class:`ProposalUnavailableError`
  per request. :class:`SparkConfig` is what the client asks of the worker.
* **Verification**: :func:`step_prefixes` lists what the engine scores for a
  step's rounds (each a :data:`StepRound`, ``(verifier, proposal, round_id)``),
  :func:`verify_step` decides them from the engine's ``[N, V]`` array or
  tensor; :class:`RequestVerifier` holds one request's state (prefix,
  generation, seed, round counter); :class:`RoundResult` and :class:`Outcome`
  say what a round committed. :data:`TARGET_FAILURES` are the codes that stop
  a request. :func:`derive_seed` gives request i its seed as ``pp1-spark`` does.
* **Errors**: every exception is a :class:`Pp1Error` with an :class:`ErrorCode`
  in ``.code``: :class:`UsageError` (local misuse, nothing sent),
  :class:`RefusedError` (the worker refused: reopen the slot),
  :class:`ConnectionLostError` (reconnect and reopen),
  :class:`ProposalUnavailableError` (this round has no proposal: decode it
  target-only), :class:`VerifyError` (a round could not be verified).
* **Flat layout** of serving engines: :func:`flatten_drafts`,
  :func:`target_rows`, :func:`pack_outputs`.
* :func:`toy_target`: the built-in toy target (``pp1-spark``'s default
  ``--target``), a stand-in for an engine's model in examples and tests.

Tensor-parallel groups (``docs/tp.md``) are exported too, but need the ``tp``
extra (torch): :class:`GroupCoordinator`, :class:`SparkGroup`,
:class:`GroupItem` and :class:`GroupFailedError` are loaded on first use and
are not in ``__all__``, so ``from pp1wire import *`` never imports torch.

Importing the package is cheap: each name loads its module on first use.
See ``docs/embedding.md``.
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
