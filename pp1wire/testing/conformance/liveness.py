"""§2 connections and sessions, §4.9 ERROR, §4.10 PING, §8 a slow reader."""

from __future__ import annotations

import asyncio

import msgspec

from pp1wire.errors import ErrorCode
from pp1wire.testing.conformance.core import (
    CaseFailed,
    NonStrictSkip,
    Settings,
    case,
    fresh,
    ready,
    still_serves,
    with_fields,
)
from pp1wire.wire import framing
from pp1wire.wire.messages import (
    Error,
    MsgType,
    Ping,
)

# -- liveness and close --------------------------------------------------------------------


@case(
    "4.10.2",
    "liveness and close",
    "PING gets PONG with the same nonce",
    "the peer answers PONG with the same nonce",
)
async def _ping(s: Settings) -> None:
    async with await fresh(s) as peer:
        for nonce in (0, 1, 2**64 - 1):
            peer.send_msg(Ping(nonce=nonce))
            frame = await peer.expect(MsgType.PONG)
            if frame.message.nonce != nonce:  # type: ignore[union-attr]
                raise CaseFailed("PONG nonce differs")


@case(
    "2.1",
    "liveness and close",
    "a new connection does not inherit slots",
    "a connection that ends ends its session: every slot ... is invalid",
)
async def _reconnect(s: Settings) -> None:
    peer, step, _ = await ready(s)
    peer.close()
    async with await fresh(s) as other:
        other.send_msg(with_fields(step, session=other.session, round=1))
        await other.expect_error(ErrorCode.UNKNOWN_SLOT, fatal=False, answers=MsgType.STEP)


@case(
    "2.2",
    "liveness and close",
    "old session ID on a new connection",
    "session and slot first for every message: WRONG_SESSION",
)
async def _old_session(s: Settings) -> None:
    peer, step, _ = await ready(s)
    old = peer.session
    peer.close()
    async with await fresh(s) as other:
        if other.session == old:
            raise CaseFailed("a new connection got the old session ID")
        other.send_msg(with_fields(step, round=1))
        await other.expect_error(ErrorCode.WRONG_SESSION, fatal=False, answers=MsgType.STEP)


@case(
    "4.9.1",
    "liveness and close",
    "ERROR with scope 2 from the peer ends the connection",
    "scope 2 = the connection is dead and the sender closes it",
)
async def _error_scope(s: Settings) -> None:
    async with await fresh(s) as peer:
        peer.send_msg(Error(code=int(ErrorCode.INTERNAL), answers=0, scope=2))
        peer.close()
    await still_serves(s)


@case(
    "4.9.2",
    "liveness and close",
    "a refusal carries no free text",
    "no free text travels on the wire: ERROR has exactly code, answers, scope, slot, "
    "generation, round",
)
async def _error_shape(s: Settings) -> None:
    peer, step, _ = await ready(s)
    async with peer:
        peer.send_msg(with_fields(step, round=1, depth=0))
        frame = await peer.expect(MsgType.ERROR)
        header = bytes(frame.raw)[framing.PREAMBLE_SIZE :]
        items = msgspec.msgpack.decode(header)
        if not isinstance(items, list) or len(items) > 7:
            raise CaseFailed(f"ERROR header has {items!r}")


@case(
    "2.3",
    "liveness and close",
    "idle connections are eventually closed",
    "a worker drops a connection idle past its idle timeout (IDLE_TIMEOUT)",
    informational=True,
)
async def _idle(s: Settings) -> None:
    raise NonStrictSkip("idle timeouts are minutes long; checked by the test suite instead")


@case(
    "8.2",
    "liveness and close",
    "a slow reader does not make the worker buffer without bound",
    "every length is checked against its limit before any buffer of that size is allocated",
    informational=True,
)
async def _slow_reader(s: Settings) -> None:
    async with await fresh(s) as peer:
        await peer.open_slot()
        for r in range(3):
            peer.send_msg(peer.step_msg(round=r))
        await asyncio.sleep(0.2)
        for _ in range(3):
            while (f := await peer.next()) is not None and f.type is not MsgType.COMPLETION:
                pass
