"""``docs/runner.md`` describes ``pp1-spark`` as it runs: seeds, rounds, the stop rule, outputs.

The reproduction test implements the document's conventions independently
(SplitMix64 written out here, prompts cycled, generation 0 and round = token
index at ``--depth 0``, the stop rule) on top of the draw primitives, which
their own tests pin, and must emit ``pp1-spark``'s tokens exactly.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from pp1wire.apps.models import target_factory
from pp1wire.q import tree
from pp1wire.q.rng import Domain, Role, RoundStreams, derive_seed
from pp1wire.q.verify import sample_weights

from . import cli

ROOT = Path(__file__).resolve().parent.parent
RUNNER = (ROOT / "docs" / "runner.md").read_text()
MASK = (1 << 64) - 1


def splitmix64_output(seed: int, i: int) -> int:
    """SplitMix64 output i (0-based) of the generator seeded with ``seed``, as §2 writes it."""
    z = (seed + (i + 1) * 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def table(heading: str) -> list[list[str]]:
    """The rows (cells) of the first markdown table after ``heading``."""
    body = RUNNER.split(heading, 1)[1]
    rows = []
    for line in body.splitlines():
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip("|").split("|")])
        elif rows:
            break
    return rows[2:]


def keys_of(rows: list[list[str]]) -> set[str]:
    return {k for row in rows for k in re.findall(r"`([a-z_0-9]+)`", row[0])}


def test_the_known_seeds_are_splitmix64_outputs():
    block = RUNNER.split("<!-- seeds -->", 1)[1].split("<!-- /seeds -->", 1)[0]
    rows = [line.strip() for line in block.splitlines() if line.strip().startswith("| ")]
    assert len(rows) >= 5
    for row in rows[1:]:
        base, i, value = (c.strip() for c in row.strip("|").split("|"))
        want = int(value.split("`")[1], 16)
        assert int(value.split("(")[1].rstrip(")")) == want
        assert splitmix64_output(int(base), int(i)) == derive_seed(int(base), int(i)) == want


def reproduce_depth0(
    prompts: list[list[int]], seed: int, requests: int, max_tokens: int, vocab: int, eos: int
) -> list[list[int]]:
    """§2, §5, §6 and §7 for ``--depth 0``, written from the document."""
    target = target_factory(vocab_size=vocab, seed=seed)
    out = []
    for i in range(requests):
        prefix = list(prompts[i % len(prompts)])
        new: list[int] = []
        seed_i = splitmix64_output(seed, i)
        k = 0
        while len(new) < max_tokens and not (prefix and prefix[-1] == eos):
            t = np.asarray(target(prefix), dtype=np.float64)
            p = t / tree.total(t)
            u = RoundStreams(Role.SPARK, seed_i, 0, k).u53_int(Domain.TARGET, len(prefix))
            token = sample_weights(p, u)
            prefix.append(token)
            new.append(token)
            k += 1
        out.append(new)
    return out


def test_a_depth_0_run_is_reproduced_from_the_document(tmp_path):
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9]]
    src = tmp_path / "prompts.jsonl"
    src.write_text("\n".join(json.dumps(p) for p in prompts) + "\n\n")
    out = tmp_path / "out.jsonl"
    vocab, seed, eos = 16, 11, 3
    done = cli.module(
        "pp1wire.apps.spark",
        *("--depth", "0", "--vocab", str(vocab), "--seed", str(seed), "--eos", str(eos)),
        *("--requests", "5", "--concurrency", "2", "--max-tokens", "6"),
        *("--prompts", src, "--output", out, "--json"),
    )
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    want = reproduce_depth0(prompts, seed, 5, 6, vocab, eos)
    assert [r["tokens"] for r in records] == want
    assert [r["seed"] for r in records] == [splitmix64_output(seed, i) for i in range(5)]
    assert [r["prompt"] for r in records] == [prompts[i % 3] for i in range(5)]
    # The run says what it is: the keys of §9.1 and §9.2, no more and no fewer.
    assert set(records[0]) == keys_of(table("### 9.1"))
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(summary) == keys_of(table("### 9.2"))
    counts = ("requests", "finished", "tokens", "rounds", "fallbacks", "cuts", "steps")
    assert all(type(summary[k]) is int for k in counts), summary
    assert summary["tokens"] == sum(len(t) for t in want)


def test_counts_by_reason_are_integers():
    # §9.2: "every value of an object keyed by reason or code name is a JSON integer".
    from prometheus_client import CollectorRegistry, Counter

    from pp1wire.apps import metrics

    c = Counter("pp1_t", "t", ["reason"], registry=CollectorRegistry())
    c.labels("reply_timeout").inc()
    c.labels("reply_timeout").inc()
    c.labels("internal").inc()
    got = metrics.by_label(c)
    assert got == {"reply_timeout": 2, "internal": 1}
    assert all(type(v) is int for v in got.values())
    assert json.dumps(got) == '{"reply_timeout": 2, "internal": 1}'
