"""HELLO vectors (``docs/protocol.md`` §4.1): for each pair of adjacent checked rows of
:data:`~pp1wire.wire.handshake.HELLO_RULES` one HELLO breaks both and expects the first row's
code; a few more fix the worker's ``max_frame`` limit and that a keyed worker checks after AUTH."""

from __future__ import annotations

import itertools
from typing import Any

import msgspec

from pp1wire.q.layout import ShardLayout
from pp1wire.q.stoprules import STOP_RULES
from pp1wire.testing.builders import VOCAB, older_hello_frame, shard_fields
from pp1wire.testing.golden.common import GROUP, Vector, hello
from pp1wire.wire import framing, handshake, integrity
from pp1wire.wire.messages import WIRE_VERSION

#: The worker every HELLO vector talks to; the Spark HELLO of :func:`hello` fits it.
WORKER: dict[str, Any] = {
    "vocab_size": VOCAB,
    "vocab_hash": 0,
    "target_identity": "pp1-toy-target",
    "draft_identity": "pp1-toy-drafter",
    "max_slots": 4,
    "max_depth": 5,
    "max_support": 4,
    "row_entries": VOCAB,
    "max_frame": 1 << 20,
    "max_prefix": 1024,
    "psk": None,
    "layout": [0, VOCAB],
    "shard": 0,
    "stop_rules": STOP_RULES,
}

_OTHER_LAYOUT = ShardLayout((0, 4, VOCAB))


def _refused(code: str) -> dict[str, Any]:
    """What a worker that refuses the HELLO with ``code`` sends first."""
    return {"error": code, "answers": "HELLO", "scope": 2}


#: For each checked row (by its first field), HELLO fields that break only that row.
BREAK: dict[str, dict[str, Any]] = {
    "role": {"role": 1},
    "wire_version": {"wire_version": WIRE_VERSION + 1},
    "q_semantic": {"q_semantic": "dyadic16-standard-v1"},
    "verifier": {"verifier": "pp1-standard-verifier-v0"},
    "rng_abi": {"rng_abi": "pp1-philox4x32-10-v0"},
    "precision": {"precision": "bf16"},
    "vocab_size": {"vocab_size": VOCAB - 1},
    "vocab_hash": {"vocab_hash": 99},
    "draft_identity": {"draft_identity": "another-drafter"},
    "target_identity": {"target_identity": "another-target"},
    "integrity": {"integrity": integrity.SCHEME},
    "max_slots": {"max_slots": 5},
    "row_entries": {"row_entries": VOCAB + 1},
    "max_frame": {"max_frame": (1 << 20) + 1},
    "max_prefix": {"max_prefix": 1025},
    "shards": shard_fields(_OTHER_LAYOUT, 1),
    "stop_rules": {"stop_rules": "pp1-stop-rules-v0"},
    "group": {"group": GROUP},
    # The value an older peer's omitted field takes (§4.1, §11).
    "row_format": {"row_format": ""},
}

_SHARD_0 = shard_fields(_OTHER_LAYOUT, 0)
_SHARDED_WORKER = {"layout": list(_OTHER_LAYOUT.bounds), "shard": 0}


def hello_vectors() -> list[Vector]:
    """One vector per adjacent pair of checked HELLO rows, then the single-rule ones."""
    checked = [r for r in handshake.HELLO_RULES if r.checked]
    cases: list[tuple[str, dict[str, Any], dict[str, Any], dict[str, Any]]] = []
    for first, second in itertools.pairwise(checked):
        a, b = first.fields[0], second.fields[0]
        assert first.code is not None
        cases.append(
            (f"hello_order_{a}_{b}", {**BREAK[a], **BREAK[b]}, {}, _refused(first.code.name))
        )
    hard = framing.HARD_MAX_PAYLOAD
    cases += [
        (
            # Two rows apart: the draft identity (row 9) comes before integrity (row 11).
            "hello_order_draft_identity_integrity",
            {**BREAK["draft_identity"], **BREAK["integrity"]},
            {},
            _refused("IDENTITY_MISMATCH"),
        ),
        ("hello_accepted", {}, {}, {"answer": "HELLO"}),
        ("hello_max_frame_at_limit", {"max_frame": hard}, {"max_frame": hard}, {"answer": "HELLO"}),
        (
            "hello_max_frame_above_limit",
            {"max_frame": hard + 1},
            {"max_frame": hard},
            _refused("LIMIT_EXCEEDED"),
        ),
        ("hello_stop_rules_accepted", {"stop_rules": STOP_RULES}, {}, {"answer": "HELLO"}),
        (
            # A worker that implements no stop rules refuses a Spark side that asks for them.
            "hello_stop_rules_not_implemented",
            {"stop_rules": STOP_RULES},
            {"stop_rules": ""},
            _refused("STOP_RULES_MISMATCH"),
        ),
        (
            # §6.7: a sharded link negotiates the stop rules as an unsharded one does.
            "hello_stop_rules_on_a_sharded_link",
            {**_SHARD_0, "group": GROUP, "stop_rules": STOP_RULES},
            _SHARDED_WORKER,
            {"answer": "HELLO", "group": GROUP.hex()},
        ),
        (
            # §6.7: a sharded link's HELLO names its group session with 16 bytes.
            "hello_shard_group_accepted",
            {**_SHARD_0, "group": GROUP},
            _SHARDED_WORKER,
            {"answer": "HELLO", "group": GROUP.hex()},
        ),
        ("hello_shard_group_missing", _SHARD_0, _SHARDED_WORKER, _refused("SHARD_LAYOUT_MISMATCH")),
        (
            "hello_shard_group_short",
            {**_SHARD_0, "group": GROUP[:8]},
            _SHARDED_WORKER,
            _refused("SHARD_LAYOUT_MISMATCH"),
        ),
        (
            # §4.1: a row format this document does not define.
            "hello_row_format_other",
            {"row_format": "pp1-fixed-rows-v2"},
            {},
            _refused("ROW_FORMAT_MISMATCH"),
        ),
        (
            # §5: with a key, no rule is checked before AUTH, not even the role.
            "hello_keyed_role_after_auth",
            BREAK["role"],
            {"psk": b"a-key-of-at-least-16-bytes".hex()},
            {"answer": "CHALLENGE"},
        ),
    ]
    frames = [
        (name, framing.encode_frame(msgspec.structs.replace(hello(2), **fields)), worker, expect)
        for name, fields, worker, expect in cases
    ]
    # §4.1, §11: the HELLO of a peer before row_format: fields 1..27, no field 28.
    omitted = older_hello_frame(hello(2))
    frames.append(("hello_row_format_omitted", omitted, {}, _refused("ROW_FORMAT_MISMATCH")))
    return [
        {
            "name": name,
            "kind": "hello",
            "hex": frame.hex(),
            "context": {**WORKER, **worker},
            "expect": expect,
        }
        for name, frame, worker, expect in frames
    ]
