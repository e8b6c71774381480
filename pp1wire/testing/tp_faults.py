"""TESTING ONLY: ``pp1-spark`` ranks with injected faults, run under torchrun as ``-m
pp1wire.testing.tp_faults --fault KIND:RANK:ATTEMPT ... -- <pp1-spark flags>``; a fault fires on
rank RANK at group attempt ATTEMPT (from 1, counted alike on every rank; ``*``: every attempt)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pp1wire.apps import spark, spark_tp

# corrupt: flip a byte of this rank's received payload (attempts with rows); target: its
# target evaluations fail once, in the first attempt from ATTEMPT on in which it owns a round;
# late: sleep PP1_TP_LATE_S (default 3) s before the vote; die: SIGKILL before the vote (a
# rank run as a thread raises RankVanished instead: it never votes).
KINDS = ("corrupt", "target", "late", "die")


@dataclass(frozen=True)
class Fault:
    """One injected fault."""

    kind: str
    rank: int
    attempt: int | None  # None: every attempt

    def fires(self, rank: int, attempt: int) -> bool:
        """Whether this fault applies to ``rank`` at ``attempt``."""
        return rank == self.rank and self.attempt in (None, attempt)


def parse_fault(text: str, kinds: Sequence[str] = KINDS, unit: str = "ATTEMPT") -> Fault:
    """``KIND:RANK:ATTEMPT`` → Fault (``unit`` names the count: a group's draw for the
    sharded worker's faults).

    Raises:
        argparse.ArgumentTypeError: for anything else.
    """
    kind, _, rest = text.partition(":")
    rank, _, attempt = rest.partition(":")
    if kind not in kinds or not rank.isdigit() or not (attempt == "*" or attempt.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r}: use KIND:RANK:{unit}, KIND in {kinds}")
    return Fault(kind, int(rank), None if attempt == "*" else int(attempt))


class RankVanished(BaseException):
    """A rank that runs as a thread stops taking part, as a killed process would."""


class InjectedFaults:
    """The :class:`pp1wire.tp.group.Faults` hooks for a list of faults."""

    def __init__(
        self, faults: Sequence[Fault], *, late: float | None = None, threads: bool = False
    ) -> None:
        """Hooks that fire ``faults``; ``late`` seconds for ``late`` faults (default:
        ``PP1_TP_LATE_S`` or 3); with ``threads`` the ranks are threads of this process."""
        self.faults = list(faults)
        self.late = float(os.environ.get("PP1_TP_LATE_S", "3")) if late is None else late
        self.threads = threads
        self._spent: set[Fault] = set()

    def _fires(self, kind: str, rank: int, attempt: int) -> bool:
        return any(f.kind == kind and f.fires(rank, attempt) for f in self.faults)

    def corrupt_copy(self, rank: int, attempt: int) -> bool:
        """See :class:`pp1wire.tp.group.Faults`."""
        return self._fires("corrupt", rank, attempt)

    def fail_target(self, rank: int, attempt: int) -> bool:
        """See :class:`pp1wire.tp.group.Faults`."""
        for f in self.faults:
            if f.kind != "target" or f.rank != rank:
                continue
            if f.attempt is None:
                return True
            if attempt >= f.attempt and f not in self._spent:
                self._spent.add(f)
                return True
        return False

    def before_vote(self, rank: int, attempt: int) -> None:
        """See :class:`pp1wire.tp.group.Faults`."""
        if self._fires("late", rank, attempt):
            time.sleep(self.late)
        if self._fires("die", rank, attempt):
            if self.threads:
                raise RankVanished(f"rank {rank} vanished before the vote of attempt {attempt}")
            os.kill(os.getpid(), signal.SIGKILL)


def split_faults(
    prog: str, argv: Sequence[str] | None, parse: Callable[[str], Fault]
) -> tuple[list[Fault], list[str]]:
    """The ``--fault``s before ``--`` (parsed by ``parse``) and the command line after it."""
    line = list(sys.argv[1:] if argv is None else argv)
    split = line.index("--") if "--" in line else len(line)
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--fault", type=parse, action="append", default=[])
    faults: list[Fault] = p.parse_args(line[:split]).fault
    return faults, line[split + 1 :]


def main(argv: Sequence[str] | None = None) -> int:
    """Install the faults, then run ``pp1-spark`` with the flags after ``--``."""
    faults, rest = split_faults("pp1wire.testing.tp_faults", argv, parse_fault)
    spark_tp.FAULTS = InjectedFaults(faults)
    return spark.main(rest)


if __name__ == "__main__":
    sys.exit(main())
