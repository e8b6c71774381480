"""A rank whose Python thread is inside a collective when the process ends:
``python -m tests.exit_rank MODE DIR`` (the launcher's rendezvous environment set).

Rank 0 starts an all-gather on a daemon thread and ends (MODE ``teardown``: the
interpreter's own exit; ``end``: :func:`pp1wire.apps.ranks.end_process`). Rank 1
joins the group, waits until rank 0 is ending (rank 0 writes ``DIR/ending`` from
an atexit hook, which the interpreter runs just before it finalizes; at most 10 s),
then leaves without taking part, so rank 0's collective fails while rank 0 finalizes.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from pathlib import Path

import torch

from pp1wire.apps import ranks


def main(mode: str, folder: Path) -> int:
    coord = ranks.join_group(20.0)
    if coord.rank == 1:
        deadline = time.monotonic() + 10
        while not (folder / "ending").exists() and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.05)
        os._exit(0)  # gone without a word: rank 0's all-gather fails now

    calling = threading.Event()

    def gather() -> None:
        calling.set()
        try:
            coord.all_gather(torch.zeros(4))
        except Exception:  # the group failed: what any rank's thread would see
            return

    threading.Thread(target=gather, daemon=True).start()
    if not calling.wait(10):
        return 5  # the thread never started: the test sees another exit than it expects
    # The all-gather cannot complete (rank 1 never joins it): a moment after the
    # call begins, the thread is blocked inside it until the group fails.
    time.sleep(0.05)
    atexit.register((folder / "ending").touch)
    if mode == "end":
        (folder / "ending").touch()  # end_process skips the atexit hooks too
        return ranks.end_process(0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2])))
