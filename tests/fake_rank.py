"""A stand-in rank for the launcher's tests: ``python -m tests.fake_rank R:BEHAVIOUR ...``.

The rank whose ``RANK`` is R does BEHAVIOUR (ranks not named run until SIGTERM):

- ``run``: sleep until SIGTERM, then exit 0;
- ``exit:CODE:SECONDS``: exit with CODE after SECONDS (and 0 on an earlier SIGTERM);
- ``kill:SECONDS``: SIGKILL itself after SECONDS;
- ``stubborn``: ignore SIGTERM, sleep until killed;
- ``termfail:CODE``: sleep until SIGTERM, then exit with CODE.

It imports nothing of the package (no torch): a launch of it costs two interpreter starts.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def main(argv: list[str]) -> int:
    rank = os.environ["RANK"]
    plan = dict(arg.split(":", 1) for arg in argv)
    kind, _, rest = plan.get(rank, "run").partition(":")
    if kind == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            time.sleep(1)
    on_term = int(rest) if kind == "termfail" else 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(on_term))
    if kind == "exit":
        code, seconds = rest.split(":")
        time.sleep(float(seconds))
        return int(code)
    if kind == "kill":
        time.sleep(float(rest))
        os.kill(os.getpid(), signal.SIGKILL)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
