"""Ranks of a daemon group: how many, starting them on this machine, joining their group.

``pp1-spark --tp N`` and ``pp1-worker --tp N`` start N copies of themselves as
ranks (:func:`launch`); ``torchrun --nproc-per-node N -m …`` starts them the
way engines do. Either way each rank then joins the group
(:func:`join_group`). torch is an optional extra: it is imported only here and
in :mod:`pp1wire.tp`, after :func:`require_torch` said it is there.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from types import FrameType
from typing import TYPE_CHECKING

from pp1wire.apps.settings import MAX_RANKS, SettingsError
from pp1wire.q.layout import ShardLayout

if TYPE_CHECKING:
    from pp1wire.tp.coordinator import GroupCoordinator

_STOP_GRACE = 10.0  # seconds a rank has to exit after the others stopped or failed


def require_torch(flag: str) -> None:
    """Raises SettingsError (one line) when torch is not installed: ``flag`` needs it.

    Looks for the package without importing it (seconds saved in a launcher that
    never runs a collective itself).
    """
    if importlib.util.find_spec("torch") is None:
        raise SettingsError(f"{flag} needs torch: pip install 'pp1wire[tp]'")


def in_launched_rank() -> bool:
    """Whether this process is a rank that a launcher (ours or torchrun) started."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def world_size(args: argparse.Namespace) -> int:
    """The group size: ``WORLD_SIZE`` inside a launched rank, else ``--tp``.

    Raises:
        SettingsError: ``--tp`` outside 1..:data:`MAX_RANKS`, or a ``--tp`` other
            than 1 that disagrees with the launcher's ``WORLD_SIZE``.
    """
    launched = os.environ.get("WORLD_SIZE")
    if launched is not None and in_launched_rank():
        world = int(launched)
        if args.tp not in (1, world):
            raise SettingsError(f"--tp {args.tp} but the launcher started {world} ranks")
        return world
    if not 1 <= args.tp <= MAX_RANKS:
        raise SettingsError(f"--tp must be in 1..{MAX_RANKS} (ranks started on this machine)")
    return int(args.tp)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(world: int, argv: Sequence[str], module: str) -> int:
    """Start ``world`` ranks of ``python -m module argv`` on this machine and wait for them.

    Every rank gets the rendezvous environment ``torch.distributed`` reads
    (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``) and
    one OpenMP thread unless the caller chose (as torchrun does: N ranks that
    each spin a thread per core were measured 2.1x slower). SIGTERM and SIGINT
    are passed on to every rank; a rank that fails makes the others stop
    (SIGTERM, then SIGKILL after a grace period), and every rank is reaped
    before this returns.

    Returns 0 when every rank exited 0, else the exit code of the lowest rank
    that failed (one line on stderr names it).

    Raises:
        SettingsError: if torch is not installed.
    """
    require_torch("--tp above 1")
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world))
    procs: list[subprocess.Popen[bytes]] = []
    signalled: list[int] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        signalled.append(signum)
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for rank in range(world):
            if signalled:  # stopped while starting: no rank is started after the signal
                break
            rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            procs.append(subprocess.Popen([sys.executable, "-m", module, *argv], env=rank_env))
        failed_at: float | None = None
        while any(p.poll() is None for p in procs):
            if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                failed_at = time.monotonic()
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
            if failed_at is not None and time.monotonic() - failed_at > _STOP_GRACE:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.05)
    finally:
        for p in procs:  # never leave a rank behind (an exception here, a second signal)
            if p.poll() is None:
                p.kill()
            p.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    codes = [p.returncode for p in procs]
    for rank, code in enumerate(codes):
        if code != 0:
            if code < 0 and signalled:
                continue  # stopped by the signal this launcher passed on
            print(f"{module}: rank {rank} exited with {code}", file=sys.stderr)
            return code if code > 0 else 1
    return 0


def join_group(
    timeout: float, layout: ShardLayout | None = None, *, device: bool = False
) -> GroupCoordinator:
    """Join the group this process is a rank of (``timeout`` for every collective);
    ``device``: also build the NCCL device group, where this rank has a CUDA device.

    Raises:
        SettingsError: if torch is not installed.
        RuntimeError: from ``torch.distributed`` if the rendezvous fails.
    """
    require_torch("--tp above 1")
    from pp1wire.tp.coordinator import GroupCoordinator  # noqa: PLC0415 - torch is optional

    return GroupCoordinator.join(timeout, layout, device=device)


__all__ = ["in_launched_rank", "join_group", "launch", "require_torch", "world_size"]
