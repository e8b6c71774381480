"""TESTING ONLY: ``pp1-worker`` ranks of a sharded group with injected faults, run under torchrun
as ``-m pp1wire.testing.shard_faults --fault KIND:RANK:DRAW ... -- <pp1-worker flags>``; a fault
spoils that rank's shard of group draw DRAW (from 1, counted alike on every rank; ``*``: every)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Sequence

import msgspec
import numpy as np

from pp1wire.apps import worker, worker_tp
from pp1wire.errors import ErrorCode, Pp1Error
from pp1wire.q.dyadic import M
from pp1wire.q.proposal import QRow
from pp1wire.testing import tp_faults
from pp1wire.testing.tp_faults import Fault
from pp1wire.tp.shard_worker import AfterDraw
from pp1wire.wire import worker_core
from pp1wire.wire.replies import FrameParts, ReplyEncoder

# mass: one count moved into the shard (every entry valid, the total over the shards wrong:
# only the Spark group's check sees it); corrupt: one q value made negative (NEGATIVE); late:
# sent PP1_SHARD_LATE_S (default 3) s late; missing: COMPLETION status INTERNAL; stale: once,
# the previous generation, for a slot at generation >= 1; die: SIGKILL before sending.
KINDS = ("mass", "corrupt", "late", "missing", "stale", "die")
_stale = threading.local()


def parse_fault(text: str) -> Fault:
    """``KIND:RANK:DRAW`` → Fault (its ``attempt`` is the draw).

    Raises:
        argparse.ArgumentTypeError: for anything else.
    """
    return tp_faults.parse_fault(text, KINDS, "DRAW")


def _spoiled(rows: tuple[QRow, ...], how: str) -> tuple[QRow, ...]:
    row = rows[0]
    assert row.counts is not None
    counts = row.counts.astype(np.int64)  # a copy: the replay keeps what was sent
    if counts.size == 0:
        return rows  # an empty sparse shard: nothing to spoil here
    where = int(np.argmax(counts))
    if how == "mass":
        counts[where] += 1 if int(counts.sum()) < M else -1
    else:
        counts[where] = -max(int(counts[where]), 1)
    return (QRow(token=row.token, counts=counts, ids=row.ids), *rows[1:])


def after_draw(faults: Sequence[Fault]) -> AfterDraw:
    """The hook that fires ``faults``."""

    def hook(rank: int, draw: int, rows: tuple[QRow, ...]) -> tuple[QRow, ...]:
        kinds = {f.kind for f in faults if f.fires(rank, draw)}
        if "die" in kinds:
            os.kill(os.getpid(), signal.SIGKILL)
        if "late" in kinds:
            time.sleep(float(os.environ.get("PP1_SHARD_LATE_S", "3")))
        if "missing" in kinds:
            raise Pp1Error(ErrorCode.INTERNAL, "injected: this rank's shard is missing")
        if "stale" in kinds and not _stale_spent.is_set():
            _stale.on = True
        for how in ("mass", "corrupt"):
            if how in kinds:
                rows = _spoiled(rows, how)
        return rows

    return hook


_stale_spent = threading.Event()


class _StaleEncoder(ReplyEncoder):
    """The reply encoder, except that the reply a ``stale`` fault armed names the
    generation before the STEP's (armed on the thread that finishes the draw)."""

    def _arm(self) -> None:
        armed, _stale.on = getattr(_stale, "on", False), False
        if armed and self.step.generation >= 1 and not _stale_spent.is_set():
            _stale_spent.set()
            self.step = msgspec.structs.replace(self.step, generation=self.step.generation - 1)

    def row(self, index: int, row: QRow) -> FrameParts:
        self._arm()
        return super().row(index, row)

    def completion(
        self, frames: tuple[FrameParts, ...], status: int = 0, *, stopped: bool = False
    ) -> FrameParts:
        self._arm()
        return super().completion(frames, status, stopped=stopped)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``--fault``s, install the hooks, run ``pp1-worker`` with the rest."""
    faults, rest = tp_faults.split_faults("pp1wire.testing.shard_faults", argv, parse_fault)
    worker_tp.AFTER_DRAW = after_draw(faults)
    # The core frames each reply with its module's ReplyEncoder: replace that one.
    setattr(worker_core, "ReplyEncoder", _StaleEncoder)  # noqa: B010
    return worker.main(rest)


if __name__ == "__main__":
    sys.exit(main())
