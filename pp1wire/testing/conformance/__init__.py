"""``pp1-conformance``: numbered cases, each quoting a rule of ``docs/protocol.md``, sent as one
exact stimulus to any worker endpoint and graded on its one exact reaction; the grades and the
exit code are those of README.md (Conformance)."""

from pp1wire.testing.conformance import (
    commit,
    framing,
    handshake,
    integrity,
    liveness,
    session,
    sharded,
    stoprules,
)
from pp1wire.testing.conformance.core import CASES, Case, Grade, Outcome, Peer, Settings
from pp1wire.testing.conformance.runner import main, run_all, run_case, select

# Each section module registers its cases on import; --list and a full run show
# them in the order of the document's layers, framing first.
_ORDER = (framing, handshake, integrity, session, stoprules, commit, sharded, liveness)
CASES.sort(key=lambda c: [m.__name__ for m in _ORDER].index(c.fn.__module__))

__all__ = [
    "CASES",
    "Case",
    "Grade",
    "Outcome",
    "Peer",
    "Settings",
    "main",
    "run_all",
    "run_case",
    "select",
]
