"""Scraping the metrics endpoint: acceptance rate and mean accepted length.

Starts ``pp1-worker`` and ``pp1-spark`` (both with ``--metrics-port``) on
loopback, scrapes the Spark side's ``/metrics`` while it runs, and computes
what the PromQL in README.md computes from a Prometheus server:

    rate(pp1_spec_decode_accepted_tokens_total[5m]) / rate(pp1_spec_decode_draft_tokens_total[5m])
    rate(pp1_spec_decode_accepted_tokens_total[5m]) / rate(pp1_spec_decode_num_drafts_total[5m])

Run: ``python examples/scrape_metrics.py``.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[str, float]:
    """Every sample of a Prometheus text page, keyed by name and labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def main() -> int:
    vocab = "2048"
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pp1wire.apps.worker",
            "--port",
            "0",
            "--vocab",
            vocab,
            "--log-level",
            "warning",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.stdout is not None
        address = worker.stdout.readline().rsplit(" ", 1)[1].strip()
        mport = free_port()
        spark = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pp1wire.apps.spark",
                "--worker",
                address,
                "--vocab",
                vocab,
                "--requests",
                "400",
                "--max-tokens",
                "64",
                "--metrics-port",
                str(mport),
                "--json",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        before = None
        for _ in range(100):
            time.sleep(0.2)
            try:
                now = scrape(mport)
            except OSError:
                continue
            if before is None:
                before = now
                continue
            drafts = (
                now["pp1_spec_decode_draft_tokens_total"]
                - before["pp1_spec_decode_draft_tokens_total"]
            )
            if drafts > 0:
                accepted = (
                    now["pp1_spec_decode_accepted_tokens_total"]
                    - before["pp1_spec_decode_accepted_tokens_total"]
                )
                rounds = (
                    now["pp1_spec_decode_num_drafts_total"]
                    - before["pp1_spec_decode_num_drafts_total"]
                )
                print(
                    f"acceptance rate {accepted / drafts:.3f}, "
                    f"mean accepted length {accepted / rounds:.3f} "
                    f"(over {int(rounds)} rounds between two scrapes)"
                )
                break
        spark.terminate()
        spark.wait()
        if spark.stdout is not None:
            spark.stdout.close()
        return 0
    finally:
        worker.terminate()
        worker.wait()


if __name__ == "__main__":
    sys.exit(main())
