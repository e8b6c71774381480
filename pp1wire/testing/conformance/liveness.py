"""§2 connections and sessions, §4.9 ERROR, §4.10 PING, §8 a slow reader."""

from __future__ import annotations

import dataclasses

import msgspec

from pp1wire.errors import ErrorCode
from pp1wire.testing.conformance import core
from pp1wire.wire import framing
from pp1wire.wire.messages import Error, MsgType, Ping, Pong

case = core.Section("liveness and close").case


@case("4.10.2")
async def _ping(s: core.Settings) -> None:
    """PING gets PONG with the same nonce

    the peer answers PONG with the same nonce
    """
    async with await core.fresh(s) as peer:
        for nonce in (0, 1, 2**64 - 1):
            frame = await peer.ask(Ping(nonce=nonce), MsgType.PONG)
            if frame.message.nonce != nonce:  # type: ignore[union-attr]
                raise core.CaseFailed("PONG nonce differs")


@case("2.1")
async def _reconnect(s: core.Settings) -> None:
    """a new connection does not inherit slots

    a connection that ends ends its session: every slot ... is invalid
    """
    async with core.ready(s) as (_, step, _):
        pass  # the connection ends with the block
    async with await core.fresh(s) as other:
        await other.expect_refusal(
            core.with_fields(step, session=other.session, round=1), ErrorCode.UNKNOWN_SLOT
        )


@case("2.2")
async def _old_session(s: core.Settings) -> None:
    """old session ID on a new connection

    session and slot first for every message: WRONG_SESSION
    """
    async with core.ready(s) as (peer, step, _):
        old = peer.session  # the connection ends with the block
    async with await core.fresh(s) as other:
        if other.session == old:
            raise core.CaseFailed("a new connection got the old session ID")
        await other.expect_refusal(core.with_fields(step, round=1), ErrorCode.WRONG_SESSION)


@case("4.9.1")
async def _error_scope(s: core.Settings) -> None:
    """ERROR with scope 2 from the peer ends the connection

    scope 2 = the connection is dead and the sender closes it
    """
    async with await core.fresh(s) as peer:
        peer.send_msg(Error(code=int(ErrorCode.INTERNAL), answers=0, scope=2))
        peer.close()
    await core.still_serves(s)


@case("4.9.2")
async def _error_shape(s: core.Settings) -> None:
    """a refusal carries no free text

    no free text travels on the wire: ERROR has exactly code, answers, scope, slot, generation,
    round
    """
    async with core.ready(s) as (peer, step, _):
        frame = await peer.ask(core.with_fields(step, round=1, depth=0), MsgType.ERROR)
        items = msgspec.msgpack.decode(bytes(frame.raw)[framing.PREAMBLE_SIZE :])
        if not isinstance(items, list) or len(items) > 7:
            raise core.CaseFailed(f"ERROR header has {items!r}")


@case("2.3")
async def _idle(s: core.Settings) -> None:
    """idle connections are eventually closed

    a worker drops a connection idle past its idle timeout (IDLE_TIMEOUT, fatal)
    """
    if s.idle_wait is None:
        raise core.NonStrictSkip("needs --idle-wait (longer than the worker's idle timeout)")
    async with await core.fresh(s) as peer:
        frame = await peer.next(s.idle_wait)
        if frame is None:
            raise core.CaseFailed(f"still open after {s.idle_wait:.0f} s idle")
        peer.unread(frame)
        await peer.expect_error(ErrorCode.IDLE_TIMEOUT, fatal=True)


@case("8.2")
async def _slow_reader(s: core.Settings) -> None:
    """a peer that does not read does not stall the worker

    replies queue behind a slow reader; other connections are served meanwhile
    """
    retries = 32
    async with await core.fresh(s) as peer:
        await peer.open_slot()
        step = peer.step_msg()
        for _ in range(retries + 1):  # the STEP, then identical retries: replayed bytes
            peer.send_msg(step)
        # Nothing read on this connection yet: another must still be served now.
        await core.still_serves(s)
        replies: list[bytes] = []
        for _ in range(retries + 1):
            frames = []
            while (f := await peer.next()) is not None and f.type is not MsgType.COMPLETION:
                frames.append(bytes(f.raw))
            if f is None:
                raise core.CaseFailed(f"only {len(replies)} of {retries + 1} replies arrived")
            replies.append(b"".join(frames) + bytes(f.raw))
        if len(set(replies)) != 1:
            raise core.CaseFailed("a retried STEP got a different reply")


@case("4.10.3")
async def _pong_first(s: core.Settings) -> None:
    """PONG before HELLO is ignored

    PING, PONG and ERROR are allowed before the handshake; a PONG answers nothing of the worker's,
    so it is ignored (section 5 transition table)
    """
    async with await core.Peer(s).connect() as peer:
        peer.send_msg(Pong(nonce=5))
        if not await peer.quiet(0.3):
            raise core.CaseFailed("the worker reacted to a PONG")
        await peer.handshake()


@case("8.3")
async def _flood_unread(s: core.Settings) -> None:
    """uncommitted STEPs from a peer that does not read are refused, not drawn

    one fresh proposal per slot until COMMIT or RESET (STEP_UNCOMMITTED); a worker stops reading a
    peer whose replies back up, and serves the others meanwhile (§8)
    """
    rounds = 200
    async with await core.fresh(s) as peer:
        await peer.open_slot()
        for r in range(rounds):
            peer.send_msg(peer.step_msg(round=r))
        await core.still_serves(s)
        while (f := await peer.next()) is not None and f.type is not MsgType.COMPLETION:
            pass
        if f is None:
            raise core.CaseFailed("the first STEP got no complete reply")
        for _ in range(rounds - 1):
            await peer.expect_error(ErrorCode.STEP_UNCOMMITTED, fatal=False)


def _plain(s: core.Settings) -> core.Settings:
    """The same worker over plain TCP (for TLS-only cases; skipped without ``--tls-ca``)."""
    if s.ssl is None:
        raise core.NonStrictSkip("needs a TLS worker (--tls-ca)")
    return dataclasses.replace(s, ssl=None)


@case("2.4")
async def _silent_tls(s: core.Settings) -> None:
    """a connection that never starts TLS is closed within the handshake timeout

    the handshake timeout runs from accept, TLS included (§2, §5)
    """
    async with await core.Peer(_plain(s)).connect() as peer:
        if not await peer.closed(s.handshake_wait):
            raise core.CaseFailed(f"still open after {s.handshake_wait:.0f} s")


@case("2.5")
async def _plaintext_to_tls(s: core.Settings) -> None:
    """a plaintext frame to a TLS worker gets TLS_REQUIRED

    a worker serving TLS SHOULD answer a peer whose first bytes are the frame magic with a plaintext
    fatal ERROR TLS_REQUIRED (§2)
    """
    async with await core.Peer(_plain(s)).connect() as peer:
        await peer.expect_fatal(peer.hello(), ErrorCode.TLS_REQUIRED)
