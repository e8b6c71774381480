"""Vocabulary-sharded TP2 against unsharded TP2: round time, CPU and bytes per link, in one run.

Run from the repository root: ``python benchmarks/sharded.py [--vocab V] [--reps N]
[--support dense|sparse:32 ...] [--max-tokens N] [--json]``.

Unsharded TP2: one ``pp1-worker`` and ``pp1-spark --tp 2`` (rank 0 holds the
one link and fans each proposal out to rank 1). Sharded TP2: ``pp1-worker --tp 2
--vocab-shards 2`` and ``pp1-spark --tp 2 --vocab-shards 2`` (two links, each
carrying its half of every q row; the ranks decide with collectives). Both
run the 4 x 5 batch (4 slots at depth 5, one wave of 4 requests) at the same
seeds, so they commit the same tokens in the same rounds (checked); runs
alternate, ``--reps`` each, median and min-max kept. A batch round is 4 slot
rounds; its time is rank 0's ``seconds`` over (rounds / 4). Bytes per link are
the worker's ``pp1_worker_reply_bytes_total`` per batch round: the one link of
the unsharded pipeline, each rank's link of the sharded one. The ideal for
dense q at V = 129,280 is half the bytes per link (4 x 5 x 64,640 x 4 B =
5,171,200 B of q per link and batch round).

CPU per batch round, summed over every process of a side:

* worker side: the worker processes (the launcher and its ranks) are
  long-lived; their user + system time (``/proc``) is read before and after
  each ``pp1-spark`` run, so the figure is what serving that run cost;
* Spark side: the ranks of each ``pp1-spark`` run are sampled (``/proc``,
  every 20 ms) while they run; their CPU over the last ``seconds`` (rank 0's
  summary: the rounds) before the last of them exits is the run's (start-up,
  torch's import above all, is left out; the teardown after the rounds, a few
  milliseconds, is counted).

Every process runs with ``OMP_NUM_THREADS=1``.
"""

from __future__ import annotations

import bisect
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import spark_runs
from extras import require

from pp1wire.apps.launch import spark_command, worker_group, worker_process
from pp1wire.apps.metrics import scrape

_TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float] | None:
    """``(parent, user + system seconds)`` of a live process, else None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK


def tree_cpu(root: int) -> float:
    """User + system seconds of ``root`` and every live process below it (``/proc``)."""
    parents: dict[int, int] = {}
    spent: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (got := _stat(int(entry.name))) is not None:
            parents[int(entry.name)], spent[int(entry.name)] = got
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += spent.get(pid, 0.0)
        todo += [child for child, parent in parents.items() if parent == pid]
    return total


class RankSampler:
    """Samples the CPU of a launcher's child processes (the ranks) every ``every`` s."""

    def __init__(self, launcher: int, ranks: int, every: float = 0.02) -> None:
        self.launcher, self.ranks, self.every = launcher, ranks, every
        self.times: list[float] = []
        self.totals: list[float] = []
        self.last_seen = 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pids: list[int] = []
        spent: dict[int, float] = {}
        while not self._done.is_set():
            if len(pids) < self.ranks:  # the ranks start after the launcher: find them
                for entry in Path("/proc").iterdir():
                    if entry.name.isdigit() and int(entry.name) not in pids:
                        got = _stat(int(entry.name))
                        if got is not None and got[0] == self.launcher:
                            pids.append(int(entry.name))
            now = time.perf_counter()
            alive = False
            for pid in pids:
                got = _stat(pid)
                if got is not None:
                    spent[pid], alive = got[1], True
            if alive:
                self.last_seen = now
            self.times.append(now)
            self.totals.append(sum(spent.values()))
            time.sleep(self.every)

    def stop(self) -> None:
        """Stop sampling (after the launcher exited)."""
        self._done.set()
        self._thread.join()

    def over_last(self, seconds: float) -> float:
        """The ranks' CPU seconds over the last ``seconds`` before the last of them exited."""
        end = bisect.bisect_right(self.times, self.last_seen) - 1
        start = max(0, bisect.bisect_left(self.times, self.last_seen - seconds) - 1)
        return self.totals[end] - self.totals[start]


def spark(
    address: str, vocab: int, support: str, sharded: bool, max_tokens: int
) -> tuple[dict[str, Any], float]:
    """One pp1-spark run's --json summary, and its ranks' CPU seconds over its rounds."""
    extra = ["--vocab-shards", "2"] if sharded else []
    cmd = spark_command(
        address,
        "--requests", "4", "--concurrency", "4", "--max-tokens", str(max_tokens),
        "--depth", "5", "--support", support, "--tp", "2", *extra, "--json",
        vocab=vocab,
    )  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = RankSampler(proc.pid, 2)
    try:
        out, err = proc.communicate(timeout=900)
    finally:
        proc.kill()
        sampler.stop()
    if proc.returncode != 0:
        sys.exit(f"pp1-spark (sharded={sharded}) failed:\n{err[-2000:]}")
    summary: dict[str, Any] = json.loads(next(x for x in out.splitlines() if x.startswith("{")))
    return summary, sampler.over_last(summary["seconds"])


def main() -> None:
    """Measure and print the figures."""
    require("torch")
    p = spark_runs.parser(__doc__)
    p.add_argument("--max-tokens", type=int, default=24, help="tokens per request (default 24)")
    args = p.parse_args()
    supports = args.support or ["dense", "sparse:32"]
    out: dict[str, Any] = {"vocab": args.vocab, "load_average": os.getloadavg()[0]}
    with (
        worker_process("--metrics-port", "0", vocab=args.vocab, seed=0) as single,
        worker_group(vocab=args.vocab, seed=0) as group,
    ):
        assert single.metrics is not None
        links = {False: [single.metrics], True: group.metrics}
        workers = {False: single.process.pid, True: group.process.pid}
        for support in supports:
            runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
            sent: dict[bool, list[list[float]]] = {False: [], True: []}
            worker_cpu: dict[bool, list[float]] = {False: [], True: []}
            spark_cpu: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.reps):
                for sharded in (False, True):
                    address = group.address if sharded else single.address
                    before = [scrape(m, "pp1_worker_reply_bytes_total") for m in links[sharded]]
                    cpu_before = tree_cpu(workers[sharded])
                    summary, cpu = spark(address, args.vocab, support, sharded, args.max_tokens)
                    worker_cpu[sharded].append(tree_cpu(workers[sharded]) - cpu_before)
                    after = [scrape(m, "pp1_worker_reply_bytes_total") for m in links[sharded]]
                    runs[sharded].append(summary)
                    spark_cpu[sharded].append(cpu)
                    sent[sharded].append([a - b for a, b in zip(after, before, strict=True)])
            plain, split = runs[False][0], runs[True][0]
            if (plain["tokens"], plain["rounds"]) != (split["tokens"], split["rounds"]):
                sys.exit(f"{support}: the pipelines did different work: {plain} vs {split}")
            batch_rounds = split["rounds"] / 4
            t1 = [r["seconds"] for r in runs[False]]
            t2 = [r["seconds"] for r in runs[True]]
            key = support.replace(":", "")
            out[key] = {
                "unsharded_round_ms": statistics.median(t1) / batch_rounds * 1e3,
                "sharded_round_ms": statistics.median(t2) / batch_rounds * 1e3,
                **spark_runs.ratio("sharded_vs_unsharded", t1, t2),
                "unsharded_worker_cpu_ms": statistics.median(worker_cpu[False])
                / batch_rounds
                * 1e3,
                "sharded_worker_cpu_ms": statistics.median(worker_cpu[True]) / batch_rounds * 1e3,
                **spark_runs.ratio("worker_cpu", worker_cpu[False], worker_cpu[True]),
                "unsharded_spark_cpu_ms": statistics.median(spark_cpu[False]) / batch_rounds * 1e3,
                "sharded_spark_cpu_ms": statistics.median(spark_cpu[True]) / batch_rounds * 1e3,
                **spark_runs.ratio("spark_cpu", spark_cpu[False], spark_cpu[True]),
                "unsharded_link_bytes_per_batch_round": sent[False][0][0] / batch_rounds,
                "sharded_link_bytes_per_batch_round": [b / batch_rounds for b in sent[True][0]],
                "batch_rounds": batch_rounds,
                "fallbacks": split["fallbacks"],
            }
    rows = spark_runs.table(out, args, supports)
    if rows:
        print(f"load average at the start: {out['load_average']:.2f}")
    for key, r in rows:
        lo, hi = r["sharded_vs_unsharded_min_max"]
        per_link = " / ".join(f"{b:,.0f}" for b in r["sharded_link_bytes_per_batch_round"])
        print(
            f"{key:9s} wall: unsharded TP2 {r['unsharded_round_ms']:8.2f} ms/round  sharded TP2 "
            f"{r['sharded_round_ms']:8.2f} ms/round  sharded/unsharded "
            f"{r['sharded_vs_unsharded']:.2f} (range {lo:.2f}-{hi:.2f})"
        )
        for side in ("worker", "spark"):
            lo, hi = r[f"{side}_cpu_min_max"]
            print(
                f"{'':9s} {side} CPU per batch round, all processes: unsharded "
                f"{r[f'unsharded_{side}_cpu_ms']:8.2f} ms  sharded "
                f"{r[f'sharded_{side}_cpu_ms']:8.2f} ms  sharded/unsharded "
                f"{r[f'{side}_cpu']:.2f} (range {lo:.2f}-{hi:.2f})"
            )
        print(
            f"{'':9s} bytes per link and batch round: "
            f"{r['unsharded_link_bytes_per_batch_round']:,.0f} unsharded, {per_link} sharded"
        )


if __name__ == "__main__":
    main()
