"""Integrity vectors: §5.1's keys and tags for a fixed key and handshake."""

from __future__ import annotations

from typing import Any

import numpy as np

from pp1wire.q import dyadic
from pp1wire.q.proposal import prefix_digest
from pp1wire.testing.builders import SESSION, open_message, reply_header, reply_step
from pp1wire.testing.golden.common import NONCE, Vector, hello
from pp1wire.wire import framing, integrity, messages
from pp1wire.wire.handshake import worker_proof

PSK = b"pp1 golden vector key"
WORKER_NONCE = bytes(range(16, 48))


def _handshake() -> tuple[bytes, bytes]:
    """(H_hello, H_challenge): the header bytes the keys are bound to."""
    spark_hello = framing.encode_frame(hello(2, integrity=integrity.SCHEME))
    challenge = messages.Challenge(nonce=WORKER_NONCE, proof=worker_proof(PSK, NONCE, WORKER_NONCE))
    return (
        spark_hello[framing.PREAMBLE_SIZE :],
        framing.encode_frame(challenge)[framing.PREAMBLE_SIZE :],
    )


def _directions() -> dict[str, list[tuple[messages.Message, bytes]]]:
    tokens = [1, 2, 3]
    sparse = (
        np.array([0, 2, 7], dtype="<i4").tobytes()
        + dyadic.counts_to_fp32(np.array([dyadic.M // 4, dyadic.M // 4, dyadic.M // 2])).tobytes()
    )
    return {
        "spark_to_worker": [
            (open_message(SESSION, 0, tokens, seed=5), np.asarray(tokens, "<i4").tobytes()),
            (messages.Ping(nonce=1), b""),
        ],
        "worker_to_spark": [
            (hello(1, SESSION, integrity=integrity.SCHEME), b""),
            (
                messages.Opened(
                    session=SESSION, slot=0, generation=0, position=3, digest=prefix_digest(tokens)
                ),
                b"",
            ),
            (reply_header(reply_step(3), 0, 2, sparse), sparse),
        ],
    }


def _keys(context: dict[str, Any]) -> dict[str, bytes]:
    k_sw, k_ws = integrity.frame_keys(
        bytes.fromhex(context["psk"]),
        bytes.fromhex(context["hello_header"]),
        bytes.fromhex(context["challenge_header"]),
    )
    return {"spark_to_worker": k_sw, "worker_to_spark": k_ws}


def integrity_vectors() -> list[Vector]:
    """One vector per direction (tagged frames from n = 0), then a payload changed in transit."""
    hello_header, challenge_header = _handshake()
    context = {
        "psk": PSK.hex(),
        "hello_header": hello_header.hex(),
        "challenge_header": challenge_header.hex(),
    }
    keys = _keys(context)

    def vector(name: str, stream: bytes, direction: str) -> Vector:
        out: Vector = {"name": name, "kind": "integrity", "hex": stream.hex()}
        out["context"] = {**context, "direction": direction}
        out["expect"] = run_integrity_vector(out)
        return out

    out: list[Vector] = []
    for direction, msgs in _directions().items():
        sealer = integrity.Sealer(keys[direction])
        stream = b"".join(sealer.seal(framing.encode_frame(m, p, tagged=True)) for m, p in msgs)
        out.append(vector(f"integrity_{direction}", stream, direction))
    # The OPEN's tokens changed by a relay: the header and its checksum still hold.
    good = bytes.fromhex(out[0]["hex"])
    first = framing.FrameDecoder(1 << 20).feed(good)[0]
    flipped = bytearray(good)
    flipped[len(first.raw) - 1] ^= 0x01  # last payload byte of the OPEN
    out.append(vector("integrity_payload_changed", bytes(flipped), "spark_to_worker"))
    return out


def run_integrity_vector(vector: Vector) -> dict[str, Any]:
    """Derive the keys from ``context``, then check each frame's tag in order.

    Returns ``{"k_sw", "k_ws", "frames": [{"type", "n", "tag"}...]}``, with
    ``"error": "INTEGRITY_FAILED", "at": n`` at the first frame whose tag is wrong.
    """
    context = vector["context"]
    keys = _keys(context)
    out: dict[str, Any] = {
        "k_sw": keys["spark_to_worker"].hex(),
        "k_ws": keys["worker_to_spark"].hex(),
        "frames": [],
    }
    opener = integrity.Opener(keys[context["direction"]])
    for n, frame in enumerate(framing.FrameDecoder(1 << 20).feed(bytes.fromhex(vector["hex"]))):
        if not opener.check(frame):
            out["error"], out["at"] = "INTEGRITY_FAILED", n
            break
        assert frame.tag is not None
        out["frames"].append({"type": frame.type.name, "n": n, "tag": bytes(frame.tag).hex()})
    return out
