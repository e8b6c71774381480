"""Readers of the golden vectors: each runs a vector through this package's own cores and
summarizes the outcome as the vector's ``expect`` does."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from pp1wire.errors import ErrorCode, ProtocolError
from pp1wire.q.layout import ShardLayout
from pp1wire.q.proposal import prefix_digest
from pp1wire.q.stoprules import StopKind, StopRule
from pp1wire.testing.builders import SESSION
from pp1wire.testing.golden.common import GROUP, Vector, message_json
from pp1wire.wire import framing, messages, spark_core, spark_events
from pp1wire.wire.messages import Error, Hello, Message, MsgType, Opened, Step
from pp1wire.wire.worker_core import WorkerConfig, WorkerProtocol


def decode_frame_vector(vector: Vector) -> dict[str, Any]:
    """Run a frame vector through :class:`~pp1wire.wire.framing.FrameDecoder`."""
    decoder = framing.FrameDecoder(vector["context"]["max_payload"])
    try:
        frames = decoder.feed(bytes.fromhex(vector["hex"]))
        decoder.feed(b"")  # surfaces an error that followed valid frames
    except ProtocolError as exc:
        return {"error": exc.code.name}
    out: dict[str, Any] = {"messages": [message_json(f.message, f.payload) for f in frames]}
    if decoder.buffered:
        out["incomplete"] = True
    return out


def message_from_json(obj: dict[str, Any]) -> tuple[Message, bytes]:
    """Rebuild a message (and payload) from :func:`message_json` output."""
    kind = MsgType[obj["type"]]
    struct_type = messages.MESSAGE_TYPES[kind]
    fields = dict(obj["fields"])
    info = msgspec.inspect.type_info(struct_type)
    assert isinstance(info, msgspec.inspect.StructType)
    for field in info.fields:
        if _is_bytes(field.type):
            fields[field.name] = bytes.fromhex(fields[field.name])
    return struct_type(**fields), bytes.fromhex(obj["payload"])  # type: ignore[return-value]


def _is_bytes(t: msgspec.inspect.Type) -> bool:
    """Whether a field holds bytes (shown in hex); REPLY's token is an int here."""
    i = msgspec.inspect
    if isinstance(t, i.Metadata):
        return _is_bytes(t.type)
    return isinstance(t, i.BytesType)


def _frame_ends(data: bytes) -> list[int]:
    """The offset after each frame of ``data`` (tags included)."""
    ends, at = [], 0
    for frame in framing.FrameDecoder(1 << 20).feed(data):
        at += len(frame.raw) + (0 if frame.tag is None else len(frame.tag))
        ends.append(at)
    return ends


def run_reply_vector(vector: Vector) -> dict[str, Any]:
    """Drive a Spark core into the vector's context, feed its bytes, summarize the outcome."""
    ctx = vector["context"]
    step = None if ctx["step"] is None else message_from_json(ctx["step"])[0]
    assert step is None or isinstance(step, Step)
    slot = 0 if step is None else step.slot
    layout = ShardLayout(tuple(ctx["layout"])) if "layout" in ctx else None
    cfg = spark_core.SparkConfig(
        layout=layout,
        shard=ctx.get("shard", 0),
        group=GROUP if layout is not None else b"",
        vocab_size=ctx["vocab_size"],
        row_entries=ctx["row_entries"],
        max_support=ctx["max_support"],
        max_frame=ctx["max_frame"],
        max_prefix=1024,
        draft_identity="",
        stop_rules=ctx.get("stop_rules", ""),
    )
    spark = spark_core.SparkProtocol(cfg, now=0.0)
    spark.start(0.0)
    ours = spark._hello
    assert ours is not None
    worker_hello = msgspec.structs.replace(
        ours, role=1, session=ctx["session"], draft_identity="pp1-toy-drafter"
    )
    spark.receive_data(framing.encode_frame(worker_hello), 0.0)
    prefix = ctx["prefix"]
    spark.open_slot(slot, seed=1, prefix=prefix, eos=ctx["eos"])
    at = {"session": ctx["session"], "slot": slot, "generation": 0, "position": len(prefix)}
    spark.receive_data(framing.encode_frame(Opened(**at, digest=prefix_digest(prefix))), 0.0)
    for _ in range(ctx["generation"]):
        spark.reset(slot)
    if step is not None:
        spark.step(
            slot,
            round_id=step.round,
            depth=step.depth,
            temperature=step.temperature,
            support=step.support,
            now=0.0,
            stop=StopRule(StopKind(step.stop), step.threshold),
        )
    spark.data_to_send()
    data = bytes.fromhex(vector["hex"])
    commit = ctx.get("commit")
    if commit is None:
        events = spark.receive_data(data, 0.0)
    else:
        # Feed the first frames, commit the proposal they completed, then the rest.
        cut = _frame_ends(data)[commit["after"] - 1]
        events = spark.receive_data(data[:cut], 0.0)
        assert step is not None
        drafts = next(
            list(e.proposal.tokens) for e in events if isinstance(e, spark_events.ProposalReady)
        )
        tokens = [*drafts[: commit["accepted"]], commit["extra"]]
        spark.commit(slot, round_id=step.round, tokens=tokens, accepted=commit["accepted"])
        events += spark.receive_data(data[cut:], 0.0)
    if ctx.get("deadline"):
        events += spark.handle_timer(spark.config.reply_timeout)
    result: dict[str, Any] = {"dropped": [], "rejected": []}
    for n, event in enumerate(events):
        following = events[n + 1] if n + 1 < len(events) else None
        if isinstance(event, spark_events.FrameRejected) and (
            isinstance(following, spark_events.ProposalFailed)
            or (
                isinstance(following, spark_events.ProposalReady)
                and following.proposal.cut is event.code
            )
        ):
            continue  # the frame that ended the proposal: reported as "discarded" or "cut"
        if isinstance(event, spark_events.ProposalReady):
            result["proposal"] = list(event.proposal.tokens)
            if event.proposal.cut is not None:
                result["cut"] = event.proposal.cut.name
        elif isinstance(event, spark_events.ProposalFailed):
            result["discarded"] = event.code.name
        elif isinstance(event, spark_events.FrameDropped):
            result["dropped"].append(event.code.name)
        elif isinstance(event, spark_events.FrameRejected):
            # Refused without discarding anything (section 7's "reject").
            result["rejected"].append(event.code.name)
        elif isinstance(event, spark_events.ConnectionFailed):
            result["connection_failed"] = event.code.name
    return result


def run_hello_vector(vector: Vector) -> dict[str, Any]:
    """Give the vector's HELLO to a worker configured as its context; what it sends first.

    Raises:
        AssertionError: if the worker sends nothing.
    """
    ctx = vector["context"]
    cfg = WorkerConfig(
        vocab_size=ctx["vocab_size"],
        vocab_hash=ctx["vocab_hash"],
        target_identity=ctx["target_identity"],
        draft_identity=ctx["draft_identity"],
        max_slots=ctx["max_slots"],
        max_depth=ctx["max_depth"],
        max_support=ctx["max_support"],
        row_entries=ctx["row_entries"],
        max_frame=ctx["max_frame"],
        max_prefix=ctx["max_prefix"],
        psk=None if ctx["psk"] is None else bytes.fromhex(ctx["psk"]),
        layout=ShardLayout(tuple(ctx["layout"])),
        shard=ctx["shard"],
        stop_rules=ctx["stop_rules"],
    )
    vocab = cfg.vocab_size
    worker = WorkerProtocol(cfg, lambda _prefix: np.zeros(vocab), session=SESSION, now=0.0)
    worker.receive_data(bytes.fromhex(vector["hex"]), 0.0)
    sent = framing.FrameDecoder(1 << 20).feed(b"".join(worker.data_to_send()))
    assert sent, "the worker sent nothing"
    first = sent[0].message
    if isinstance(first, Error):
        return {
            "error": ErrorCode(first.code).name,
            "answers": MsgType(first.answers).name,
            "scope": first.scope,
        }
    answer: dict[str, Any] = {"answer": sent[0].type.name}
    if isinstance(first, Hello) and first.group:  # the worker echoes the group nonce
        answer["group"] = first.group.hex()
    return answer
