"""Baseline servers for benchmarks/run.py: the same reply bytes over a raw socket, ZeroMQ, gRPC.

``python benchmarks/peers.py KIND --size N`` listens on a free loopback port,
prints ``listening PORT`` and answers every request with N bytes (unvalidated):

* ``raw``: blocking socket; a request is 8 bytes ``<II`` (request length, reply
  length); the reply is the bytes, sent with one ``sendall``.
* ``zmq``: REP socket; the reply is sent with ``copy=False``.
* ``grpc``: a generic unary handler returning the bytes (64 MiB message limits).
* ``loop``: the raw protocol served by an asyncio protocol on uvloop, the event
  loop both pp1wire daemons run on, doing nothing per frame: with its client
  (also an asyncio protocol) it is the floor of any asyncio implementation.

Clients for each live in benchmarks/run.py. These are benchmark-only
dependencies (the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import socket
import struct
import sys
import time
from typing import Any


def serve_raw(size: int) -> None:
    payload = bytes(size)
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    print(f"listening {srv.getsockname()[1]}", flush=True)
    while True:
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            head = bytearray(8)
            while True:
                view = memoryview(head)
                got = 0
                while got < 8:
                    n = conn.recv_into(view[got:])
                    if not n:
                        break
                    got += n
                if got < 8:
                    break
                _, reply_len = struct.unpack("<II", head)
                conn.sendall(payload[:reply_len] if reply_len <= size else bytes(reply_len))


def serve_loop(size: int) -> None:
    import asyncio

    import uvloop

    payload = bytes(size)

    class Echo(asyncio.Protocol):
        def connection_made(self, transport: Any) -> None:
            # uvloop's transports are not asyncio.Transport subclasses.
            self.transport = transport
            self.head = bytearray()
            transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def data_received(self, data: bytes) -> None:
            self.head += data
            while len(self.head) >= 8:
                _, reply_len = struct.unpack_from("<II", self.head)
                del self.head[:8]
                self.transport.write(payload[:reply_len] if reply_len <= size else bytes(reply_len))

    async def serve() -> None:
        server = await asyncio.get_running_loop().create_server(Echo, "127.0.0.1", 0)
        print(f"listening {server.sockets[0].getsockname()[1]}", flush=True)
        await server.serve_forever()

    uvloop.run(serve())


def serve_zmq(size: int) -> None:
    import zmq

    payload = bytes(size)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REP)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    print(f"listening {port}", flush=True)
    while True:
        msg = sock.recv()
        n = struct.unpack("<I", msg[:4])[0]
        sock.send(payload[:n] if n <= size else bytes(n), copy=False)


def serve_grpc(size: int) -> None:
    from concurrent import futures

    import grpc

    payload = bytes(size)

    def handle(request: bytes, context: object) -> bytes:
        n = struct.unpack("<I", request[:4])[0]
        return payload[:n] if n <= size else bytes(n)

    handler = grpc.method_handlers_generic_handler(
        "bench.Bench",
        {"Get": grpc.unary_unary_rpc_method_handler(handle)},
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=2),
        options=[
            ("grpc.max_send_message_length", 64 << 20),
            ("grpc.max_receive_message_length", 64 << 20),
        ],
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"listening {port}", flush=True)
    while True:
        time.sleep(3600)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("kind", choices=["raw", "zmq", "grpc", "loop"])
    parser.add_argument("--size", type=int, default=10_342_400)
    args = parser.parse_args()
    serve = {"raw": serve_raw, "zmq": serve_zmq, "grpc": serve_grpc, "loop": serve_loop}
    serve[args.kind](args.size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
