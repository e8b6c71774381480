"""Ranks of a daemon group: how many, starting them on this machine (``--tp N``, as torchrun
would), and joining their group; torch is imported only here and in :mod:`pp1wire.tp`, after
:func:`require_torch`."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import TYPE_CHECKING

from pp1wire.apps.launch import free_ports
from pp1wire.apps.settings import MAX_RANKS, SettingsError
from pp1wire.q.layout import ShardLayout

if TYPE_CHECKING:
    from pp1wire.tp.coordinator import GroupCoordinator

_STOP_GRACE = 10.0  # seconds a rank has to exit after the others stopped or failed


def require_torch(flag: str) -> None:
    """Raises SettingsError when torch is not installed: ``flag`` needs it (looked for, not
    imported: seconds saved in a launcher)."""
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


def rank_environments(
    world: int, port: int | None = None, base: Mapping[str, str] | None = None
) -> list[dict[str, str]]:
    """Each of ``world`` ranks' environment for a rendezvous on loopback: ``base`` (default:
    this process's) with ``MASTER_*`` (``port``: default a free one), ``WORLD_SIZE``, its
    ``RANK`` and ``LOCAL_RANK``, and ``OMP_NUM_THREADS=1`` unless set.

    Raises:
        RuntimeError: no free port was found.
    """
    env = dict(os.environ if base is None else base)
    env.setdefault("OMP_NUM_THREADS", "1")
    port = free_ports(1) if port is None else port
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world))
    return [{**env, "RANK": str(rank), "LOCAL_RANK": str(rank)} for rank in range(world)]


def launch(world: int, argv: Sequence[str], module: str, *, grace: float = _STOP_GRACE) -> int:
    """Start ``world`` ranks of ``python -m module argv`` here (:func:`rank_environments`;
    one OpenMP thread each, as torchrun: a thread per core was measured 2.1x slower), pass
    SIGTERM and SIGINT on, and end the group at its first exit (SIGTERM, then SIGKILL after
    ``grace`` seconds). Returns the first failure's code (:meth:`_Group.code`), else 0.

    Raises:
        SettingsError: if torch is not installed.
    """
    require_torch("--tp above 1")
    envs = rank_environments(world)
    group = _Group(module, grace)

    def forward(signum: int, _frame: FrameType | None) -> None:
        group.stop(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for rank in range(world):
            if group.stopping is not None:  # stopped while starting: no rank starts after it
                break
            group.procs.append(
                subprocess.Popen([sys.executable, "-m", module, *argv], env=envs[rank])
            )
        while not group.poll():
            time.sleep(_POLL)
    finally:
        for p in group.procs:  # never leave a rank behind (an exception here, a second signal)
            if p.poll() is None:
                p.kill()
            p.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return group.code()


_POLL = 0.05  # seconds between looks at the ranks


class _Group:
    """The ranks of one launch and what became of each, in the order they exited."""

    def __init__(self, module: str, grace: float) -> None:
        self.module = module
        self.grace = grace
        self.procs: list[subprocess.Popen[bytes]] = []
        self.stopping: float | None = None  # when the group was told to stop
        self.sent: dict[int, set[int]] = {}  # rank -> signals this launcher sent it
        self.killed: set[int] = set()  # ranks killed after the grace period
        self.exits: list[tuple[int, int]] = []  # (rank, returncode), in exit order

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Send ``signum`` to every rank still running; the grace period starts at the first."""
        if self.stopping is None:
            self.stopping = time.monotonic()
        for rank, p in enumerate(self.procs):
            if p.poll() is None:
                self.sent.setdefault(rank, set()).add(signum)
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signum)

    def poll(self) -> bool:
        """Look at every rank; stop the group at its first exit, kill what outlives the grace.
        Whether every rank has exited."""
        seen = {rank for rank, _ in self.exits}
        for rank, p in enumerate(self.procs):
            code = p.poll()
            if code is not None and rank not in seen:
                self.exits.append((rank, code))
        running = len(self.exits) < len(self.procs)
        if self.exits and running and self.stopping is None:
            self.stop()
        late = self.stopping is not None and time.monotonic() - self.stopping > self.grace
        if running and late:
            for rank, p in enumerate(self.procs):
                if p.poll() is None and rank not in self.killed:
                    self.killed.add(rank)
                    with contextlib.suppress(ProcessLookupError):
                        p.kill()
        return not running

    def code(self) -> int:
        """The first failure's exit code (0: none), named on stderr: 128 + N for a rank signal
        N ended (not sent here), before any rank's own code (a rank whose peer died exits
        ``GROUP_FAILED`` at about the same moment), or 1 for a rank killed after the grace.
        """
        failures: list[tuple[int, str]] = []  # (exit code, the line naming it)
        signalled: list[tuple[int, str]] = []
        for rank, code in self.exits:
            if rank in self.killed:
                line = (
                    f"rank {rank} did not stop within {self.grace:g} s of the group's end: killed"
                )
                failures.append((1, line))
            elif code == 0 or -code in self.sent.get(rank, ()):
                continue  # a clean exit, or the signal this launcher sent it
            elif code < 0:
                signalled.append((128 - code, f"rank {rank} exited with {code}"))
            else:
                failures.append((code, f"rank {rank} exited with {code}"))
        first = [*signalled, *failures]
        if not first:
            return 0
        code, line = first[0]
        print(f"{self.module}: {line}", file=sys.stderr)
        return code


def join_group(
    timeout: float, layout: ShardLayout | None = None, *, device: bool = False
) -> GroupCoordinator:
    """Join this process's group (``timeout`` for every collective; ``device``: a NCCL device
    group if every rank has CUDA).

    Raises:
        SettingsError: if torch is not installed.
        RuntimeError: from ``torch.distributed`` if the rendezvous fails.
        GroupFailedError: the ranks could not agree on their devices.
    """
    require_torch("--tp above 1")
    from pp1wire.tp.coordinator import GroupCoordinator  # noqa: PLC0415 - torch is optional

    coord = GroupCoordinator.join(timeout, layout, device=device)
    _JOINED.add(os.getpid())
    return coord


_JOINED: set[int] = set()  # the process that joined its group (a fork of it has not)


def end_process(code: int) -> int:
    """Return ``code``, unless this process joined a group: then end it now with ``code``,
    flushed but without the interpreter's teardown, which torch's threads would make abort
    ("terminate called without an active exception", ``docs/tp.md`` §8).
    """
    if os.getpid() not in _JOINED:
        return code
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken stream: nothing to flush
            stream.flush()
    logging.shutdown()
    os._exit(code)
