"""Admission under attack: keyless floods, squatters, and the per-address limit.

A full worker admits a newcomer by replacing a peer that cannot be doing useful
work: first one still in its handshake, then an authenticated one that made the
worker draw nothing lately. An authenticated peer is replaced only once the
newcomer has itself authenticated (docs/protocol.md §2).
"""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from pp1wire.aio.client import AsyncClient, ConnectionLostError, RefusedError
from pp1wire.aio.server import WorkerServer
from pp1wire.apps.models import drafter_factory
from pp1wire.errors import ErrorCode
from pp1wire.testing.attacks import probe
from pp1wire.wire import framing
from pp1wire.wire.spark_core import SparkConfig
from pp1wire.wire.worker_core import WorkerConfig

from .waiting import eventually

VOCAB = 64
PSK = b"only the operator's clients hold this key"


def _count(counter) -> float:
    return counter._value.get()


async def _draw_once(client: AsyncClient) -> None:
    """Open slot 0 and have one proposal drawn (the work that protects a connection)."""
    await client.open(0, seed=1, prefix=[1, 2])
    proposal = await client.propose(0, round_id=client.next_round(0), depth=1)
    proposal.release()


async def _still_served(clients: list[AsyncClient]) -> list[bool]:
    alive = []
    for c in clients:
        try:
            await asyncio.wait_for(c.ping(), 5)
            alive.append(True)
        except (ConnectionLostError, TimeoutError):
            alive.append(False)
    return alive


async def _shut(
    srv: WorkerServer, sockets: list[socket.socket], clients: list[AsyncClient]
) -> None:
    """Close the raw sockets and the clients, then stop the worker."""
    for s in sockets:
        s.close()
    for c in clients:
        await c.close()
    await srv.stop(grace=1.0)


@pytest.mark.asyncio
async def test_a_keyless_flood_never_evicts_an_authenticated_peer():
    # No first-draw grace: the held peers never drew, as replaceable as they can
    # be, so only the key decides. The flood keeps its connections open (a
    # connection that hangs up frees its place on its own).
    srv = WorkerServer(
        WorkerConfig(vocab_size=VOCAB, psk=PSK),
        drafter_factory(VOCAB),
        max_connections=4,
        handshake_grace=0.0,
    )
    port = await srv.start("127.0.0.1", 0)
    keyed = SparkConfig(vocab_size=VOCAB, psk=PSK)
    held = [await AsyncClient.connect("127.0.0.1", port, keyed) for _ in range(4)]
    flood: list[socket.socket] = []
    try:
        for _ in range(30):
            flood.append(await asyncio.to_thread(socket.create_connection, ("127.0.0.1", port)))
        # A keyless HELLO (answered with a CHALLENGE it cannot meet) changes nothing either.
        hello_only = SparkConfig(vocab_size=VOCAB)
        with pytest.raises((RefusedError, ConnectionLostError, OSError, TimeoutError)):
            await AsyncClient.connect("127.0.0.1", port, hello_only, timeout=1.0)
        assert await _still_served(held) == [True] * 4
        assert _count(srv.metrics.evictions) >= 1  # flood connections replaced each other
        # A client with the key still gets in, and takes one idle peer's place.
        took = await asyncio.wait_for(probe(port, VOCAB, keyed), 10)
        assert took > 0
        assert (await _still_served(held)).count(True) == 3
    finally:
        await _shut(srv, flood, held)


@pytest.mark.asyncio
async def test_squatters_stop_being_protected_once_their_slots_sit_idle():
    # Peers that each drew once and then sit filled the worker forever. A fresh draw
    # protects its connection only for the slot idle timeout.
    async def attempt(slot_idle_timeout: float) -> tuple[bool, list[bool]]:
        srv = WorkerServer(
            WorkerConfig(vocab_size=VOCAB),
            drafter_factory(VOCAB),
            max_connections=3,
            handshake_grace=0.0,
            slot_idle_timeout=slot_idle_timeout,
        )
        port = await srv.start("127.0.0.1", 0)
        squatters = [
            await AsyncClient.connect("127.0.0.1", port, SparkConfig(vocab_size=VOCAB))
            for _ in range(3)
        ]
        try:
            for c in squatters:
                await _draw_once(c)
            if slot_idle_timeout < 60:
                await eventually(
                    lambda: all(srv.replaceable(c, time.monotonic()) for c in srv.conns),
                    what="the squatters' slots have sat idle past the limit",
                )
            try:
                await asyncio.wait_for(probe(port, VOCAB), 10)
                served = True
            except (RefusedError, ConnectionLostError, OSError):
                served = False
            return served, await _still_served(squatters)
        finally:
            await _shut(srv, [], squatters)

    protected = await attempt(slot_idle_timeout=3600.0)
    assert protected == (False, [True, True, True])  # peers that drew lately are kept
    served, alive = await attempt(slot_idle_timeout=0.05)
    assert served
    assert alive.count(True) == 2  # exactly one squatter made room


@pytest.mark.asyncio
async def test_the_per_address_limit_replaces_a_handshake_and_refuses_beyond_busy_peers():
    srv = WorkerServer(
        WorkerConfig(vocab_size=VOCAB), drafter_factory(VOCAB), max_per_address=2
    )
    port = await srv.start("127.0.0.1", 0)
    silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
    clients: list[AsyncClient] = []
    try:
        # A client's connection from the same address replaces one stuck in its
        # handshake (say, its own earlier attempt) rather than being refused.
        for _ in range(2):
            clients.append(
                await AsyncClient.connect("127.0.0.1", port, SparkConfig(vocab_size=VOCAB))
            )
        await eventually(lambda: len(srv.conns) == 2, what="the two handshakes replaced")
        for c in clients:
            await _draw_once(c)
        # Two authenticated, busy connections from the address: a third is refused.
        extra = socket.create_connection(("127.0.0.1", port))
        extra.settimeout(5.0)
        (frame,) = framing.FrameDecoder().feed(await asyncio.to_thread(extra.recv, 1 << 16))
        assert frame.message.code == ErrorCode.CONNECTION_LIMIT
        extra.close()
        assert await _still_served(clients) == [True, True]
    finally:
        await _shut(srv, silent, clients)
