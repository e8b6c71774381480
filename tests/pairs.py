"""In-memory worker/Spark pairs for protocol tests (no sockets)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pp1wire.apps.models import ToyLM
from pp1wire.q.verify import RequestVerifier
from pp1wire.wire import framing
from pp1wire.wire.messages import Message
from pp1wire.wire.spark_core import SparkConfig, SparkProtocol
from pp1wire.wire.spark_events import SparkEvent
from pp1wire.wire.worker_core import WorkerConfig, WorkerEvent, WorkerProtocol

VOCAB = 64


@dataclass
class Pair:
    worker: WorkerProtocol
    spark: SparkProtocol
    now: float = 0.0
    spark_events: list[SparkEvent] = field(default_factory=list)
    worker_events: list[WorkerEvent] = field(default_factory=list)
    to_worker: list[bytes] = field(default_factory=list)
    to_spark: list[bytes] = field(default_factory=list)

    def pump(self) -> list[SparkEvent]:
        """Move bytes both ways until quiet; return the Spark events of this pump."""
        got: list[SparkEvent] = []
        for _ in range(20):
            moved = False
            for chunk in self.spark.data_to_send():
                moved = True
                self.to_worker.append(chunk)
                self.worker_events += self.worker.receive_data(chunk, self.now)
            for chunk in self.worker.data_to_send():
                moved = True
                self.to_spark.append(chunk)
                got += self.spark.receive_data(chunk, self.now)
            if not moved:
                break
        self.spark_events += got
        return got

    def send_raw(self, msg: Message, payload: bytes = b"") -> list[WorkerEvent]:
        """Send a hand-built message to the worker; return its events."""
        return self.worker.receive_data(framing.encode_frame(msg, payload), self.now)


def make_pair(
    vocab: int = VOCAB,
    *,
    worker_kw: dict | None = None,
    spark_kw: dict | None = None,
    seed: int = 1,
    handshake: bool = True,
) -> Pair:
    drafter = ToyLM(vocab, seed, draft=True)
    worker = WorkerProtocol(
        WorkerConfig(vocab_size=vocab, **(worker_kw or {})), drafter.logits, session=7, now=0.0
    )
    spark = SparkProtocol(SparkConfig(vocab_size=vocab, **(spark_kw or {})), now=0.0)
    pair = Pair(worker, spark)
    if handshake:
        spark.start(0.0)
        pair.pump()
    return pair


def verifier(pair: Pair, seed: int, prefix: Sequence[int]) -> RequestVerifier:
    """The verifier of a request opened on ``pair`` with ``seed`` at ``prefix``, against
    the toy target of seed 1."""
    return RequestVerifier(
        session=pair.spark.session,
        seed=seed,
        vocab_size=pair.spark.config.vocab_size,
        prefix=prefix,
        target=ToyLM(pair.spark.config.vocab_size, 1).probs,
    )


def next_round(spark: SparkProtocol, slot: int = 0) -> int:
    """The round after every round ``slot`` used in its generation: what a request's
    own counter (``RequestVerifier.take_round``) gives when it numbers every round."""
    return spark.next_round(slot)


def step(spark: SparkProtocol, slot: int = 0, **kw: object) -> int:
    """Queue STEP for ``slot`` at :func:`next_round`; returns the round."""
    round_id = next_round(spark, slot)
    kw.setdefault("temperature", 1.0)
    kw.setdefault("support", 0)
    kw.setdefault("now", 0.0)
    spark.step(slot, round_id=round_id, **kw)  # type: ignore[arg-type]
    return round_id
