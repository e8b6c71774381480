"""What each role does with each message in each connection state: one table per role, with
an entry for every (state, message type) pair and no default (h11's ``_state.py``); printed in
``docs/protocol.md`` §5."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Final

from pp1wire.errors import ErrorCode
from pp1wire.wire.framing import Frame
from pp1wire.wire.messages import Message, MsgType


class State(Enum):
    """A connection's state, for either role."""

    IDLE = "idle"  # Spark side: HELLO not sent yet
    AWAIT_HELLO = "await_hello"  # worker: nothing received; Spark side: its HELLO sent
    AWAIT_AUTH = "await_auth"  # worker: CHALLENGE sent, AUTH expected
    READY = "ready"  # the handshake is complete


class Act(Enum):
    """What to do with a message."""

    HANDLE = "handle"  # the role's handler for this type
    IGNORE = "ignore"  # nothing, not even a count
    FATAL = "fatal"  # ERROR scope 2 with the rule's code, then close


@dataclass(frozen=True)
class Rule:
    """One table entry."""

    act: Act
    code: ErrorCode | None = None


HANDLE: Final = Rule(Act.HANDLE)
IGNORE: Final = Rule(Act.IGNORE)


def fatal(code: ErrorCode) -> Rule:
    """End the connection with ``code``."""
    return Rule(Act.FATAL, code)


_ANY_TIME = {MsgType.PING: HANDLE, MsgType.ERROR: HANDLE}
_TO_WORKER = (MsgType.OPEN, MsgType.CLOSE, MsgType.STEP, MsgType.COMMIT, MsgType.RESET)
_TO_SPARK = (
    MsgType.OPENED,
    MsgType.CLOSED,
    MsgType.REPLY,
    MsgType.COMPLETION,
    MsgType.COMMITTED,
    MsgType.RESET_DONE,
)
_HANDSHAKE_REQUIRED = fatal(ErrorCode.HANDSHAKE_REQUIRED)
_UNEXPECTED = fatal(ErrorCode.UNEXPECTED_MESSAGE)


def _worker() -> dict[tuple[State, MsgType], Rule]:
    table: dict[tuple[State, MsgType], Rule] = {}
    for state in (State.AWAIT_HELLO, State.AWAIT_AUTH, State.READY):
        before = state is not State.READY
        for kind in MsgType:
            if kind in _ANY_TIME:
                rule = _ANY_TIME[kind]
            elif kind is MsgType.PONG:
                rule = IGNORE  # the worker sends no PING: a PONG answers nothing of ours
            elif kind is MsgType.HELLO:
                rule = {
                    State.AWAIT_HELLO: HANDLE,
                    State.AWAIT_AUTH: _HANDSHAKE_REQUIRED,
                    State.READY: fatal(ErrorCode.DUPLICATE_HELLO),
                }[state]
            elif kind is MsgType.AUTH:
                rule = {
                    State.AWAIT_HELLO: _HANDSHAKE_REQUIRED,
                    State.AWAIT_AUTH: HANDLE,
                    State.READY: _UNEXPECTED,
                }[state]
            elif kind in _TO_WORKER:
                rule = _HANDSHAKE_REQUIRED if before else HANDLE
            else:  # a worker-to-Spark type, received by the worker
                rule = _HANDSHAKE_REQUIRED if before else _UNEXPECTED
            table[(state, kind)] = rule
    return table


def _spark() -> dict[tuple[State, MsgType], Rule]:
    table: dict[tuple[State, MsgType], Rule] = {}
    for state in (State.IDLE, State.AWAIT_HELLO, State.READY):
        for kind in MsgType:
            if kind in _ANY_TIME or kind is MsgType.PONG:
                rule = HANDLE  # PONG answers the Spark side's own PING
            elif state is State.IDLE:
                rule = _UNEXPECTED  # nothing but PING/PONG/ERROR before our HELLO
            elif kind in (MsgType.HELLO, MsgType.CHALLENGE):
                rule = HANDLE if state is State.AWAIT_HELLO else _UNEXPECTED
            elif kind in _TO_SPARK:
                rule = _HANDSHAKE_REQUIRED if state is State.AWAIT_HELLO else HANDLE
            else:  # a Spark-to-worker type, received by the Spark side
                rule = _HANDSHAKE_REQUIRED if state is State.AWAIT_HELLO else _UNEXPECTED
            table[(state, kind)] = rule
    return table


WORKER: Final = _worker()
SPARK: Final = _spark()

Handler = Callable[[Message, Frame], None]


def handlers(table: dict[tuple[State, MsgType], Rule], core: object) -> dict[MsgType, Handler]:
    """Each type ``table`` handles in some state, to ``core``'s ``_on_<type>`` method."""
    kinds = {kind for (_, kind), rule in table.items() if rule.act is Act.HANDLE}
    return {kind: getattr(core, f"_on_{kind.name.lower()}") for kind in sorted(kinds)}


def markdown(table: dict[tuple[State, MsgType], Rule]) -> str:
    """The table as markdown: one row per message type, one column per state."""
    states = sorted({s for s, _ in table}, key=list(State).index)
    head = "| message | " + " | ".join(s.name for s in states) + " |"
    rule = "|---|" + "---|" * len(states)
    rows = []
    for kind in MsgType:
        cells = []
        for state in states:
            r = table[(state, kind)]
            cells.append(r.act.value if r.code is None else f"fatal `{r.code.name}`")
        rows.append(f"| {kind.name} | " + " | ".join(cells) + " |")
    return "\n".join([head, rule, *rows])
