"""Conformance cases for frame integrity after a keyed handshake (protocol §5.1)."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Awaitable, Callable

import msgspec
import xxhash

from pp1wire.errors import ErrorCode
from pp1wire.testing.builders import open_message, token_bytes
from pp1wire.testing.conformance import core
from pp1wire.wire import framing, integrity
from pp1wire.wire.messages import Completion, MsgType, Ping

case = core.Section("integrity").case

R_TAGS = (
    "with a PSK, every frame after AUTH (Spark side) and from the worker's HELLO on carries "
    "tag_n = HMAC-SHA256(K, u64le(n) ‖ frame)[0:16]; a missing or wrong tag is fatal "
    "(INTEGRITY_FAILED)"
)


async def _keyed(s: core.Settings) -> core.Peer:
    """A handshaken peer on a keyed connection (skipped without ``--psk-file``)."""
    if s.psk is None:
        raise core.NonStrictSkip("needs --psk-file")
    return await core.fresh(s)


def _sealer(peer: core.Peer) -> integrity.Sealer:
    assert peer.sealer is not None  # a keyed handshake sets it
    return peer.sealer


@case(
    "5.1.1",
    "the worker's frames are tagged from its HELLO on, and the tags verify",
    R_TAGS + "; COMPLETION's reply_bytes and reply_checksum cover the REPLY frames "
    "without their tags",
)
async def _tagged_round(s: core.Settings) -> None:
    async with await _keyed(s) as peer:
        if not peer.tags_seen:
            raise core.CaseFailed("the worker's HELLO carried no tag")
        await peer.open_slot(0)
        await peer.open_slot(1)
        for step in (peer.step_msg(), peer.step_msg(slot=1, support=0)):
            body, frames = await peer.reply(step)
            done = frames[-1].message
            assert isinstance(done, Completion)
            rows = body[: len(body) - len(frames[-1].raw)]
            if done.reply_bytes != len(rows):
                raise core.CaseFailed(f"reply_bytes {done.reply_bytes}, rows {len(rows)} bytes")
            if done.reply_checksum != xxhash.xxh3_64_intdigest(rows):
                raise core.CaseFailed("reply_checksum does not cover the untagged REPLY frames")


def _refusal_case(
    case_id: str, title: str, rule: str, build: Callable[[core.Peer], Awaitable[bytes]]
) -> None:
    """A case: on a keyed connection, the bytes ``build`` makes are INTEGRITY_FAILED, fatal."""

    async def run(s: core.Settings) -> None:
        async with await _keyed(s) as peer:
            peer.send(await build(peer))
            await peer.expect_error(ErrorCode.INTEGRITY_FAILED, fatal=True)
        await core.still_serves(s)

    case(case_id, title, rule)(run)


async def _changed_step(peer: core.Peer) -> bytes:
    await peer.open_slot()
    step = peer.step_msg()
    tag = _sealer(peer).tag_next(framing.encode_frame(step, tagged=True))
    return framing.encode_frame(msgspec.structs.replace(step, depth=1), tagged=True) + tag


async def _changed_open(peer: core.Peer) -> bytes:
    msg = open_message(peer.session, 0, (1, 2, 3), seed=7)
    tag = _sealer(peer).tag_next(framing.encode_frame(msg, token_bytes((1, 2, 3)), tagged=True))
    return framing.encode_frame(msg, token_bytes((1, 2, 4)), tagged=True) + tag


async def _untagged(peer: core.Peer) -> bytes:
    return framing.encode_frame(Ping(nonce=4))


async def _replayed(peer: core.Peer) -> bytes:
    frame = peer.frame(Ping(nonce=5))
    peer.send(frame)
    await peer.expect(MsgType.PONG)
    return frame


async def _guessed_key(peer: core.Peer) -> bytes:
    # The relay saw every handshake byte but not the key: its best guess.
    guess = integrity.Sealer(hashlib.sha256(b"no key").digest())
    guess.seq = _sealer(peer).seq
    return guess.seal(framing.encode_frame(Ping(nonce=6), tagged=True))


for case_id, title, rule, build in (
    (
        "5.1.2",
        "a relayed frame whose header was changed (checksum recomputed) is refused",
        R_TAGS,
        _changed_step,
    ),
    (
        "5.1.3",
        "a relayed frame whose payload was changed is refused",
        R_TAGS + " (the tag covers the payload, which no checksum of §3 does)",
        _changed_open,
    ),
    ("5.1.4", "an untagged frame after AUTH is refused", R_TAGS, _untagged),
    (
        "5.1.5",
        "a frame replayed with its earlier tag is refused",
        R_TAGS + "; n counts the tagged frames of a direction, so a replay carries a stale n",
        _replayed,
    ),
    (
        "5.1.6",
        "a relay that forwarded the handshake cannot drive the connection",
        R_TAGS + "; K is derived from the PSK, which a relay does not have",
        _guessed_key,
    ),
):
    _refusal_case(case_id, title, rule, build)


@case(
    "5.1.7",
    "a keyed worker refuses a HELLO that names no integrity scheme",
    f"integrity: {integrity.SCHEME!r} with a PSK, exact (INTEGRITY_MISMATCH)",
)
async def _no_scheme(s: core.Settings) -> None:
    if s.psk is None:
        raise core.NonStrictSkip("needs --psk-file")
    async with await core.Peer(s).connect() as peer:
        with contextlib.suppress(core.CaseFailed):  # the refusal is read next
            await peer.handshake(peer.hello(integrity=""))
        await peer.expect_error(ErrorCode.INTEGRITY_MISMATCH, fatal=True)


@case("5.1.8")
async def _scheme_without_key(s: core.Settings) -> None:
    """a worker without a key refuses a HELLO that names a scheme

    integrity: "" without a PSK, exact (INTEGRITY_MISMATCH)
    """
    if s.psk is not None:
        raise core.NonStrictSkip("runs without --psk-file")
    async with await core.Peer(s).connect() as peer:
        await peer.expect_fatal(
            peer.hello(integrity=integrity.SCHEME), ErrorCode.INTEGRITY_MISMATCH
        )
