"""Silent connections against a TLS worker: descriptors held and a real client's fate.

Run: ``python benchmarks/tls_flood.py [--silent N] [--fd-limit N]``.

Starts ``pp1-worker`` with TLS (a throwaway certificate from the openssl CLI),
``--max-connections 4`` and ``--handshake-timeout 2`` under a descriptor limit,
opens ``--silent`` TCP connections that never start TLS, then times one real
TLS client's handshake + OPEN + one round. Prints the worker's open descriptors
before, during and after (past the handshake timeout), and the client's result.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pp1wire.aio.client import AsyncClient
from pp1wire.apps.launch import worker_command, worker_process
from pp1wire.wire.spark_core import SparkConfig

LIMITED = (
    "import resource, sys\n"
    "n = int(sys.argv.pop(1))\n"
    "resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))\n"
    "from pp1wire.apps.worker import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def descriptors(pid: int) -> int:
    """Open file descriptors of ``pid`` (Linux)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


async def legit(port: int, cert: Path) -> float:
    """Seconds for a TLS client's handshake + OPEN + one round."""
    started = time.perf_counter()
    ctx = ssl.create_default_context(cafile=str(cert))
    client = await AsyncClient.connect("127.0.0.1", port, SparkConfig(vocab_size=16), ssl=ctx)
    await client.open(0, seed=1, prefix=[1])
    client.release(await client.propose(0, round_id=client.next_round(0), depth=2))
    await client.close()
    return time.perf_counter() - started


def main() -> None:
    """Run the flood once and print the figures."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--silent", type=int, default=300)
    p.add_argument("--fd-limit", type=int, default=256)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cert, key = Path(tmp) / "cert.pem", Path(tmp) / "key.pem"
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
             "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
             "-addext", "subjectAltName=IP:127.0.0.1"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        flags = worker_command(
            "--tls-cert", str(cert), "--tls-key", str(key), "--max-connections", "4",
            "--handshake-timeout", "2", vocab=16,
        )[3:]  # fmt: skip
        command = [sys.executable, "-c", LIMITED, str(args.fd_limit), *flags]
        with worker_process(command=command) as worker:
            pid = worker.process.pid
            idle = descriptors(pid)
            silent = [
                socket.create_connection(("127.0.0.1", worker.port)) for _ in range(args.silent)
            ]
            time.sleep(0.5)
            during = descriptors(pid)
            try:
                result = f"served in {asyncio.run(legit(worker.port, cert)) * 1e3:.0f} ms"
            except Exception as exc:  # whatever the client saw is the figure
                result = f"failed: {exc!r}"
            time.sleep(2.5)
            after = descriptors(pid)
            for s in silent:
                s.close()
    print(f"{args.silent} silent connections, worker descriptor limit {args.fd_limit}")
    print(f"worker descriptors: {idle} idle, {during} during the flood, {after} after 2.5 s")
    print(f"a TLS client during the flood: {result}")


if __name__ == "__main__":
    main()
