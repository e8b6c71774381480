"""Baseline servers for benchmarks/run.py: the same reply bytes over a raw socket, ZeroMQ, gRPC.

``python benchmarks/peers.py KIND --size N`` listens on a free loopback port,
prints ``listening PORT`` and answers every request with N bytes (unvalidated):

* ``raw``: blocking socket; a request is 8 bytes ``<II`` (request length, reply
  length); the reply is the bytes, sent with one ``sendall``.
* ``zmq``: REP socket; the reply is sent with ``copy=False``.
* ``grpc``: a generic unary handler returning the bytes (64 MiB message limits).

Clients for each live in benchmarks/run.py. These are benchmark-only
dependencies (the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import socket
import struct
import sys
import time


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
    parser.add_argument("kind", choices=["raw", "zmq", "grpc"])
    parser.add_argument("--size", type=int, default=10_342_400)
    args = parser.parse_args()
    {"raw": serve_raw, "zmq": serve_zmq, "grpc": serve_grpc}[args.kind](args.size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
