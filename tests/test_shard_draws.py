"""A sharded worker group draws each STEP's block as one worker draws it (``docs/tp.md`` §11).

The group's drawing (``ShardedDrafting``'s draw of matched STEPs) against one
process's ``propose_batch``, for a logits and a probabilities drafter, dense and
sparse, under every stop rule: the same blocks, row for row, and every rank
stops each block at the same row (each row's count at its token travels with
the token). Two ranks as threads of this process, gloo; the STEPs are handed
to the draw as matched, without links.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pp1wire.apps.models import drafter_factory  # noqa: E402
from pp1wire.q.batch import propose_batch  # noqa: E402
from pp1wire.q.layout import ShardLayout  # noqa: E402
from pp1wire.q.proposal import DraftJob  # noqa: E402
from pp1wire.q.stoprules import StopRule  # noqa: E402
from pp1wire.tp.coordinator import GroupCoordinator  # noqa: E402
from pp1wire.tp.shard_worker import ShardedDrafting, _Held  # noqa: E402
from pp1wire.wire.messages import Step  # noqa: E402

from .groups import run_in_threads  # noqa: E402

V = 48
LAYOUT = ShardLayout.even(V, 2)
RULES = ["fixed", "confidence:0.2", "joint:0.02"]
# (support, temperature): dense, sparse and greedy blocks in one batch.
SHAPES = [(0, 1.0), (5, 1.0), (0, 0.0), (3, 1.0)]


def steps(rule: StopRule) -> list[tuple[Step, int, list[int]]]:
    """One STEP per shape, each of its own slot, seed and prompt."""
    out = []
    for slot, (support, temperature) in enumerate(SHAPES):
        step = Step(
            session=1, slot=slot, generation=0, round=2, position=3, digest=0, depth=5,
            temperature=temperature, support=support, context=0,
            stop=int(rule.kind), threshold=rule.threshold,
        )  # fmt: skip
        out.append((step, 40 + slot, [1, 2, 3 + slot]))
    return out


def one_process(kind: str, rule: StopRule) -> list[list[tuple[int, int, np.ndarray]]]:
    """Each STEP's block from one process: (token, count at it, dense counts) per row."""
    jobs = [
        DraftJob(seed, st.generation, st.round, prefix, st.depth, st.temperature, st.support,
                 None, rule)
        for st, seed, prefix in steps(rule)
    ]  # fmt: skip
    drafter = drafter_factory(vocab_size=V, seed=3, kind=kind)
    out = []
    for rows in propose_batch(drafter.batch, jobs, V, kind=kind):
        assert isinstance(rows, tuple), rows
        out.append([(r.token, r.count_at(r.token), r.dense_counts(V)) for r in rows])
    return out


def group(kind: str) -> dict[str, list]:
    """Every rule's blocks as each rank drew them: (token, this rank's dense piece)."""

    def body(coord: GroupCoordinator) -> dict[str, list]:
        drafting = ShardedDrafting(coord, drafter_factory(vocab_size=V, seed=3, kind=kind))
        lo, hi = LAYOUT.range(coord.rank)
        out = {}
        ended = {}  # each STEP's rows, by its held entry

        def keep(_position, _drawn, done):
            ended.update((id(c.held), rows) for c, rows in done)

        for text in RULES:
            rule = StopRule.parse(text)
            held = [
                _Held(None, (), SimpleNamespace(step=st, seed=seed, prefix=prefix, eos=None),
                      lambda _r: None)
                for st, seed, prefix in steps(rule)
            ]  # fmt: skip
            ended.clear()
            drafting._chains(held, keep)
            blocks = []
            for rows in (ended[id(h)] for h in held):
                assert isinstance(rows, tuple), rows
                pieces = []
                for r in rows:
                    piece = np.zeros(hi - lo, dtype=np.int64)
                    if r.ids is None:
                        piece[:] = r.counts
                    else:
                        piece[r.ids.astype(np.int64) - lo] = r.counts
                    pieces.append((r.token, piece))
                blocks.append(pieces)
            out[text] = blocks
        for lane in drafting._lanes:
            lane.shutdown(wait=False)
        return out

    results = run_in_threads(2, body, layout=LAYOUT, timeout=20.0)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return {text: [r[text] for r in results] for text in RULES}


@pytest.mark.parametrize("kind", ["logits", "probs"])
def test_the_group_draws_one_workers_blocks_under_every_stop_rule(kind):
    drawn = group(kind)
    lengths = {}
    for text in RULES:
        want = one_process(kind, StopRule.parse(text))
        per_rank = drawn[text]
        for s, block in enumerate(want):
            got = [rank[s] for rank in per_rank]
            assert [len(b) for b in got] == [len(block)] * 2, (text, s)
            for i, (token, count, counts) in enumerate(block):
                assert [b[i][0] for b in got] == [token, token]
                joined = np.concatenate([b[i][1] for b in got])
                assert np.array_equal(joined, counts), (text, s, i)
                assert joined[token] == count
        lengths[text] = [len(b) for b in want]
    # The rules stopped some blocks early (no terminal token: only a rule does).
    assert lengths["fixed"] == [5] * len(SHAPES)
    assert sum(lengths["confidence:0.2"]) < sum(lengths["fixed"])
    assert sum(lengths["joint:0.02"]) < sum(lengths["fixed"])
