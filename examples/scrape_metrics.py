"""Scraping the metrics endpoint: acceptance rate and mean accepted length.

Starts ``pp1-worker`` and ``pp1-spark`` (both with ``--metrics-port``) on
loopback, scrapes the Spark side's ``/metrics`` while it runs, and computes
what the PromQL in docs/operators.md §4 computes from a Prometheus server:

    rate(pp1_spec_decode_accepted_tokens_total[5m]) / rate(pp1_spec_decode_draft_tokens_total[5m])
    rate(pp1_spec_decode_accepted_tokens_total[5m]) / rate(pp1_spec_decode_num_drafts_total[5m])

Run: ``python examples/scrape_metrics.py``.
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request

from daemons import command, running_worker


def scrape(address: str) -> dict[str, float]:
    """Every sample of a Prometheus text page, keyed by name and labels."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def main() -> int:
    with running_worker("--vocab", "2048", "--log-level", "warning") as address:
        spark = subprocess.Popen(
            [
                command("pp1-spark"),
                "--worker",
                address,
                "--vocab",
                "2048",
                "--requests",
                "400",
                "--max-tokens",
                "64",
                "--metrics-port",
                "0",
                "--json",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert spark.stderr is not None
        # pp1-spark reports the metrics address it bound on stderr.
        line = spark.stderr.readline()
        metrics = line.rsplit(" ", 1)[1].strip()
        before = scrape(metrics)
        for _ in range(100):
            time.sleep(0.2)  # two scrapes some time apart, as Prometheus would take them
            now = scrape(metrics)
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
        spark.communicate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
