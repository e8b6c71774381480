"""The benchmark scripts still run, and their figures mean what their docstrings say.

Each script runs once at tiny sizes in the default run. The checks are on what
a figure is made of, never on a wall-clock value: a ratio must follow from
the times measured in the same run (so its baseline was measured there), byte
counts must be what the layout implies, and the scripts' own cross-checks
(TP1 and TP2, sharded and unsharded commit the same tokens in the same rounds;
they exit non-zero otherwise) must pass. Larger variants, and the scripts
that are only run by hand, carry the ``bench`` marker: ``pytest -m bench``.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from . import cli

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"

# The q payload of run.py's dense round: 4 requests x depth 5 rows of 129,280
# FP32 values; its sparse round: 5 rows of 32 (id, value) pairs.
RUN_DENSE_Q = 4 * 5 * 129_280 * 4
RUN_SPARSE_Q = 5 * 32 * 8


def run_json(script: str, *args: str, timeout: float = 300) -> dict[str, Any]:
    """Run ``benchmarks/<script>`` with ``args``; its last stdout line, parsed."""
    done = cli.run(sys.executable, BENCH / script, *args, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def finite_positive(x: float) -> bool:
    return math.isfinite(x) and x > 0


def assert_ratio_of(ratio: dict[str, float], num: dict[str, float], den: dict[str, float]) -> None:
    """``ratio`` summarises per-round num/den over the same rounds as ``num`` and ``den``.

    Whatever the rounds were, each per-round ratio lies between num.min / den.max
    and num.max / den.min; a ratio taken from elsewhere (another run, a constant)
    does not, except by coincidence.
    """
    lo, hi = num["min"] / den["max"], num["max"] / den["min"]
    assert lo * (1 - 1e-9) <= ratio["min"] <= ratio["median"] <= ratio["max"] <= hi * (1 + 1e-9)


# run.py's ratio -> (section of its detail, numerator, denominator), all from one run.
RUN_RATIOS = {
    "dense_vs_raw": ("times", "pp1_dense", "raw_dense"),
    "dense_vs_zmq": ("times", "pp1_dense", "zmq_dense"),
    "dense_vs_grpc": ("times", "pp1_dense", "grpc_dense"),
    "sparse_vs_raw": ("times", "pp1_sparse", "raw_sparse"),
    "sparse_vs_zmq": ("times", "pp1_sparse", "zmq_sparse"),
    "sparse_vs_grpc": ("times", "pp1_sparse", "grpc_sparse"),
    "sparse_loop_floor_vs_raw": ("times", "loop_sparse", "raw_sparse"),
    "sparse_vs_loop": ("times", "pp1_sparse", "loop_sparse"),
    "validate_vs_max": ("micro", "validate_dense_us", "max_pass_us"),
    "construct_vs_softmax": ("micro", "construct_dense_us", "softmax_f64_us"),
}


def test_run_py_smoke():
    pytest.importorskip("zmq")
    pytest.importorskip("grpc")
    result = run_json("run.py", "--smoke", "--json", timeout=600)
    detail = result["detail"]
    flat = {k: v for k, v in result.items() if k != "detail"}
    assert all(finite_positive(v) for v in flat.values()), flat
    for name, (section, num, den) in RUN_RATIOS.items():
        assert_ratio_of(detail["ratios"][name], detail[section][num], detail[section][den])
    times = detail["times"]
    fresh = detail["ratios"]["fresh_dense_vs_ideal"]
    ideal_lo = times["drafter_dense"]["min"] + times["raw_dense"]["min"]
    ideal_hi = times["drafter_dense"]["max"] + times["raw_dense"]["max"]
    assert times["pp1_fresh_dense"]["min"] / ideal_hi * (1 - 1e-9) <= fresh["min"]
    assert fresh["max"] <= times["pp1_fresh_dense"]["max"] / ideal_lo * (1 + 1e-9)
    # The baselines carried the bytes pp1wire's replies took, measured on the
    # wire: the q payload plus framing no larger than sizes.py's worst case.
    sent = detail["bytes"]
    assert RUN_DENSE_Q < sent["dense_reply"] <= RUN_DENSE_Q * (1 + flat["overhead_dense"])
    assert RUN_SPARSE_Q < sent["sparse_reply"] <= RUN_SPARSE_Q * (1 + flat["overhead_sparse32"])
    mem = detail["memory"]
    assert flat["rss_growth"] == max(
        mem["worker_rss_mb_late"] / mem["worker_rss_mb_early"],
        mem["spark_rss_mb_late"] / mem["spark_rss_mb_early"],
    )
    e2e = detail["e2e"]
    assert flat["speedup_over_target_only"] == pytest.approx(
        e2e["dense_tokens_per_second"] / e2e["target_only_tokens_per_second"]
    )
    # speedup.py's headline repetition, whose figures its own smoke checks.
    head = e2e["headline"]
    (dense,) = (
        r
        for r in e2e["runs"]
        if (r["vocab"], r["target_ms"], r["rep"], r["q"])
        == (head["vocab"], head["target_ms"], head["rep"], "dense")
    )
    assert flat["step_fill"] == dense["fill"]
    assert flat["round_trip_ms"] == dense["round_trip_ms"]
    assert flat["worker_cpu_ms_per_row"] == dense["worker_cpu_ms_per_row"]
    assert flat["spark_cpu_ms_per_token"] == dense["spark_cpu_ms_per_token"]


def test_sizes_report_meets_the_size_goals():
    table = run_json("sizes.py", "--json")
    assert table["dense"]["overhead"] <= 0.001
    # 25 % over the 1,280 payload bytes, and the fixed-width token's one byte more per
    # row than the widest shortest-form uint (protocol section 4.5; 5 rows): 25.4 %.
    assert table["sparse32"]["encoded"] <= 1600 + 5
    for row in table.values():
        assert row["overhead"] == pytest.approx((row["encoded"] - row["payload"]) / row["payload"])


def test_integrity_cost_smoke():
    done = cli.run(
        sys.executable, BENCH / "integrity_cost.py", "--rounds", "1", "--reps", "1", timeout=300
    )
    assert done.returncode == 0, done.stderr
    figures = {}
    for line in done.stdout.splitlines():
        name, _, median, _, lo, _, hi = line.replace(",", "").replace(")", "").split()
        figures[name] = {"median": float(median), "min": float(lo), "max": float(hi)}
    assert list(figures) == [
        f"{kind}_{what}"
        for kind in ("dense", "sparse")
        for what in ("ms_plain", "ms_keyed", "keyed_over_plain")
    ]
    # Every figure is printed to three decimals, so each printed value is within
    # HALF = 0.0005 of the one measured. One round: the ratio is that round's keyed
    # time over its plain time, so the printed ratio lies within the bounds that
    # the printed times allow, widened by its own rounding.
    half = 5e-4
    for kind in ("dense", "sparse"):
        keyed = figures[f"{kind}_ms_keyed"]["median"]
        plain = figures[f"{kind}_ms_plain"]["median"]
        ratio = figures[f"{kind}_keyed_over_plain"]["median"]
        assert plain > half, plain
        lo = (keyed - half) / (plain + half) - half
        hi = (keyed + half) / (plain - half) + half
        assert lo <= ratio <= hi, (ratio, keyed, plain)


SPEEDUP_LABELS = ("models", "vocab", "drafter", "drafter_ms", "q", "target_ms", "prepare")


def check_speedup_runs(result: dict[str, Any]) -> None:
    """speedup.py's figures, each run's from its parts and each cell's from its runs."""
    setup = result["setup"]
    slots, depth = setup["concurrency"], setup["depth"]
    runs = result["runs"]
    assert len(runs) == setup["reps"] * len(result["cells"])
    for r in runs:
        t_t, t_d = r["target_ms"] / 1e3, r["drafter_ms"] / 1e3
        assert r["drafter_ms"] in setup["drafter_ms"]
        # Each figure from the parts of the same repetition: both runs and the
        # acceptance measured in it.
        assert r["speedup"] == pytest.approx(
            r["tokens_per_second"] / r["target_only_tokens_per_second"]
        )
        ideal = slots * (r["mean_accepted_length"] + 1) / (depth * t_d + t_t)
        assert r["ideal_tokens_per_second"] == pytest.approx(ideal)
        assert r["ideal_speedup"] == pytest.approx(ideal / (slots / t_t))
        assert r["measured_vs_ideal"] == pytest.approx(r["tokens_per_second"] / ideal)
        assert r["target_only_vs_ideal"] == pytest.approx(
            r["target_only_tokens_per_second"] / (slots / t_t)
        )
        assert 0 < r["target_only_vs_ideal"] <= 1.05  # cannot beat its own fixed cost
        assert 0 <= r["acceptance_rate"] <= 1
        assert 0 <= r["mean_accepted_length"] <= depth
        assert 0 < r["fill"] <= 1
        assert 0 < r["target_only_fill"] <= 1
        assert r["round_trip_ms"] > 0
        assert r["worker_rows"] > 0
        assert r["step_ms"] == pytest.approx(1e3 * r["seconds"] / r["steps"])
        assert r["ideal_step_ms"] == pytest.approx(1e3 * (depth * t_d + t_t))
        assert r["worker_cpu_ms_per_step"] == pytest.approx(
            1e3 * r["worker_cpu_seconds"] / r["steps"]
        )
        assert r["spark_cpu_ms_per_step"] == pytest.approx(
            1e3 * r["spark_cpu_seconds"] / r["steps"]
        )
        assert r["worker_cpu_ms_per_row"] == pytest.approx(
            1e3 * r["worker_cpu_seconds"] / r["worker_rows"]
        )
        assert r["spark_cpu_ms_per_token"] == pytest.approx(
            1e3 * r["spark_cpu_seconds"] / r["tokens"]
        )
        assert r["target_only_spark_cpu_ms_per_token"] == pytest.approx(
            1e3 * r["target_only_spark_cpu_seconds"] / r["target_only_tokens"]
        )
        assert r["spark_cpu_ms_per_token"] > 0
        assert r["target_only_spark_cpu_ms_per_token"] > 0
    for cell in result["cells"]:
        mine = [r for r in runs if all(r[k] == cell[k] for k in SPEEDUP_LABELS)]
        assert len(mine) == setup["reps"]
        for name, summary in cell.items():
            if not isinstance(summary, dict):
                continue
            # Median and min-max over the repetitions; a figure by hypothesis, each
            # hypothesis over the runs that have it.
            parts = (
                [(summary, [r[name] for r in mine])]
                if "median" in summary
                else [(f, [r[name][h] for r in mine if h in r[name]]) for h, f in summary.items()]
            )
            for f, values in parts:
                values.sort()
                assert values, (name, summary)
                assert f["min"] == values[0]
                assert f["max"] == values[-1]
                assert f["median"] == pytest.approx(
                    (values[(len(values) - 1) // 2] + values[len(values) // 2]) / 2
                )


def test_speedup_smoke():
    result = run_json("speedup.py", "--smoke", "--json")
    check_speedup_runs(result)
    runs = result["runs"]
    assert len(runs) >= 2 * 2 * 2  # 2 pairs x dense, sparse:32 x 2 repetitions
    assert result["setup"]["prepare"] == 0
    assert all(r["prepare"] == 0 and "on_vs_off" not in r for r in runs)  # as without it
    # The free-model floor: one per pair (dense, t_t = 0), its spreads ordered.
    floors = result["floors"]
    assert sorted(f["models"] for f in floors) == ["ngram", "toy"]
    for f in floors:
        assert (f["q"], f["target_ms"]) == ("dense", 0.0)
        for name in (
            "tokens_per_second",
            "target_only_tokens_per_second",
            "worker_cpu_ms_per_row",
            "spark_cpu_ms_per_row",
            "mean_accepted_length",
        ):
            spread = f[name]
            assert 0 < spread["min"] <= spread["median"] <= spread["max"], (name, spread)
    # The keys run.py reads: one repetition's, so they follow from each other.
    head = result["headline"]
    assert {c["models"] for c in result["cells"]} == {"toy", "ngram"}  # both pairs by default
    chosen = {
        r["q"]: r
        for r in runs
        if (r["models"], r["vocab"], r["target_ms"], r["rep"])
        == ("toy", head["vocab"], head["target_ms"], head["rep"])
    }  # the headline: the first pair's
    plain = result["target_only_tokens_per_second"]
    for key, q in (("dense", "dense"), ("sparse32", "sparse:32")):
        assert result[f"{key}_tokens_per_second"] == chosen[q]["tokens_per_second"]
        assert result[f"speedup_{key}"] == pytest.approx(result[f"{key}_tokens_per_second"] / plain)
        assert result[f"e2e_vs_ideal_{key}"] == pytest.approx(
            result[f"{key}_tokens_per_second"] / result[f"{key}_ideal_tokens_per_second"]
        )
    assert result["step_fill"] == chosen["dense"]["fill"]
    assert result["worker_cpu_ms_per_row"] == chosen["dense"]["worker_cpu_ms_per_row"]


@pytest.mark.bench
def test_speedup_prepare_smoke():
    # One tiny cell at two drafter costs, each with and without prepared blocks, in
    # one repetition (the rotation and the spreads are test_speedup_smoke's); 16
    # tokens a request, so that requests run rounds after a preparation.
    result = run_json(
        "speedup.py", "--smoke", "--json", "--models", "toy", "--support", "dense",
        "--no-floor", "--reps", "1", "--max-tokens", "16", "--prepare", "2",
        "--drafter-ms", "0.5", "4",
    )  # fmt: skip
    check_speedup_runs(result)
    runs = result["runs"]
    assert {(r["drafter_ms"], r["prepare"]) for r in runs} == {
        (0.5, 0), (0.5, 2), (4.0, 0), (4.0, 2)
    }  # fmt: skip
    off = {tuple(r[k] for k in (*SPEEDUP_LABELS[:-1], "rep")): r for r in runs if not r["prepare"]}
    for r in (r for r in runs if r["prepare"]):
        twin = off[tuple(r[k] for k in (*SPEEDUP_LABELS[:-1], "rep"))]
        # Against the same cell unprepared, same repetition; the same target-only baseline.
        assert r["on_vs_off"] == pytest.approx(r["tokens_per_second"] / twin["tokens_per_second"])
        assert r["target_only_tokens_per_second"] == twin["target_only_tokens_per_second"]
        assert r["rounds"] > 0
        assert r["prepared_blocks_total"] == sum(r["prepared_blocks"].values()) > 0
        assert r["prepared_served_total"] == sum(r["prepared_served"].values())
        assert set(r["prepared_served"]) <= set(r["prepared_blocks"])
        assert r["hit_rate"] == pytest.approx(r["prepared_served_total"] / r["rounds"])
        assert r["prepared_use_rate"] == pytest.approx(
            r["prepared_served_total"] / r["prepared_blocks_total"]
        )
        by = r["hit_rate_by_hypothesis"]
        assert by
        assert set(by) <= set(r["prepared_blocks"])
        assert all(h == "bonus" or h.startswith("reject@") for h in by)
        for h, rate in by.items():
            assert rate == pytest.approx(r["prepared_served"].get(h, 0.0) / r["prepared_blocks"][h])
        for x in (r["on_vs_off"], r["hit_rate"], r["prepared_use_rate"], *by.values()):
            assert math.isfinite(x)
            assert x >= 0
    for cell in (c for c in result["cells"] if c["prepare"]):
        for name in (
            "tokens_per_second",
            "speedup",
            "measured_vs_ideal",
            "on_vs_off",
            "hit_rate",
            "prepared_use_rate",
        ):
            assert all(math.isfinite(x) for x in cell[name].values()), name
        assert cell["hit_rate_by_hypothesis"]
        for f in cell["hit_rate_by_hypothesis"].values():
            assert all(math.isfinite(x) for x in f.values())


def tp_figures(vocab: int, *supports: str) -> dict[str, Any]:
    flags = [x for s in supports for x in ("--support", s)]
    result = run_json(
        "tp.py", "--vocab", str(vocab), "--reps", "1", "--requests", "4", *flags, "--json"
    )
    # tp.py exits non-zero unless TP1 and TP2 committed the same tokens in the same rounds.
    for key in (s.replace(":", "") for s in supports):
        r = result[key]
        assert finite_positive(r["tp2_vs_tp1"])
        assert r["tp2_vs_tp1"] == pytest.approx(r["tp2_round_ms"] / r["tp1_round_ms"])
        lo, hi = r["tp2_vs_tp1_min_max"]
        assert lo <= r["tp2_vs_tp1"] * (1 + 1e-9)
        assert r["tp2_vs_tp1"] <= hi * (1 + 1e-9)
    return result


def test_tp_benchmark_smoke():
    pytest.importorskip("torch")
    result = tp_figures(128, "dense")
    assert set(result) == {"vocab", "dense"}
    # Rank 0 fans each of the 4 x 5 dense rows out once: V FP32 values plus 8 B
    # for its token and length (the docstring's formula).
    assert result["dense"]["fanout_bytes_per_batch_round"] == 4 * 5 * (4 * 128 + 8)


@pytest.mark.bench
def test_tp_benchmark_both_supports():
    pytest.importorskip("torch")
    result = tp_figures(128, "dense", "sparse:32")
    assert result["dense"]["fanout_bytes_per_batch_round"] == 4 * 5 * (4 * 128 + 8)
    # A sparse row: 32 (id, value) pairs plus the same 8 B.
    assert result["sparse32"]["fanout_bytes_per_batch_round"] == 4 * 5 * (32 * 8 + 8)


def sharded_figures(vocab: int, *supports: str) -> dict[str, Any]:
    flags = [x for s in supports for x in ("--support", s)]
    result = run_json(
        "sharded.py", "--vocab", str(vocab), "--reps", "1", "--max-tokens", "8", *flags, "--json"
    )
    # sharded.py exits non-zero unless both pipelines committed the same tokens
    # in the same rounds.
    assert set(result) == {"vocab", "load_average", *(s.replace(":", "") for s in supports)}
    for key in result.keys() - {"vocab", "load_average"}:
        r = result[key]
        assert r["fallbacks"] == 0
        assert finite_positive(r["sharded_vs_unsharded"])
        assert r["sharded_vs_unsharded"] == pytest.approx(
            r["sharded_round_ms"] / r["unsharded_round_ms"]
        )
        # CPU per batch round of every process of each side, and its ratio.
        for side in ("worker", "spark"):
            for pipeline in ("unsharded", "sharded"):
                assert finite_positive(r[f"{pipeline}_{side}_cpu_ms"])
            assert r[f"{side}_cpu"] == pytest.approx(
                r[f"sharded_{side}_cpu_ms"] / r[f"unsharded_{side}_cpu_ms"]
            )
        assert len(r["sharded_link_bytes_per_batch_round"]) == 2
    return result


def test_sharded_benchmark_smoke():
    pytest.importorskip("torch")
    dense = sharded_figures(4096, "dense")["dense"]
    # Each link carries its half of every dense q row. Tolerance: framing
    # (headers, COMPLETION) is about 1 kB per batch round against 328 kB of q
    # on the one link at V = 4096, so each share is 0.5 to within 0.01.
    one = dense["unsharded_link_bytes_per_batch_round"]
    assert one > 4 * 5 * 4096 * 4
    for link in dense["sharded_link_bytes_per_batch_round"]:
        assert link / one == pytest.approx(0.5, abs=0.01)


@pytest.mark.bench
def test_sharded_benchmark_both_supports():
    pytest.importorskip("torch")
    result = sharded_figures(128, "dense", "sparse:32")
    for key in ("dense", "sparse32"):
        r = result[key]
        assert (
            max(r["sharded_link_bytes_per_batch_round"]) < r["unsharded_link_bytes_per_batch_round"]
        )


# Scripts that are run by hand: opt-in smokes that they still run.


@pytest.mark.bench
def test_rtt_smoke():
    result = run_json("rtt.py", "--rounds", "1", "--json")
    assert set(result) == {"dense4_fresh", "dense4_replay", "sparse32_fresh", "sparse32_replay"}
    assert all(r["n"] == 1 and finite_positive(r["median_ms"]) for r in result.values())


@pytest.mark.bench
def test_micro_smoke():
    result = run_json("micro.py", "--quick", "--json")
    assert all(finite_positive(v) for v in result.values()), result


@pytest.mark.bench
def test_micro_places_smoke():
    result = run_json("micro.py", "--places", "--quick", "--json")
    for case in result.values():
        assert len(case["ns_by_place"]) == 9
        assert all(finite_positive(v) for v in case["ns_by_place"])
        assert case["spread_ns"] == max(case["ns_by_place"]) - min(case["ns_by_place"])


@pytest.mark.bench
def test_soak_smoke():
    result = run_json("soak.py", "--minutes", "0.01", "--vocab", "128", "--json")
    assert result["rounds"] > 100  # past the warm-up mark
    assert result["errors"] == 0
    assert result["fallbacks"] == 0


@pytest.mark.bench
def test_never_commits_smoke():
    done = cli.run(sys.executable, BENCH / "never_commits.py", "--steps", "20", "--vocab", "128")
    assert done.returncode == 0, done.stderr
    assert "ratio (under attack / baseline, medians)" in done.stdout


@pytest.mark.bench
def test_principal_attacks_smoke():
    result = run_json(
        "principal_attacks.py",
        *("--vocab", "256", "--pairs", "1", "--requests", "2", "--max-tokens", "8"),
        *("--settle", "0.2", "--squat-settle", "1.5", "--slot-idle-timeout", "1", "--json"),
        timeout=600,
    )
    assert set(result) == {"squat", "commit", "reject", "reconnect"}
    for name, res in result.items():
        assert [r["exit"] for r in res["alone"] + res["beside"]] == [0, 0], name
        alone, beside = res["alone"][0], res["beside"][0]
        # The ratio is made of the two runs of its pair, measured in this invocation.
        assert res["ratios"] == [beside["tokens_per_second"] / alone["tokens_per_second"]]
    assert result["squat"]["flags"][-2:] == ["--max-connections", "4"]
    for name in ("commit", "reject", "reconnect"):
        assert result[name]["attacker_draws"] >= 1, name


@pytest.mark.bench
def test_principal_attacks_acceptance_smoke():
    result = run_json(
        "principal_attacks.py", "--acceptance",
        *("--vocab", "256", "--pairs", "1", "--requests", "2", "--max-tokens", "8"),
        *("--settle", "0.2", "--json"),
        timeout=600,
    )  # fmt: skip
    assert set(result) == {
        "keyed_reconnect", "keyed_reconnect_capped", "keyed_reject", "keyed_reject_capped",
        "keyless_same_address_reconnect",
    }  # fmt: skip
    for name, res in result.items():
        assert [r["exit"] for r in res["alone"] + res["beside"]] == [0, 0], name
        alone, beside = res["alone"][0], res["beside"][0]
        assert res["ratios"] == [beside["tokens_per_second"] / alone["tokens_per_second"]]
        assert res["attacker_draws"] >= 1, name
    assert "--psk-file" in result["keyed_reject"]["flags"]
    assert result["keyed_reject_capped"]["flags"][-3:] == ["--principal-rate", "2", "client=off"]
    assert "--psk-file" not in result["keyless_same_address_reconnect"]["flags"]


@pytest.mark.bench
def test_tls_flood_smoke():
    done = cli.run(sys.executable, BENCH / "tls_flood.py", "--silent", "8")
    assert done.returncode == 0, done.stderr
    assert "a TLS client during the flood: served in" in done.stdout


@pytest.mark.bench
def test_sharding_smoke():
    result = run_json("sharding.py", "--reps", "1", "--json", timeout=600)
    assert finite_positive(result["numpy_construct_sharded_vs_unsharded"])
    assert finite_positive(result["numpy_residual_sharded_vs_unsharded"])


@pytest.mark.bench
def test_adaptive_smoke():
    # The smallest sweep: what each figure is made of, not how fast anything is.
    result = run_json(
        "adaptive.py", "--runs", "1", "--requests", "2", "--max-tokens", "4", "--depths", "1",
        "--target-ms", "1", "--draft-ms", "0.1", "--probes", "20", "--json",
    )  # fmt: skip
    assert set(result["pairs"]) == {"toy", "ngram"}  # both pairs by default
    for pair, key in ((p, k) for p in ("toy", "ngram") for k in ("dense", "sparse32")):
        res = result["pairs"][pair][key]
        table = res["configurations"]
        assert set(table) == {"fixed1", "confidence", "joint", "auto"}
        assert res["best_fixed"] == "fixed1"
        best = table["fixed1"]
        for name in ("confidence", "joint", "auto"):
            row = table[name]
            speed = row["tokens_per_second"]["median"] / best["tokens_per_second"]["median"]
            assert row["speed_vs_best_fixed"]["median"] == pytest.approx(speed)
            rows = row["rows_per_token"]["median"] / best["rows_per_token"]["median"]
            assert row["rows_vs_best_fixed"]["median"] == pytest.approx(rows)
        # Fixed depth 1 drafts one row per round; every round commits at least one token.
        assert 0 < best["rows_per_token"]["median"] <= 1
        assert best["mean_step_depth"]["median"] == 1
    d = result["pairs"]["toy"]["diagnostic"]
    assert 0 <= d["mean_acceptance"] <= 1
    assert -1 <= d["correlation_q_acceptance"] <= 1
    for pair in ("toy", "ngram"):
        stats = result["pairs"][pair]["statistics"]
        assert stats["contexts"] == 20  # --probes
        assert -1 <= stats["confidence"]["spearman_dense"] <= 1


@pytest.mark.bench
def test_hostile_group_smoke():
    pytest.importorskip("torch")
    result = run_json(
        "hostile_group.py", "--vocab", "128", "--reps", "1", "--max-tokens", "4", "--json"
    )
    assert result["same_tokens"]  # the attack changes no token of the legitimate run
    assert result["attacked_vs_quiet"] == pytest.approx(
        result["attacked_tokens_per_s"] / result["quiet_tokens_per_s"]
    )
    # Both attackers sent STEPs, and none was ever drawn: none matches a session of
    # the legitimate group's.
    assert all(t["steps"] > 0 for t in result["attackers"].values()), result["attackers"]
    assert all(t["proposals"] == 0 for t in result["attackers"].values())


@pytest.mark.bench
def test_group_memory_smoke():
    pytest.importorskip("torch")
    result = run_json(
        "group_memory.py", "--connections", "1", "--vocab", "1024", "--hold", "0.5",
        "--settle", "1", "--json",
    )  # fmt: skip
    assert result["growth_mib"] == pytest.approx(result["peak_mib"] - result["baseline_mib"])
    assert result["growth_within_bound"]


def test_run_py_fresh_rounds_abandon_no_draw():
    # Before: each fresh round RESET its slots first, abandoning their uncommitted
    # draws, and the worker's default abandon budget refused the benchmark
    # (DRAW_RATE_LIMITED). It commits each slot's last round instead: 8 fresh
    # rounds of 4 slots (32 draws, twice the default burst) run, and the last
    # rounds are still answered from the worker's cache.
    import asyncio
    import importlib.util

    from pp1wire.apps.launch import worker_process

    spec = importlib.util.spec_from_file_location("bench_run", BENCH / "run.py")
    assert spec is not None
    assert spec.loader is not None
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)

    async def rounds(port: int) -> float:
        pp1 = await run.Pp1.setup(port)
        try:
            seconds = await pp1.fresh(run.DENSE_SLOTS, 8)
            await pp1.replay(run.DENSE_SLOTS)
        finally:
            await pp1.client.close()
        return float(seconds)

    with worker_process("--max-slots", "8", vocab=run.VOCAB) as worker:
        assert asyncio.run(rounds(worker.port)) > 0


# Each script that needs an optional dependency, and the modules it needs.
NEEDS = {
    "run.py": ("zmq", "grpc"),
    **dict.fromkeys(
        (
            "exchange_window.py", "group_memory.py", "hostile_group.py", "shaped.py",
            "sharded.py", "sharding.py", "tp.py", "gpu_check.py", "gpu_sharded_check.py",
            "gpu_verify_check.py", "gpu_worker_check.py",
        ),
        ("torch",),
    ),
}  # fmt: skip

_WITHOUT = """
import contextlib, io, json, runpy, sys
blocked, scripts = json.loads(sys.argv[1]), json.loads(sys.argv[2])
for name in blocked:
    sys.modules[name] = None  # any import of it now fails
bench = sys.argv[3]
sys.path.insert(0, bench)
out = {}
for script in scripts:
    err = io.StringIO()
    sys.argv = [script]
    code = None
    with contextlib.redirect_stderr(err):
        try:
            runpy.run_path(bench + "/" + script, run_name="__main__")
        except SystemExit as exc:
            code = exc.code
        except BaseException as exc:
            code = repr(exc)
    out[script] = [code, err.getvalue()]
print(json.dumps(out))
"""


def test_a_script_without_its_optional_dependency_says_so_in_one_line():
    # All scripts in one child with torch, ZeroMQ and gRPC blocked: a process each
    # would cost a second each.
    blocked = sorted({m for mods in NEEDS.values() for m in mods} | {"torch.distributed"})
    done = cli.run(
        sys.executable, "-c", _WITHOUT, json.dumps(blocked), json.dumps(sorted(NEEDS)), BENCH
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.splitlines()[-1])
    for script, (code, err) in results.items():
        extra = "bench" if "zmq" in NEEDS[script] else "tp"
        assert code == 2, (script, code, err[-2000:])
        assert err.count("\n") == 1, (script, err)
        names = " and ".join(NEEDS[script])
        assert err == f"{script}: needs {names}: pip install -e '.[{extra}]'\n", (script, err)
