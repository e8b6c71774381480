"""Stop-rule cases, worker role (``docs/protocol.md`` §4.1, §4.4, §4.6, §6.4). Draws are keyed by
position (§6.3), so a block under a rule must be the first L rows of the fixed block of the same
key, L where the rule, from those rows' counts, ends it; a worker without stop rules skips them."""

from __future__ import annotations

import numpy as np

from pp1wire.errors import ErrorCode
from pp1wire.q import dyadic
from pp1wire.q.stoprules import STOP_RULES, StopRule, stop_after
from pp1wire.testing.conformance import core, handshake
from pp1wire.testing.conformance.core import CaseFailed, Peer, Settings
from pp1wire.wire import framing
from pp1wire.wire.messages import Completion, MsgType, Reply, Step

case = core.Section("stop rules").case


@case("4.1.21")
async def _unknown_set(s: Settings) -> None:
    """HELLO naming an unknown stop-rule set

    stop_rules: the worker's own set or "", by exact name, else STOP_RULES_MISMATCH (fatal)
    """
    fields = {"stop_rules": "pp1-stop-rules-v0"}
    await handshake._mismatch_run(s, fields, ErrorCode.STOP_RULES_MISMATCH)


@case("4.1.22")
async def _echoed(s: Settings) -> None:
    """HELLO asking for pp1-stop-rules-v1: echoed exactly, or refused

    no silent downgrade and no auto-upgrade: the worker echoes the set, or refuses it with
    STOP_RULES_MISMATCH
    """
    await _negotiated(s)


async def negotiate(peer: Peer, who: str = "the worker") -> None:
    """The handshake of a HELLO asking for ``pp1-stop-rules-v1`` (``who`` names the worker).

    Raises:
        core.NonStrictSkip: the worker refused the set (it implements none).
        CaseFailed: any other answer, or an echo of another set.
    """
    try:
        theirs = await peer.handshake(peer.hello(stop_rules=STOP_RULES))
    except CaseFailed:
        refusal = await peer.next(0.1)
        code = getattr(refusal.message, "code", None) if refusal is not None else None
        if code == ErrorCode.STOP_RULES_MISMATCH:
            raise core.NonStrictSkip("the worker implements no stop rules") from None
        raise
    if theirs.stop_rules != STOP_RULES:
        raise CaseFailed(f"stop_rules: sent {STOP_RULES!r}, {who} echoed {theirs.stop_rules!r}")


async def _negotiated(s: Settings) -> Peer:
    """A connection that negotiated the stop rules (:func:`negotiate`), slot 0 open."""
    peer = await Peer(s).connect()
    try:
        await negotiate(peer)
    except BaseException:
        peer.close()
        raise
    await peer.open_slot()
    return peer


def _refuse(case_id: str, title: str, stop: int, threshold: int, *, negotiate: bool) -> None:
    async def run(s: Settings) -> None:
        peer = await (_negotiated(s) if negotiate else core.fresh(s))
        async with peer:
            if not negotiate:
                await peer.open_slot()
            step = peer.step_msg(depth=3)
            data, _ = await peer.reply(step)
            peer.send_msg(core.with_fields(step, round=1, stop=stop, threshold=threshold))
            await peer.expect_error(ErrorCode.BAD_STOP_RULE, fatal=False, answers=MsgType.STEP)
            await core.unchanged(peer, step, data)

    case(
        case_id,
        title,
        "the stop rule: a stop other than 0, 1, 2, a threshold above 2^24, fixed with a "
        "threshold, or a rule not negotiated at HELLO: BAD_STOP_RULE (nothing changes)",
    )(run)


_refuse("4.4.14", "STEP with stop-rule kind 3", 3, 0, negotiate=False)
_refuse("4.4.15", "STEP with a threshold of 2^24 + 1", 1, dyadic.M + 1, negotiate=False)
_refuse("4.4.16", "fixed STEP with a threshold", 0, 1, negotiate=False)
_refuse(
    "4.4.17", "confidence rule without stop rules negotiated", 1, dyadic.M // 2, negotiate=False
)
_refuse("4.4.18", "stop-rule kind 255 with stop rules negotiated", 255, 0, negotiate=True)
_refuse("4.4.19", "threshold 2^32 - 1 with stop rules negotiated", 2, 0xFFFFFFFF, negotiate=True)


def _row_count(frame: framing.Frame) -> int:
    """The count of a REPLY row at its own token (dense or sparse payload)."""
    msg = frame.message
    assert isinstance(msg, Reply)
    payload = np.frombuffer(bytes(frame.payload), dtype="<u4")
    if msg.representation == 0:
        values = payload.view("<f4")
        if msg.token >= values.size:
            raise CaseFailed(f"row {msg.index}: token {msg.token} outside its dense row")
        return int(float(values[msg.token]) * dyadic.M)
    k = msg.entries
    ids, values = payload[:k].view("<i4"), payload[k:].view("<f4")
    where = np.flatnonzero(ids == msg.token)
    if where.size != 1:
        raise CaseFailed(f"row {msg.index}: token {msg.token} not once in its sparse support")
    return int(float(values[where[0]]) * dyadic.M)


async def _block(s: Settings, rule: StopRule) -> tuple[list[framing.Frame], Completion]:
    """The rows and COMPLETION of round 0 of slot 0 under ``rule`` (a fresh connection)."""
    async with await _negotiated(s) as peer:
        step: Step = peer.step_msg(depth=5, stop=int(rule.kind), threshold=rule.threshold)
        _, frames = await peer.reply(step)
    done = frames[-1].message
    assert isinstance(done, Completion)
    return frames[:-1], done


def check_cut(
    rule: StopRule,
    who: str,
    rows: list[framing.Frame],
    done: Completion,
    fixed: list[framing.Frame],
    end: int,
) -> None:
    """Check a block drawn under ``rule``: its ``rows`` are the first ``end`` rows of the
    ``fixed`` depth-5 block with the same key (``end``: where the rule, from the fixed
    block's counts, ends it), and its COMPLETION ``done`` says stopped exactly when
    ``end`` is below the depth. ``who`` names what shipped it in a failure.

    Raises:
        CaseFailed: for a block other than that.
    """
    if len(rows) != end:
        raise CaseFailed(
            f"{rule}: {who} shipped {len(rows)} rows; the rule, from the fixed block's "
            f"counts, ends the block after {end}"
        )
    for i, (a, b) in enumerate(zip(rows, fixed, strict=False)):
        if (a.message.token, bytes(a.payload)) != (b.message.token, bytes(b.payload)):  # type: ignore[union-attr]
            raise CaseFailed(f"{rule}: {who}'s row {i} differs from the fixed block's row {i}")
    if done.stopped != (end < 5):
        raise CaseFailed(f"{rule}: {who}'s COMPLETION stopped={done.stopped} after {end} of 5 rows")


def _applied(case_id: str, text: str) -> None:
    rule = StopRule.parse(text)

    async def run(s: Settings) -> None:
        fixed, _ = await _block(s, StopRule())
        if len(fixed) != 5:
            raise CaseFailed(f"the fixed depth-5 block has {len(fixed)} rows")
        ruled, done = await _block(s, rule)
        tokens = [f.message.token for f in fixed]  # type: ignore[union-attr]
        end = stop_after(rule, 5, [_row_count(f) for f in fixed], tokens, None)
        assert end is not None  # the depth ends it at the latest
        check_cut(rule, "the worker", ruled, done, fixed, end)

    case(
        case_id,
        f"{text}: the block is the fixed block cut where the rule ends it",
        "after row i the worker draws row i + 1 only if the rule, from the counts of rows "
        "1..i, continues; it ships every row it draws; stopped = fewer rows than the depth",
    )(run)


for _id, _text in (
    ("6.4.2", "confidence:0"),
    ("6.4.3", "confidence:0.5"),
    ("6.4.4", "confidence:1"),
    ("6.4.5", "joint:0.25"),
    ("6.4.6", "joint:1"),
    ("6.4.7", "joint:0.000001"),
):
    _applied(_id, _text)
