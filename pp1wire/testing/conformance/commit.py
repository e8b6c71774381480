"""§4.7 COMMIT, §4.8 RESET, CLOSE, and the §7 fencing of each."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pp1wire.errors import ErrorCode
from pp1wire.q.proposal import prefix_digest
from pp1wire.testing.builders import token_bytes
from pp1wire.testing.conformance import core
from pp1wire.wire.messages import Close, Commit, Message, MsgType, Reset, Step

case = core.Section("COMMIT and RESET").case


async def _drafts(peer: core.Peer, step: Step) -> list[int]:
    _data, frames = await peer.reply(step)
    return [f.message.token for f in frames if f.type is MsgType.REPLY]  # type: ignore[union-attr]


def _commit(peer: core.Peer, step: Step, tokens: Sequence[int], accepted: int, **kw: Any) -> Commit:
    new = [1, 2, 3, *tokens]
    extra = tokens[-1] if len(tokens) > accepted else None
    fields: dict[str, Any] = {
        "session": peer.session,
        "slot": step.slot,
        "generation": step.generation,
        "round": step.round,
        "accepted": accepted,
        "extra": extra,
        "position": len(new),
        "digest": prefix_digest(new),
    }
    return Commit(**fields | kw)


async def _commit_first(peer: core.Peer, step: Step, drafts: list[int]) -> None:
    """Commit ``step``'s round the usual way: its first draft accepted, then token 0."""
    await peer.ask(_commit(peer, step, [drafts[0], 0], 1), MsgType.COMMITTED)


def _commit_refusal(
    case_id: str,
    title: str,
    rule: str,
    code: ErrorCode,
    build: Callable[[core.Peer, Step, list[int]], Commit],
) -> None:
    async def run(s: core.Settings) -> None:
        async with core.ready(s) as (peer, step, data):
            drafts = await _drafts(peer, step)
            await peer.expect_refusal(build(peer, step, drafts), code)
            await core.unchanged(peer, step, data)
            await _commit_first(peer, step, drafts)  # the round can still be committed

    case(case_id, title, rule)(run)


_commit_refusal(
    "4.7.1",
    "accepted larger than the depth",
    "accepted ≤ the drafts of that round (COMMIT_INVALID)",
    ErrorCode.COMMIT_INVALID,
    lambda p, st, d: _commit(p, st, [*d, 0, 0, 0], 4),
)
_commit_refusal(
    "4.7.2",
    "accepted drafts that were not drafted",
    "accepted ≤ the drafts of that round",
    ErrorCode.COMMIT_INVALID,
    lambda p, st, d: _commit(p, core.with_fields(st, round=st.round + 1), [d[0], 0], 1),
)
_commit_refusal(
    "4.7.3",
    "wrong new position",
    "position (WRONG_POSITION)",
    ErrorCode.WRONG_POSITION,
    lambda p, st, d: _commit(p, st, [d[0], 0], 1, position=99),
)
_commit_refusal(
    "4.7.4",
    "wrong new digest",
    "digest (PREFIX_DIGEST_MISMATCH)",
    ErrorCode.PREFIX_DIGEST_MISMATCH,
    lambda p, st, d: _commit(p, st, [d[0], 0], 1, digest=1),
)
_commit_refusal(
    "4.7.5",
    "extra nil without an accepted terminal token",
    "extra nil only after an accepted eos (COMMIT_INVALID)",
    ErrorCode.COMMIT_INVALID,
    lambda p, st, d: _commit(p, st, [d[0]], 1),
)
_commit_refusal(
    "4.7.6",
    "extra outside the vocabulary",
    "extra < vocab_size (TOKEN_OUT_OF_RANGE)",
    ErrorCode.TOKEN_OUT_OF_RANGE,
    lambda p, st, d: _commit(p, st, [d[0], 0], 1, extra=p.s.vocab),
)
_commit_refusal(
    "4.7.7",
    "future generation",
    "COMMIT generation > slot generation: FUTURE_GENERATION",
    ErrorCode.FUTURE_GENERATION,
    lambda p, st, d: _commit(p, st, [d[0], 0], 1, generation=1),
)
_commit_refusal(
    "4.7.8",
    "another session",
    "WRONG_SESSION",
    ErrorCode.WRONG_SESSION,
    lambda p, st, d: _commit(p, st, [d[0], 0], 1, session=p.session + 1),
)


@case("7.9")
async def _commit_retry(s: core.Settings) -> None:
    """retried COMMIT is acknowledged identically

    COMMIT identical to the last applied COMMIT: replay COMMITTED
    """
    async with core.ready(s) as (peer, step, _):
        drafts = await _drafts(peer, step)
        msg = _commit(peer, step, [drafts[0], 0], 1)
        first = await peer.ask(msg, MsgType.COMMITTED)
        again = await peer.ask(msg, MsgType.COMMITTED)
        if bytes(first.raw) != bytes(again.raw):
            raise core.CaseFailed("the retried COMMIT got a different acknowledgement")


def _refused_after_commit(
    case_id: str, title: str, rule: str, build: Callable[[core.Peer, Step, list[int]], Message]
) -> None:
    """A case: once the first round is committed, ``build``'s message is ROUND_REUSED."""

    async def run(s: core.Settings) -> None:
        async with core.ready(s) as (peer, step, _):
            drafts = await _drafts(peer, step)
            await _commit_first(peer, step, drafts)
            await peer.expect_refusal(build(peer, step, drafts), ErrorCode.ROUND_REUSED)

    case(case_id, title, rule)(run)


_refused_after_commit(
    "7.10",
    "COMMIT for an already committed round",
    "COMMIT round ≤ last committed round: ROUND_REUSED",
    lambda p, st, d: _commit(
        p, st, [d[0], 0, 5], 1, extra=5, position=6, digest=prefix_digest([1, 2, 3, d[0], 0, 5])
    ),
)
_refused_after_commit(
    "7.11",
    "a STEP for a committed round is refused",
    "STEP round ≤ last committed round: ROUND_REUSED",
    lambda _p, st, d: core.with_fields(st, position=5, digest=prefix_digest([1, 2, 3, d[0], 0])),
)


@case("4.7.9")
async def _target_only_commit(s: core.Settings) -> None:
    """target-only commit under a fresh round

    a round with no usable proposal commits with accepted = 0 and extra = the target token
    """
    async with core.ready(s) as (peer, step, _):
        msg = _commit(peer, core.with_fields(step, round=9), [4], 0)
        ack = await peer.ask(msg, MsgType.COMMITTED)
        if ack.message.position != 4:  # type: ignore[union-attr]
            raise core.CaseFailed("COMMITTED reports a wrong position")
        nxt = core.with_fields(step, round=10, position=4, digest=prefix_digest([1, 2, 3, 4]))
        await peer.reply(nxt)


@case("4.8.1")
async def _reset_old(s: core.Settings) -> None:
    """RESET to an older generation

    RESET generation < slot generation: STALE_GENERATION
    """
    async with core.ready(s) as (peer, _step, _):
        await peer.ask(Reset(session=peer.session, slot=0, generation=2), MsgType.RESET_DONE)
        await peer.expect_refusal(
            Reset(session=peer.session, slot=0, generation=1), ErrorCode.STALE_GENERATION
        )


@case("4.8.2")
async def _reset_same(s: core.Settings) -> None:
    """RESET to the same generation is idempotent

    RESET generation = slot generation: replay RESET_DONE, change nothing
    """
    async with core.ready(s) as (peer, step, data):
        done = await peer.ask(Reset(session=peer.session, slot=0, generation=0), MsgType.RESET_DONE)
        if done.message.position != 3:  # type: ignore[union-attr]
            raise core.CaseFailed("RESET_DONE reports a wrong position")
        await core.unchanged(peer, step, data)


@case("4.8.3")
async def _stale_step(s: core.Settings) -> None:
    """STEP of the old generation after RESET

    RESET invalidates the old generation: STEP generation < slot generation is STALE_GENERATION
    """
    async with core.ready(s) as (peer, step, _):
        await peer.ask(Reset(session=peer.session, slot=0, generation=1), MsgType.RESET_DONE)
        await peer.expect_refusal(core.with_fields(step, round=1), ErrorCode.STALE_GENERATION)
        await peer.reply(core.with_fields(step, generation=1, round=0))  # rounds restart at 0


@case("4.8.4")
async def _stale_commit(s: core.Settings) -> None:
    """COMMIT of the old generation after RESET

    COMMIT generation < slot generation: STALE_GENERATION
    """
    async with core.ready(s) as (peer, step, _):
        drafts = await _drafts(peer, step)
        await peer.ask(Reset(session=peer.session, slot=0, generation=1), MsgType.RESET_DONE)
        await peer.expect_refusal(
            _commit(peer, step, [drafts[0], 0], 1), ErrorCode.STALE_GENERATION
        )


@case("4.8.5")
async def _reset_mid_reply(s: core.Settings) -> None:
    """RESET mid-reply, then the old rows

    on RESET the Spark side discards the in-flight proposal; later frames of the old generation are
    dropped; the worker finishes the old reply before RESET_DONE
    """
    async with await core.fresh(s) as peer:
        await peer.open_slot()
        peer.send_msg(peer.step_msg(round=0))
        peer.send_msg(Reset(session=peer.session, slot=0, generation=1))
        kinds: list[MsgType] = []
        while True:
            f = await peer.next()
            if f is None:
                raise core.CaseFailed(f"no RESET_DONE after {kinds}")
            kinds.append(f.type)
            if f.type is MsgType.RESET_DONE:
                break
        if MsgType.COMPLETION not in kinds:  # kinds ends at the first RESET_DONE
            raise core.CaseFailed(f"expected the old reply then RESET_DONE, got {kinds}")
        await peer.reply(peer.step_msg(generation=1, round=0))


@case("4.8.6")
async def _retry_after_reset(s: core.Settings) -> None:
    """the retried STEP after RESET is refused, not redrawn

    a retry never redraws under a used key and consumes an earlier q
    """
    async with core.ready(s) as (peer, step, _data):
        await peer.ask(Reset(session=peer.session, slot=0, generation=1), MsgType.RESET_DONE)
        await peer.expect_refusal(step, ErrorCode.STALE_GENERATION)


@case("4.3.10")
async def _close_step(s: core.Settings) -> None:
    """CLOSE then STEP

    CLOSE drops the slot; then UNKNOWN_SLOT
    """
    async with core.ready(s) as (peer, step, _):
        await peer.ask(Close(session=peer.session, slot=0), MsgType.CLOSED)
        await peer.expect_refusal(core.with_fields(step, round=1), ErrorCode.UNKNOWN_SLOT)
        await peer.open_slot(0, generation=1)  # free again, under a higher generation


@case("4.3.11")
async def _reopen_same_generation(s: core.Settings) -> None:
    """reopening a closed slot without a higher generation

    a slot reopened in the same session must use a generation greater than any it had before
    (STALE_GENERATION), so frames of its earlier instance stay fenced off
    """
    async with core.ready(s) as (peer, step, _):
        await peer.ask(Close(session=peer.session, slot=0), MsgType.CLOSED)
        await peer.expect_refusal(
            core.open_msg(peer, slot=0, tokens=(1, 2, 3)),
            ErrorCode.STALE_GENERATION,
            token_bytes((1, 2, 3)),
        )
        await peer.open_slot(0, generation=1)
        await peer.reply(core.with_fields(step, generation=1))


@case("4.3.12")
async def _close_unknown(s: core.Settings) -> None:
    """CLOSE of a slot that is not open

    CLOSE ... (UNKNOWN_SLOT if not open)
    """
    async with await core.fresh(s) as peer:
        await peer.expect_refusal(Close(session=peer.session, slot=1), ErrorCode.UNKNOWN_SLOT)


@case("4.8.7")
async def _reset_unknown(s: core.Settings) -> None:
    """RESET of a slot that is not open

    UNKNOWN_SLOT
    """
    async with await core.fresh(s) as peer:
        await peer.expect_refusal(
            Reset(session=peer.session, slot=1, generation=1), ErrorCode.UNKNOWN_SLOT
        )
