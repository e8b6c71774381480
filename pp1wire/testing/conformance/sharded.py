"""Cases of ``docs/protocol.md`` §6.7: the links of a vocabulary-sharded worker group.

With ``--vocab-shards N`` the suite's HELLO declares shard 0 of the even
layout on ``--worker`` (rank 0's link), and the cases that need the whole group
connect to every link: rank r at the worker's port + r. Without it they check
that an unsharded worker refuses a sharded HELLO.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pp1wire.errors import ErrorCode
from pp1wire.q import dyadic
from pp1wire.q.layout import ShardLayout, ShardSummary, check_group
from pp1wire.testing.conformance import core, handshake
from pp1wire.testing.conformance.core import CaseFailed, Peer, Settings
from pp1wire.wire import framing
from pp1wire.wire.messages import Completion, MsgType, Reply


def _layout(s: Settings) -> ShardLayout:
    return ShardLayout.even(s.vocab, max(s.shards, 1))


def _declared(layout: ShardLayout, shard: int) -> dict[str, int]:
    start, end = layout.range(shard)
    return {
        "shards": layout.shards,
        "shard": shard,
        "shard_start": start,
        "shard_end": end,
        "layout": layout.digest,
    }


async def _refused_with_layout(s: Settings, fields: dict[str, int]) -> None:
    # The worker answers a keyed HELLO with CHALLENGE first (§5): authenticate, then
    # expect the refusal, as every HELLO mismatch case does.
    await handshake._mismatch_run(s, fields, ErrorCode.SHARD_LAYOUT_MISMATCH)


@core.case(
    "6.7.1",
    "sharded links",
    "a HELLO declaring another vocabulary split is refused",
    "shards, shard, range and layout digest: all exact, else SHARD_LAYOUT_MISMATCH (fatal)",
)
async def other_split(s: Settings) -> None:
    if s.shards > 1:  # declare the unsharded layout to a sharded worker
        fields = _declared(ShardLayout((0, s.vocab)), 0)
    else:
        fields = _declared(ShardLayout.even(s.vocab, 2), 0)
    await _refused_with_layout(s, fields)


@core.case(
    "6.7.2",
    "sharded links",
    "a HELLO with the right ranges but another layout digest is refused",
    "the layout digest is matched exactly, so a split that differs on another link is refused",
)
async def other_digest(s: Settings) -> None:
    fields = _declared(_layout(s), 0)
    fields["layout"] ^= 1
    await _refused_with_layout(s, fields)


@core.case(
    "6.7.3",
    "sharded links",
    "rank 0's link refuses a HELLO that names another link's shard",
    "each link serves one shard: shard and range exact, else SHARD_LAYOUT_MISMATCH",
)
async def other_shard(s: Settings) -> None:
    if s.shards < 2:
        raise core.NonStrictSkip("needs --vocab-shards N (a sharded worker group)")
    await _refused_with_layout(s, _declared(_layout(s), 1))


async def _group_reply(s: Settings, support: int) -> None:
    if s.shards < 2:
        raise core.NonStrictSkip("needs --vocab-shards N (a sharded worker group)")
    layout = _layout(s)
    peers = []
    try:
        for r in range(layout.shards):
            link = dataclasses.replace(s, port=s.port + r, shard=r)
            peer = await Peer(link).connect()
            peers.append(peer)
            await peer.handshake()
            await peer.open_slot(seed=11)
        for peer in peers:  # every STEP out before any reply: the ranks draw together
            peer.send_msg(peer.step_msg(depth=5, support=support))
        summaries, rows = [], []
        for r, peer in enumerate(peers):
            start, end = layout.range(r)
            frames: list[framing.Frame] = []
            while not frames or frames[-1].type is not MsgType.COMPLETION:
                frame = await peer.next()
                if frame is None or frame.type is MsgType.ERROR:
                    raise CaseFailed(f"link {r}: no complete reply ({core.describe(frame)})")
                frames.append(frame)
            done = frames[-1].message
            assert isinstance(done, Completion)
            if done.status or (done.start, done.end) != (start, end):
                raise CaseFailed(f"link {r}: COMPLETION status {done.status}, range wrong")
            tokens, masses, shard_rows = [], [], []
            for f in frames[:-1]:
                msg = f.message
                assert isinstance(msg, Reply)
                if (msg.start, msg.end) != (start, end):
                    raise CaseFailed(f"link {r}: REPLY range {msg.start}..{msg.end}")
                payload = bytes(f.payload)
                if support == 0:
                    if msg.entries != end - start:
                        raise CaseFailed(f"link {r}: {msg.entries} dense entries")
                    q = np.frombuffer(payload, dtype="<f4")
                    ids = np.arange(start, end, dtype=np.int64)
                else:
                    ids = np.frombuffer(payload[: 4 * msg.entries], dtype="<i4").astype(np.int64)
                    q = np.frombuffer(payload[4 * msg.entries :], dtype="<f4")
                    if ids.size and (ids.min() < start or ids.max() >= end):
                        raise CaseFailed(f"link {r}: a sparse ID outside {start}..{end}")
                counts = (q.astype(np.float64) * dyadic.M).astype(np.int64)
                tokens.append(msg.token)
                masses.append(int(counts.sum()))
                shard_rows.append((ids, counts))
            step = peer.step_msg()
            key = (0, 0, step.position, step.digest, 5, 0)
            summaries.append(ShardSummary(key, tuple(tokens), tuple(masses)))
            rows.append(shard_rows)
        code = check_group(summaries)
        if code is not None:
            raise CaseFailed(f"the links do not form one proposal: {code.name}")
        for i, token in enumerate(summaries[0].tokens):
            whole = np.zeros(s.vocab, dtype=np.int64)
            for shard_rows in rows:
                ids, counts = shard_rows[i]
                whole[ids] = counts
            if whole[token] <= 0:
                raise CaseFailed(f"row {i}: q of the drafted token {token} is zero on its shard")
    finally:
        for peer in peers:
            peer.close()


@core.case(
    "6.7.4",
    "sharded links",
    "dense: each link carries its range, the same tokens, counts adding up to 2**24",
    "row i on every link: token x_i, start/end the link's range, entries end - start; "
    "the shards' counts sum to 2**24 and q(x_i) > 0 on the shard that owns x_i",
)
async def dense_group(s: Settings) -> None:
    await _group_reply(s, 0)


@core.case(
    "6.7.5",
    "sharded links",
    "sparse: each link carries the global support's entries in its range",
    "sparse rows hold the entries of the global top-k whose IDs lie in the link's range "
    "(possibly none); the same tokens on every link; counts sum to 2**24",
)
async def sparse_group(s: Settings) -> None:
    await _group_reply(s, min(s.support, s.vocab))
