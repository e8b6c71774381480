"""``pp1-conformance``: numbered protocol cases run against any worker endpoint.

In the manner of h2spec and Autobahn|Testsuite: every case is numbered by the
section of ``docs/protocol.md`` it checks, quotes the rule, sends one exact
stimulus and expects one exact reaction (an ERROR code, a reply, a closed
connection). Cases that the worker should survive then check that nothing
changed: the slot's last STEP, retried, must still get the byte-identical
reply, and fatal cases check that a fresh connection still works.

Grades: ``pass``; ``non-strict`` (the reaction is safe but not the one the
document prefers, e.g. a fatal error closed the connection without an ERROR
frame; counted as a failure with ``--strict``); ``fail``; ``informational``
(reported, never fails the run). The exit code is 0 only when every
non-informational case passes.
"""

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
    "commit",
    "framing",
    "handshake",
    "integrity",
    "liveness",
    "main",
    "run_all",
    "run_case",
    "select",
    "session",
    "sharded",
    "stoprules",
]
