"""§4.3 slots, §4.4 STEP, §4.5 replies, §6.4 determinism, §7 fencing of STEP, §8 limits."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import msgspec
import xxhash

from pp1wire.errors import ErrorCode
from pp1wire.errors import ErrorCode as E
from pp1wire.q import validate
from pp1wire.testing.builders import open_message, token_bytes
from pp1wire.testing.conformance import core
from pp1wire.wire import framing, messages
from pp1wire.wire.messages import MsgType, Open, Step

case = core.Section("session and STEP").case

R_SESSION = "session and slot first for every message: "
R_DEPTH = "depth (1..max_depth) else DEPTH_OUT_OF_RANGE"
R_REUSED = "round = last STEP round, any field different: ROUND_REUSED"
R_POSITION = "position (WRONG_POSITION)"
R_DIGEST = "digest (PREFIX_DIGEST_MISMATCH)"


def _step_refusal(
    case_id: str,
    title: str,
    rule: str,
    code: ErrorCode,
    build: Callable[[core.Peer, Step], Step] | None = None,
    **fields: Any,
) -> None:
    """A case: after a STEP answered, ``build``'s STEP (or the STEP with ``fields``) is
    refused with ``code`` and changes nothing."""

    async def run(s: core.Settings) -> None:
        async with core.ready(s) as (peer, step, data):
            bad = build(peer, step) if build else core.with_fields(step, **fields)
            await peer.expect_refusal(bad, code)
            await core.unchanged(peer, step, data)

    case(case_id, title, rule)(run)


_step_refusal("7.1", "STEP on an unknown slot", R_SESSION + "UNKNOWN_SLOT", E.UNKNOWN_SLOT, slot=1)
_step_refusal("7.2", "STEP on slot 65535", "UNKNOWN_SLOT", E.UNKNOWN_SLOT, slot=65535)
_step_refusal(
    "7.3",
    "STEP with another session",
    R_SESSION + "WRONG_SESSION",
    E.WRONG_SESSION,
    lambda p, st: core.with_fields(st, session=st.session + 1000),
)
for case_id, depth in (("4.4.1", 0), ("4.4.2", 6), ("4.4.3", 255)):
    _step_refusal(case_id, f"depth {depth}", R_DEPTH, E.DEPTH_OUT_OF_RANGE, round=1, depth=depth)
_step_refusal(
    "4.4.4",
    "support above the negotiated limit",
    "support ≤ max_support ... else SUPPORT_OUT_OF_RANGE",
    E.SUPPORT_OUT_OF_RANGE,
    lambda p, st: core.with_fields(st, round=1, support=p.hello_msg.max_support + 1),
)
_step_refusal(
    "7.4",
    "future generation",
    "STEP generation > slot generation: FUTURE_GENERATION",
    E.FUTURE_GENERATION,
    round=1,
    generation=1,
)
_step_refusal("7.5", "reused round with other content", R_REUSED, E.ROUND_REUSED, depth=1)
_step_refusal("7.6", "reused round, other temperature", R_REUSED, E.ROUND_REUSED, temperature=0.5)
_step_refusal(
    "4.4.5", "wrong first-draft position", R_POSITION, E.WRONG_POSITION, round=1, position=4
)
_step_refusal(
    "4.4.6", "position 0 after a 3-token prefix", R_POSITION, E.WRONG_POSITION, round=1, position=0
)
_step_refusal(
    "4.4.7",
    "wrong prefix digest",
    R_DIGEST,
    E.PREFIX_DIGEST_MISMATCH,
    lambda p, st: core.with_fields(st, round=1, digest=st.digest ^ 1),
)
_step_refusal(
    "4.4.8",
    "wrong context version",
    "context (CONTEXT_MISMATCH)",
    E.CONTEXT_MISMATCH,
    round=1,
    context=5,
)
for case_id, (label, value) in zip(
    ("4.4.9", "4.4.10", "4.4.11"),
    (("NaN", math.nan), ("+inf", math.inf), ("negative", -1.0)),
    strict=True,
):
    _step_refusal(
        case_id,
        f"temperature {label}",
        "temperature finite and ≥ 0 (BAD_TEMPERATURE)",
        E.BAD_TEMPERATURE,
        round=1,
        temperature=value,
    )


@case("7.7")
async def _older_round(s: core.Settings) -> None:
    """older round after a newer one

    STEP round < last STEP round: ROUND_REUSED
    """
    peer = await core.fresh(s)
    async with peer:
        await peer.open_slot()
        newer = core.with_fields(peer.step_msg(), round=5)
        data5, _ = await peer.reply(newer)
        await peer.expect_refusal(core.with_fields(newer, round=3), ErrorCode.ROUND_REUSED)
        await core.unchanged(peer, newer, data5)


@case("7.8")
async def _retry(s: core.Settings) -> None:
    """retried STEP gets the byte-identical reply

    a retried STEP therefore returns the byte-identical reply or is refused; it is never answered
    with a fresh draw
    """
    async with core.ready(s) as (peer, step, data):
        for _ in range(3):
            await core.unchanged(peer, step, data)


@case("6.4.1")
async def _deterministic(s: core.Settings) -> None:
    """the same STEP on two connections gets the same reply

    draws are keyed by (seed, generation, round, position, domain): no hidden state
    """
    async with await core.fresh(s) as a:
        await a.open_slot()
        step = a.step_msg()
        _, first = await a.reply(step)
    async with await core.fresh(s) as b:
        await b.open_slot()
        _, second = await b.reply(core.with_fields(step, session=b.session))
        if [bytes(f.payload) for f in first] != [bytes(f.payload) for f in second]:
            raise core.CaseFailed("payloads differ across connections for the same key")


@case("4.5.1")
async def _rows(s: core.Settings) -> None:
    """reply rows are well formed

    REPLY frames for positions 0, 1, … in order, then COMPLETION; row checksum; q contract
    """
    async with await core.fresh(s) as peer:
        await peer.open_slot()
        step = peer.step_msg()
        _, frames = await peer.reply(step)
    rows = [f for f in frames if f.type is MsgType.REPLY]
    done = frames[-1].message
    assert isinstance(done, messages.Completion)
    body = b"".join(bytes(f.raw) for f in rows)
    if done.reply_bytes != len(body) or done.reply_checksum != xxhash.xxh3_64_intdigest(body):
        raise core.CaseFailed("COMPLETION size or checksum does not match the rows")
    for i, f in enumerate(rows):
        r = f.message
        assert isinstance(r, messages.Reply)
        if r.index != i or r.position != step.position + i:
            raise core.CaseFailed(f"row {i} has index {r.index}, position {r.position}")
        if r.checksum != xxhash.xxh3_64_intdigest(bytes(f.payload)):
            raise core.CaseFailed(f"row {i} checksum wrong")
        split = 4 * r.entries
        validate.validate_sparse(
            bytes(f.payload)[:split], bytes(f.payload)[split:], s.vocab, step.support, r.token
        )


@case("4.5.2")
async def _dense(s: core.Settings) -> None:
    """a dense reply validates

    dense: entries = row_entries FP32 values; padding +0.0; the q contract of §6.2
    """
    async with await core.fresh(s) as peer:
        await peer.open_slot()
        _, frames = await peer.reply(peer.step_msg(depth=1, support=0))
        (row,) = [f for f in frames if f.type is MsgType.REPLY]
        r = row.message
        assert isinstance(r, messages.Reply)
        if r.representation != 0 or r.entries != s.vocab:
            raise core.CaseFailed("dense row with wrong representation or entries")
        validate.validate_dense(bytes(row.payload), s.vocab, r.token)


@case("4.5.3")
async def _token_width(s: core.Settings) -> None:
    """every REPLY carries its token as a 4-byte bin

    token: a msgpack bin of exactly 4 bytes, the ID as a little-endian uint32, so a row's
    frame length never depends on its own draw (docs/adaptive.md §7)
    """
    async with await core.fresh(s) as peer:
        await peer.open_slot()
        _, frames = await peer.reply(peer.step_msg())
    for f in frames:
        if f.type is not MsgType.REPLY:
            continue
        r = f.message
        assert isinstance(r, messages.Reply)
        end = framing.PREAMBLE_SIZE + int.from_bytes(f.raw[6:8], "little")
        header = bytes(f.raw[framing.PREAMBLE_SIZE : end])
        token = msgspec.msgpack.decode(header)[7]
        if not isinstance(token, bytes) or len(token) != messages.TOKEN_WIDTH:
            raise core.CaseFailed(f"row {r.index}: token sent as {token!r}, not 4 bytes")
        if int.from_bytes(token, "little") != r.token:
            raise core.CaseFailed(f"row {r.index}: token bytes {token.hex()} are not {r.token}")
        if header != messages.encode(r):
            raise core.CaseFailed(f"row {r.index}: header not in its shortest form (§3.2)")


@case("4.3.1")
async def _slot_limit(s: core.Settings) -> None:
    """more slots than negotiated

    slot < max_slots (SLOT_LIMIT)
    """
    async with await core.fresh(s) as peer:
        await peer.expect_refusal(open_message(peer.session, s.slots, []), ErrorCode.SLOT_LIMIT)
        await peer.open_slot(0)
        await peer.reply(peer.step_msg())


def _open_refusal(
    case_id: str,
    title: str,
    rule: str,
    code: ErrorCode,
    build: Callable[[core.Peer], tuple[Open, bytes]],
) -> None:
    async def run(s: core.Settings) -> None:
        async with core.ready(s) as (peer, step, data):
            msg, payload = build(peer)
            await peer.expect_refusal(msg, code, payload)
            await core.unchanged(peer, step, data)

    case(case_id, title, rule)(run)


_open_refusal(
    "4.3.2",
    "OPEN of a slot in use",
    "slot free (SLOT_IN_USE)",
    ErrorCode.SLOT_IN_USE,
    lambda p: (core.open_msg(p, slot=0, seed=99), token_bytes((1, 2))),
)
_open_refusal(
    "4.3.3",
    "OPEN with a wrong digest",
    R_DIGEST,
    ErrorCode.PREFIX_DIGEST_MISMATCH,
    lambda p: (core.open_msg(p, digest=5), token_bytes((1, 2))),
)
_open_refusal(
    "4.3.4",
    "OPEN with a token outside the vocabulary",
    "every token and eos < vocab_size (TOKEN_OUT_OF_RANGE)",
    ErrorCode.TOKEN_OUT_OF_RANGE,
    lambda p: (core.open_msg(p, tokens=(1, p.s.vocab)), token_bytes((1, p.s.vocab))),
)
_open_refusal(
    "4.3.5",
    "OPEN with a negative token",
    "every token < vocab_size (TOKEN_OUT_OF_RANGE)",
    ErrorCode.TOKEN_OUT_OF_RANGE,
    lambda p: (core.open_msg(p, tokens=(1, -1)), token_bytes((1, -1))),
)
_open_refusal(
    "4.3.6",
    "OPEN with eos outside the vocabulary",
    "every token and eos < vocab_size",
    ErrorCode.TOKEN_OUT_OF_RANGE,
    lambda p: (core.open_msg(p, eos=p.s.vocab), token_bytes((1, 2))),
)
_open_refusal(
    "4.3.7",
    "OPEN whose payload is shorter than prefix_len",
    "payload_len = 4 x prefix_len (PAYLOAD_LENGTH)",
    ErrorCode.PAYLOAD_LENGTH,
    lambda p: (core.open_msg(p, tokens=(1, 2), prefix_len=3), token_bytes((1, 2))),
)
_open_refusal(
    "4.3.8",
    "OPEN with another session",
    "session (WRONG_SESSION)",
    ErrorCode.WRONG_SESSION,
    lambda p: (core.open_msg(p, session=p.session + 1), token_bytes((1, 2))),
)


@case("4.3.9")
async def _open_twice(s: core.Settings) -> None:
    """an identical OPEN is acknowledged again

    an identical OPEN of a slot with no commit yet is answered with OPENED again
    """
    async with await core.fresh(s) as peer:
        await peer.open_slot(0)
        await peer.open_slot(0)


@case("8.1")
async def _open_too_long(s: core.Settings) -> None:
    """OPEN prefix longer than negotiated

    payload ≤ min(4 x max_prefix, max_frame), checked from the preamble
    """
    async with await core.fresh(s) as peer:
        n = peer.hello_msg.max_prefix + 1
        await peer.expect_fatal(
            core.open_msg(peer, slot=0, tokens=[1] * n),
            ErrorCode.FRAME_TOO_LARGE,
            token_bytes([1] * n),
        )


@case("4.4.12")
async def _temperature_encodings(s: core.Settings) -> None:
    """temperature sent as an integer or float32

    temperature: a receiver accepts msgpack float 64, float 32 or integer and takes the value
    """
    async with core.ready(s) as (peer, step, data):
        header = bytearray(messages.encode(step))
        at = header.index(b"\xcb\x3f\xf0\x00\x00\x00\x00\x00\x00")  # 1.0 as float 64
        for encoding in (b"\x01", b"\xca\x3f\x80\x00\x00"):  # integer 1, float 32 1.0
            changed = bytes(header[:at]) + encoding + bytes(header[at + 9 :])
            peer.send(peer.raw(int(MsgType.STEP), changed))
            frames = []
            while (f := await peer.next()) is not None and f.type is not MsgType.COMPLETION:
                if f.type is MsgType.ERROR:
                    raise core.CaseFailed(f"refused: {core.describe(f)}")
                frames.append(bytes(f.raw))
            if f is None:
                raise core.CaseFailed("no reply")
            if b"".join(frames) + bytes(f.raw) != data:
                raise core.CaseFailed("not the reply of temperature 1.0")


@case("4.4.13")
async def _uncommitted(s: core.Settings) -> None:
    """a fresh STEP while the last one is uncommitted

    at most one uncommitted fresh proposal per slot: a STEP for a new round before the last STEP's
    round is committed (or the slot reset) is refused (STEP_UNCOMMITTED)
    """
    async with core.ready(s) as (peer, step, data):
        await peer.expect_refusal(
            core.with_fields(step, round=step.round + 1), ErrorCode.STEP_UNCOMMITTED
        )
        await core.unchanged(peer, step, data)
