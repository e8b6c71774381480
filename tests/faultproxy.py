"""A small asyncio TCP proxy that injects byte- and frame-level faults (:class:`Faults`) between a
Spark side and a worker, for the tests; also runnable until SIGTERM as
``python -m tests.faultproxy --listen 127.0.0.1:0 --target HOST:PORT --chaos 0.1``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from pp1wire.apps.settings import SettingsError, host_port
from pp1wire.errors import ProtocolError
from pp1wire.wire import framing
from pp1wire.wire.messages import MsgType


@dataclass
class Faults:
    """What to inject. Every field defaults to "no fault"."""

    latency: float = 0.0
    bandwidth: float = 0.0  # bytes per second, 0 = unlimited
    one_byte_writes: bool = False
    reset_after: int = 0  # reset after this many worker bytes (first connection), 0 = never
    blackhole_after: int = 0  # worker bytes after which nothing is forwarded (first connection)
    slow_close: float = 0.0  # seconds to wait before forwarding a close
    delay_reply: float = 0.0  # hold each whole reply this long
    duplicate_reply: bool = False  # send each whole reply twice
    chaos: float = 0.0  # probability that a reply gets a random fault
    chaos_delay: float = 1.0  # how long a chaos "delay" holds the reply
    seed: int = 0
    counts: Counter[str] = field(default_factory=Counter)


class FaultProxy:
    """Listens on one address and forwards each connection to the target with faults."""

    def __init__(self, target_host: str, target_port: int, faults: Faults | None = None) -> None:
        """Prepare (call :meth:`start`)."""
        self.target = (target_host, target_port)
        self.faults = faults or Faults()
        self.rng = random.Random(self.faults.seed)
        self.server: asyncio.AbstractServer | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen; returns the bound port."""
        self.server = await asyncio.start_server(self._client, host, port)
        return int(self.server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        """Stop listening and cut every forwarded connection."""
        if self.server is not None:
            self.server.close()
        for task in list(self.tasks):
            task.cancel()
        for task in list(self.tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        up = asyncio.ensure_future(self._pump(reader, up_writer, upstream=True))
        down = asyncio.ensure_future(self._down(up_reader, writer, up_writer))
        for task in (up, down):
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
        for task in (up, down):
            task.cancel()
        for w in (writer, up_writer):
            w.close()

    async def _send(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        f = self.faults
        if f.latency:
            await asyncio.sleep(f.latency)
        chunks = [data[i : i + 1] for i in range(len(data))] if f.one_byte_writes else [data]
        for chunk in chunks:
            writer.write(chunk)
            if f.bandwidth:
                await asyncio.sleep(len(chunk) / f.bandwidth)
            if f.one_byte_writes:
                await writer.drain()
        await writer.drain()

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, upstream: bool
    ) -> None:
        while True:
            data = await reader.read(1 << 16)
            if not data:
                if self.faults.slow_close:
                    await asyncio.sleep(self.faults.slow_close)
                if writer.can_write_eof():
                    writer.write_eof()
                else:
                    writer.close()
                return
            await self._send(writer, data)

    async def _down(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        up_writer: asyncio.StreamWriter,
    ) -> None:
        f = self.faults
        frame_level = f.delay_reply or f.duplicate_reply or f.chaos
        decoder = framing.FrameDecoder(framing.HARD_MAX_PAYLOAD)
        reply: list[bytes] = []
        passed = 0
        while True:
            data = await reader.read(1 << 16)
            if not data:
                if f.slow_close:
                    await asyncio.sleep(f.slow_close)
                writer.close()
                return
            # Reset and blackhole hit the first connection only, so a reconnect works.
            if (
                f.blackhole_after
                and not f.counts["blackhole"]
                and (passed + len(data) > f.blackhole_after)
            ):
                keep = max(0, f.blackhole_after - passed)
                if keep:
                    await self._send(writer, data[:keep])
                passed = f.blackhole_after
                f.counts["blackhole"] += 1
                while await reader.read(1 << 16):
                    pass  # the worker's bytes stop here; the connection stays open
                return
            if f.reset_after and not f.counts["reset"] and passed + len(data) >= f.reset_after:
                keep = f.reset_after - passed
                await self._send(writer, data[:keep])
                f.counts["reset"] += 1
                self._reset(writer, up_writer)
                return
            passed += len(data)
            if not frame_level:
                await self._send(writer, data)
                continue
            try:
                frames = decoder.feed(data)
            except ProtocolError:
                await self._send(writer, data)
                continue
            for frame in frames:
                raw = bytes(frame.raw)
                if frame.type in (MsgType.REPLY, MsgType.COMPLETION):
                    reply.append(raw)
                    if frame.type is MsgType.COMPLETION:
                        done, reply = reply, []
                        if await self._reply(done, writer, up_writer):
                            return
                else:
                    await self._send(writer, raw)

    def _reset(self, writer: asyncio.StreamWriter, up_writer: asyncio.StreamWriter) -> None:
        for w in (writer, up_writer):
            transport = w.transport
            if transport is not None:
                transport.abort()

    async def _reply(
        self,
        frames: list[bytes],
        writer: asyncio.StreamWriter,
        up_writer: asyncio.StreamWriter,
    ) -> bool:
        """Forward one whole reply with its faults; True if the connection was reset."""
        f = self.faults
        data = b"".join(frames)
        if f.chaos and self.rng.random() < f.chaos:
            kind = self.rng.choice(["drop_completion", "corrupt", "delay", "reset"])
            f.counts[kind] += 1
            if kind == "drop_completion":
                await self._send(writer, b"".join(frames[:-1]))
            elif kind == "corrupt":
                bad = bytearray(frames[0])
                bad[-1] ^= 0x01  # a payload bit: the row checksum catches it
                await self._send(writer, bytes(bad) + b"".join(frames[1:]))
            elif kind == "delay":
                loop = asyncio.get_running_loop()
                loop.call_later(f.chaos_delay, writer.write, data)
            else:
                await self._send(writer, frames[0][: len(frames[0]) // 2])
                self._reset(writer, up_writer)
                return True
            return False
        if f.delay_reply:
            f.counts["delay"] += 1
            await asyncio.sleep(f.delay_reply)
        await self._send(writer, data)
        if f.duplicate_reply:
            f.counts["duplicate"] += 1
            await self._send(writer, data)
        return False


def main(argv: Sequence[str] | None = None) -> int:
    """Run a proxy until SIGTERM."""
    p = argparse.ArgumentParser(prog="python -m tests.faultproxy", description=__doc__)
    p.add_argument("--listen", default="127.0.0.1:0")
    p.add_argument("--target", required=True)
    p.add_argument("--chaos", type=float, default=0.0)
    p.add_argument("--chaos-delay", type=float, default=1.0)
    p.add_argument("--latency", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        lhost, lport = host_port(args.listen)
        thost, tport = host_port(args.target)
    except SettingsError as exc:
        print(f"faultproxy: {exc}", file=sys.stderr)
        return 2
    faults = Faults(
        chaos=args.chaos, chaos_delay=args.chaos_delay, latency=args.latency, seed=args.seed
    )

    async def run() -> None:
        proxy = FaultProxy(thost, tport, faults)
        port = await proxy.start(lhost, lport)
        print(f"faultproxy listening on {lhost}:{port}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await proxy.stop()
        print(json.dumps({"faults": dict(faults.counts)}), flush=True)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
