"""``pp1-spark`` with one deliberate breakage, to prove the Spark-side suite can fail.

Usage: ``python tests/broken_spark.py BREAKAGE [pp1-spark arguments...]``.
"""

from __future__ import annotations

import sys
from typing import Any

from pp1wire.apps import spark
from pp1wire.errors import ErrorCode
from pp1wire.q import validate, verify
from pp1wire.wire import assembly, spark_core


def no_row_checks() -> None:
    """Trust every q row: no finiteness, sign, dyadic, mass or sparse-ID checks."""
    validate.DenseRowValidator.check = lambda self, row, proposed: None  # type: ignore[method-assign]
    validate.check_sparse = lambda *a, **k: None  # type: ignore[assignment]


def no_reply_checksum() -> None:
    """Skip the COMPLETION's size and checksum comparison."""
    original = assembly.ReplyAssembly.check_completion

    def check(self: Any, msg: Any, *, eos: int | None) -> ErrorCode | None:
        code = original(self, msg, eos=eos)
        skipped = (ErrorCode.REPLY_CHECKSUM_MISMATCH, ErrorCode.REPLY_SIZE_MISMATCH)
        return None if code in skipped else code

    assembly.ReplyAssembly.check_completion = check  # type: ignore[method-assign]


def early_completion() -> None:
    """Take a COMPLETION that arrives before the last row (a short proposal)."""
    original = assembly.ReplyAssembly.check_completion

    def check(self: Any, msg: Any, *, eos: int | None) -> ErrorCode | None:
        code = original(self, msg, eos=eos)
        return None if code is ErrorCode.COMPLETION_EARLY else code

    assembly.ReplyAssembly.check_completion = check  # type: ignore[method-assign]


def any_hello() -> None:
    """Accept a worker HELLO whatever its identity fields say."""
    spark_core.first_failure = lambda *a, **k: None  # type: ignore[assignment]


def trust_worker_proof() -> None:
    """Answer a CHALLENGE without verifying the worker's proof."""
    spark_core.hmac.compare_digest = lambda a, b: True  # type: ignore[assignment]


def no_stop_audit() -> None:
    """Take any block whose COMPLETION says it stopped: no recomputation of the rule,
    neither on arrival (a row past the stop) nor at COMPLETION (a block cut early)."""
    assembly.continues = lambda *a, **k: True  # type: ignore[assignment]
    assembly.audit = lambda *a, **k: None  # type: ignore[assignment]
    verify.RequestVerifier._audit_stop = lambda self, *a, **k: None  # type: ignore[method-assign]


def discard_on_fault() -> None:
    """The rule pp1wire no longer follows: a fault discards the whole proposal, the
    valid rows before it included (docs/adaptive.md section 7)."""
    protocol = spark_core.SparkProtocol
    publish = protocol._publish

    def end_block(self: Any, index: int, slot: Any, code: ErrorCode) -> None:
        self._discard(index, slot, code)

    def publish_whole(self: Any, index: int, slot: Any, *, cut: ErrorCode | None = None) -> None:
        if cut is not None:
            self._discard(index, slot, cut)
        else:
            publish(self, index, slot)

    protocol._end_block = end_block  # type: ignore[method-assign]
    protocol._publish = publish_whole  # type: ignore[method-assign]


BREAKAGES = {
    "no-row-checks": no_row_checks,
    "no-reply-checksum": no_reply_checksum,
    "early-completion": early_completion,
    "any-hello": any_hello,
    "trust-worker-proof": trust_worker_proof,
    "no-stop-audit": no_stop_audit,
    "discard-on-fault": discard_on_fault,
}

if __name__ == "__main__":
    BREAKAGES[sys.argv[1]]()
    sys.exit(spark.main(sys.argv[2:]))
