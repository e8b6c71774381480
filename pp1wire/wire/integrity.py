"""Frame integrity after a pre-shared-key handshake (``docs/protocol.md`` §5.1): per-direction
keys bound to both HELLO nonces and the CHALLENGE, and a 16-byte HMAC tag on every later frame
over its sequence number and bytes, so no frame can be forged, altered, reordered or dropped."""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Final

from pp1wire.wire import framing
from pp1wire.wire.messages import LABEL_PREFIX, MsgType

#: The scheme a HELLO names in its ``integrity`` field when a PSK is configured.
SCHEME: Final = "hmac-sha256-128-v1"
SPARK_TO_WORKER_LABEL: Final = f"{LABEL_PREFIX} spark-to-worker key".encode()
WORKER_TO_SPARK_LABEL: Final = f"{LABEL_PREFIX} worker-to-spark key".encode()
_SEQ = struct.Struct("<Q")


def transcript(hello_header: bytes, challenge_header: bytes) -> bytes:
    """B: what the frame keys are bound to (both nonces and the Spark side's capabilities)."""
    return hashlib.sha256(hello_header).digest() + hashlib.sha256(challenge_header).digest()


def frame_keys(psk: bytes, hello_header: bytes, challenge_header: bytes) -> tuple[bytes, bytes]:
    """(K_sw, K_ws): the Spark-to-worker and worker-to-Spark frame keys."""
    t = transcript(hello_header, challenge_header)
    k_sw = hmac.new(psk, SPARK_TO_WORKER_LABEL + t, hashlib.sha256).digest()
    k_ws = hmac.new(psk, WORKER_TO_SPARK_LABEL + t, hashlib.sha256).digest()
    return k_sw, k_ws


def tag(key: bytes, seq: int, *parts: bytes | memoryview) -> bytes:
    """The 16-byte tag of the ``seq``-th tagged frame of a direction (the frame given in parts)."""
    mac = hmac.new(key, _SEQ.pack(seq), hashlib.sha256)
    for part in parts:
        mac.update(part)
    return mac.digest()[: framing.TAG_SIZE]


class Sealer:
    """Tags the frames one side sends, in order."""

    def __init__(self, key: bytes) -> None:
        """Start at sequence number 0 under ``key``."""
        self._key = key
        self.seq = 0

    def seal(self, frame: bytes) -> bytes:
        """``frame`` (encoded with ``tagged=True``) followed by its tag."""
        return frame + self.tag_next(frame)

    def tag_next(self, *parts: bytes | memoryview) -> bytes:
        """The tag for the frame made of ``parts``, as the next frame sent (written after it)."""
        t = tag(self._key, self.seq, *parts)
        self.seq += 1
        return t


class Opener:
    """Checks the tags of the frames one side receives, in order."""

    def __init__(self, key: bytes) -> None:
        """Expect sequence number 0 first, under ``key``."""
        self._key = key
        self.seq = 0

    def check(self, frame: framing.Frame) -> bool:
        """True if ``frame`` carries the right tag for the next sequence number (constant time)."""
        if frame.tag is None:
            return False
        ok = hmac.compare_digest(tag(self._key, self.seq, frame.raw), frame.tag)
        self.seq += 1
        return ok


#: What a Spark side accepts untagged after AUTH, until the worker's first tagged
#: frame: the worker's answers while it still checks AUTH (a refusal, a PONG).
SPARK_UNTAGGED_BEFORE_HELLO: Final = (MsgType.ERROR, MsgType.PING, MsgType.PONG)


class ReceiveRule:
    """Which received frames §5.1 accepts: untagged before the keys exist, tagged after
    (``untagged_grace``: the types still accepted untagged until the first tagged frame)."""

    def __init__(self, untagged_grace: tuple[MsgType, ...] = ()) -> None:
        """No keys yet: every frame must be untagged."""
        self._grace = untagged_grace
        self._opener: Opener | None = None
        self._tags_seen = False

    @property
    def tags_seen(self) -> bool:
        """Whether a tagged frame has been accepted."""
        return self._tags_seen

    def start(self, key: bytes) -> None:
        """The keys exist: check tags under ``key`` (the peer's direction) from now on."""
        self._opener = Opener(key)

    def accepts(self, frame: framing.Frame) -> bool:
        """Whether ``frame`` is tagged exactly when §5.1 requires it, with the right tag."""
        opener = self._opener
        if frame.tag is not None:
            if opener is None or not opener.check(frame):
                return False
            self._tags_seen = True
            return True
        return opener is None or (not self._tags_seen and frame.type in self._grace)
