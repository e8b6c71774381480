"""Cases of ``docs/protocol.md`` §6.7, the links of a vocabulary-sharded worker group: with
``--vocab-shards N`` link r is at the worker's port + r, one group nonce per session; without
it, an unsharded worker must refuse a sharded HELLO."""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import time
from collections.abc import Iterator

import numpy as np

from pp1wire.errors import ErrorCode
from pp1wire.q import dyadic
from pp1wire.q.layout import ShardLayout, ShardSummary, check_group
from pp1wire.q.stoprules import StopRule, stop_after
from pp1wire.testing.builders import shard_fields
from pp1wire.testing.conformance import core, handshake
from pp1wire.testing.conformance.core import CaseFailed, Peer, Settings
from pp1wire.testing.conformance.stoprules import check_cut, negotiate
from pp1wire.wire import framing
from pp1wire.wire.messages import GROUP_NONCE_SIZE, Completion, MsgType, Reply

case = core.Section("sharded links").case


def _layout(s: Settings) -> ShardLayout:
    return ShardLayout.even(s.vocab, max(s.shards, 1))


@case(
    "6.7.1",
    "a HELLO declaring another vocabulary split is refused",
    "shards, shard, range and layout digest: all exact, else SHARD_LAYOUT_MISMATCH (fatal)",
)
async def other_split(s: Settings) -> None:
    # A sharded worker is declared the unsharded layout; an unsharded one, two shards.
    layout = ShardLayout((0, s.vocab)) if s.shards > 1 else ShardLayout.even(s.vocab, 2)
    await handshake._mismatch_run(s, shard_fields(layout, 0), ErrorCode.SHARD_LAYOUT_MISMATCH)


@case(
    "6.7.2",
    "a HELLO with the right ranges but another layout digest is refused",
    "the layout digest is matched exactly, so a split that differs on another link is refused",
)
async def other_digest(s: Settings) -> None:
    fields = shard_fields(_layout(s), 0)
    fields["layout"] ^= 1
    await handshake._mismatch_run(s, fields, ErrorCode.SHARD_LAYOUT_MISMATCH)


@case(
    "6.7.3",
    "rank 0's link refuses a HELLO that names another link's shard",
    "each link serves one shard: shard and range exact, else SHARD_LAYOUT_MISMATCH",
)
async def other_shard(s: Settings) -> None:
    _needs_group(s)
    await handshake._mismatch_run(s, shard_fields(_layout(s), 1), ErrorCode.SHARD_LAYOUT_MISMATCH)


def _needs_group(s: Settings) -> None:
    if s.shards < 2:
        raise core.NonStrictSkip("needs --vocab-shards N (a sharded worker group)")


@contextlib.contextmanager
def _closing() -> Iterator[list[Peer]]:
    """A list for the block's peers, each closed when the block ends, however it ends."""
    peers: list[Peer] = []
    try:
        yield peers
    finally:
        for peer in peers:
            peer.close()


async def _link(
    s: Settings, rank: int, group: bytes, *, seed: int = 11, rules: bool = False
) -> Peer:
    """A link of group session ``group`` to rank ``rank``, slot 0 open (``rules``: its HELLO
    negotiated the stop rules, :func:`negotiate`)."""
    link = dataclasses.replace(s, port=s.port + rank, shard=rank, group=group)
    peer = await Peer(link).connect()
    try:
        await (negotiate(peer, f"link {rank}") if rules else peer.handshake())
        await peer.open_slot(seed=seed)
    except BaseException:
        peer.close()
        raise
    return peer


async def _reply(peer: Peer, timeout: float | None) -> tuple[list[framing.Frame], Completion]:
    """The next whole reply on ``peer`` (its frames, then its COMPLETION), else CaseFailed."""
    frames: list[framing.Frame] = []
    while True:
        frame = await peer.next(timeout)
        if frame is None or frame.type is MsgType.ERROR:
            raise CaseFailed(f"link {peer.s.shard}: no complete reply ({core.describe(frame)})")
        if isinstance(frame.message, Completion):
            return frames, frame.message
        frames.append(frame)


async def _group_reply(s: Settings, support: int) -> None:
    _needs_group(s)
    layout = _layout(s)
    with _closing() as peers:
        for r in range(layout.shards):
            peers.append(await _link(s, r, s.group))
        for peer in peers:  # every STEP out before any reply: the ranks draw together
            peer.send_msg(peer.step_msg(depth=5, support=support))
        summaries, rows = [], []
        for r, peer in enumerate(peers):
            start, end = layout.range(r)
            frames, done = await _reply(peer, None)
            if done.status or (done.start, done.end) != (start, end):
                raise CaseFailed(f"link {r}: COMPLETION status {done.status}, range wrong")
            tokens, masses, shard_rows = [], [], []
            for f in frames:
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


@case(
    "6.7.4",
    "dense: each link carries its range, the same tokens, counts adding up to 2**24",
    "row i on every link: token x_i, start/end the link's range, entries end - start; "
    "the shards' counts sum to 2**24 and q(x_i) > 0 on the shard that owns x_i",
)
async def dense_group(s: Settings) -> None:
    await _group_reply(s, 0)


@case(
    "6.7.5",
    "sparse: each link carries the global support's entries in its range",
    "sparse rows hold the entries of the global top-k whose IDs lie in the link's range "
    "(possibly none); the same tokens on every link; counts sum to 2**24",
)
async def sparse_group(s: Settings) -> None:
    await _group_reply(s, min(s.support, s.vocab))


# -- group sessions: a STEP matches only its own session's, on every link ----------------


async def _answer(peer: Peer, timeout: float) -> tuple[int, tuple[int, ...]]:
    """The next reply on ``peer``: its COMPLETION status and its tokens."""
    frames, done = await _reply(peer, timeout)
    return done.status, tuple(f.message.token for f in frames if isinstance(f.message, Reply))


@case(
    "6.7.6",
    "a STEP with another group session's key is never matched with it",
    "a link of another group nonce that sends a session's exact STEP (slot, round, prefix "
    "digest: all predictable) first gets GROUP_UNMATCHED, never that session's proposal; "
    "the session's own links get theirs, the same tokens on each",
)
async def foreign_key(s: Settings) -> None:
    _needs_group(s)
    world = s.shards
    ours = secrets.token_bytes(GROUP_NONCE_SIZE)
    with _closing() as peers:
        foreign = await _link(s, world - 1, secrets.token_bytes(GROUP_NONCE_SIZE))
        peers.append(foreign)
        for r in range(world):
            peers.append(await _link(s, r, ours))
        step = foreign.step_msg(depth=3)
        foreign.send_msg(step)  # first: a key-only match would pair it with ours
        for peer in peers[1:]:
            peer.send_msg(peer.step_msg(depth=3))
        answers = [await _answer(peer, s.match_wait) for peer in peers[1:]]
        if any(status for status, _ in answers):
            raise CaseFailed(f"the session's own STEPs were not drawn: {answers}")
        if len({tokens for _, tokens in answers}) != 1:
            raise CaseFailed(f"the session's links carry different tokens: {answers}")
        status, tokens = await _answer(foreign, s.match_wait)
        if status != ErrorCode.GROUP_UNMATCHED:
            raise CaseFailed(
                f"the foreign STEP got status {status} and tokens {tokens}, not GROUP_UNMATCHED"
            )


@case(
    "6.7.7",
    "a half-sent STEP is answered GROUP_UNMATCHED and stalls no other session",
    "a STEP sent on one link of a session only is answered alone after the match timeout "
    "with GROUP_UNMATCHED; another session's STEPs, sent after it, are answered before",
)
async def half_sent(s: Settings) -> None:
    _needs_group(s)
    world = s.shards
    half, whole = secrets.token_bytes(GROUP_NONCE_SIZE), secrets.token_bytes(GROUP_NONCE_SIZE)
    with _closing() as peers:
        lone = await _link(s, 0, half)
        peers.append(lone)
        for r in range(world):
            peers.append(await _link(s, r, whole, seed=12))
        others = peers[1:]
        lone.send_msg(lone.step_msg(depth=2))
        sent = time.monotonic()
        for peer in others:
            peer.send_msg(peer.step_msg(depth=2))
        for peer in others:
            status, _ = await _answer(peer, s.match_wait)
            if status:
                raise CaseFailed(f"the whole session's STEP was answered with status {status}")
        served = time.monotonic() - sent
        status, _ = await _answer(lone, s.match_wait)
        unmatched = time.monotonic() - sent
        if status != ErrorCode.GROUP_UNMATCHED:
            raise CaseFailed(f"the half-sent STEP got status {status}, not GROUP_UNMATCHED")
        if served >= unmatched:
            raise CaseFailed(
                f"the other session waited for the half-sent STEP: served after {served:.2f} s, "
                f"the half-sent one answered after {unmatched:.2f} s"
            )


@case(
    "6.7.8",
    "a closed link's STEP is dropped with it, and matches nothing later",
    "a link that sends a STEP and closes leaves nothing behind: a later session's identical "
    "STEPs on every link are matched with each other and drawn at once",
)
async def closed_leftovers(s: Settings) -> None:
    _needs_group(s)
    world = s.shards
    with _closing() as peers:
        gone = await _link(s, world - 1, secrets.token_bytes(GROUP_NONCE_SIZE))
        gone.send_msg(gone.step_msg(depth=2))
        await gone.quiet(0.05)
        gone.close()
        later = secrets.token_bytes(GROUP_NONCE_SIZE)
        for r in range(world):
            peers.append(await _link(s, r, later))
        for peer in peers:
            peer.send_msg(peer.step_msg(depth=2))
        answers = [await _answer(peer, s.match_wait) for peer in peers]
        if any(status for status, _ in answers) or len({t for _, t in answers}) != 1:
            raise CaseFailed(f"the later session's STEPs were not drawn together: {answers}")


# -- stop rules on a sharded group: every link stops where one worker stops -----------------


async def _ruled_group(
    s: Settings, rule: StopRule, support: int
) -> list[tuple[list[framing.Frame], Completion]]:
    """Round 0 of slot 0 (seed 11) under ``rule``, depth 5, on every link of a fresh
    group session that negotiated the stop rules: each link's rows and COMPLETION.

    Raises:
        core.NonStrictSkip: the worker refused the stop-rule set (it implements none).
        CaseFailed: a link did not answer with a complete reply.
    """
    group = secrets.token_bytes(GROUP_NONCE_SIZE)
    with _closing() as peers:
        for r in range(_layout(s).shards):
            peers.append(await _link(s, r, group, rules=True))
        step = {"depth": 5, "support": support, "stop": int(rule.kind)}
        for peer in peers:  # every STEP out before any reply: the ranks draw together
            peer.send_msg(peer.step_msg(**step, threshold=rule.threshold))
        out = []
        for r, peer in enumerate(peers):
            frames, done = await _reply(peer, s.match_wait)
            if done.status:
                raise CaseFailed(f"link {r}: COMPLETION status {done.status}")
            out.append((frames, done))
        return out


def _count_at(frame: framing.Frame, x: int, span: tuple[int, int]) -> int:
    """A shard row's count of the global ID ``x`` (0 outside its range or support)."""
    msg = frame.message
    assert isinstance(msg, Reply)
    start, end = span
    payload = bytes(frame.payload)
    if not start <= x < end:
        return 0
    if msg.representation == 0:
        return int(float(np.frombuffer(payload, dtype="<f4")[x - start]) * dyadic.M)
    ids = np.frombuffer(payload[: 4 * msg.entries], dtype="<i4")
    values = np.frombuffer(payload[4 * msg.entries :], dtype="<f4")
    where = np.flatnonzero(ids == x)
    return int(float(values[where[0]]) * dyadic.M) if where.size else 0


def _ruled_case(case_id: str, text: str, sparse: bool) -> None:
    rule = StopRule.parse(text)

    async def run(s: Settings) -> None:
        _needs_group(s)
        support = min(s.support, s.vocab) if sparse else 0
        layout = _layout(s)
        fixed = await _ruled_group(s, StopRule(), support)
        ruled = await _ruled_group(s, rule, support)
        rows = fixed[0][0]
        if len(rows) != 5:
            raise CaseFailed(f"the fixed depth-5 block has {len(rows)} rows")
        tokens = [f.message.token for f in rows]  # type: ignore[union-attr]
        # Row i's count at its token: the link whose range holds the token has it.
        counts = [
            sum(_count_at(link[0][i], x, layout.range(r)) for r, link in enumerate(fixed))
            for i, x in enumerate(tokens)
        ]
        end = stop_after(rule, 5, counts, tokens, None)
        assert end is not None  # the depth ends it at the latest
        for r, ((got, done), (whole, _)) in enumerate(zip(ruled, fixed, strict=True)):
            check_cut(rule, f"link {r}", got, done, whole, end)

    case(
        case_id,
        f"{text} ({'sparse' if sparse else 'dense'}): every link's block is the fixed block "
        "cut where the rule ends it",
        "each row's count at its token is on the link owning the token; every link ships "
        "the rows up to where the rule, from those counts, ends the block, and stopped = "
        "fewer rows than the depth",
    )(run)


_ruled_case("6.7.9", "confidence:0.5", sparse=False)
_ruled_case("6.7.10", "joint:0.02", sparse=True)
