"""Spark-side conformance: a hostile worker (a worker core whose frames a case may corrupt,
reorder, delay, duplicate or cut) grades what a Spark implementation, started once per case from
``--spark-cmd`` (:data:`TEMPLATE_CONTRACT`), sends on its first connection."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import msgspec

from pp1wire.apps.models import ToyLM
from pp1wire.errors import ErrorCode
from pp1wire.wire import framing, integrity
from pp1wire.wire.messages import Commit, Error, Message, MsgType, Step
from pp1wire.wire.worker_core import WorkerConfig, WorkerProtocol

VOCAB = 8
DEFAULT_REPLY_TIMEOUT = 2.0
DEFAULT_SPARK_CMD = (
    "pp1-spark --worker {worker} --vocab {vocab} --requests 1 --concurrency 1 "
    "--max-tokens 12 --depth 3 --support {q} --reply-timeout {reply_timeout} "
    "--connect-timeout 3 --json {psk_args} {stop_args}"
)

#: What a ``--spark-cmd`` TEMPLATE must do (printed by ``pp1-conformance --help``).
TEMPLATE_CONTRACT = """\
The Spark-side suite (--spark) starts TEMPLATE once per case, through the shell,
after replacing these placeholders:
  {worker}         HOST:PORT of the suite's hostile worker, to connect to
  {vocab}          8: the cases' q rows are written for a vocabulary of 8
  {support}        0 for dense q, else the sparse support K
  {q}              the same as "dense" or "sparse:K" (pp1-spark's --support)
  {reply_timeout}  seconds: the reply timeout the command must use (--reply-timeout)
  {psk_args}       "--psk-file FILE" in the authentication cases, else empty
  {stop_args}      "--stop RULE" in the stop-rule cases (S6), else empty: the
                   command must then negotiate pp1-stop-rules-v1 at HELLO and
                   send every STEP with RULE (docs/adaptive.md)
The command must connect to {worker} (one connection at a time, TLS off), and
run on slot 0 at --concurrency 1 at least one request of at least 8 new tokens
(two rounds or more: a case corrupts one round and later rounds must still run),
asking for every proposal with one fixed depth from 2 to 5 (the cases' replies
follow the STEP's depth) and with no terminal token among IDs 0..7. Further
requests on the same slot (under new generations) are allowed. When a case
cuts the connection mid-reply, the command must still finish its requests:
reconnecting (the suite serves a new connection honestly) or decoding
target-only. It must exit 0 in every case except the refused handshakes (S4,
S5), whose exit status is not graded, and finish within 20 s plus 3 reply
timeouts. Unless --no-reasons is given, its last line on stdout must be a JSON
object with "fallbacks_by_reason", "cuts_by_reason", "frames_dropped" and
"frames_rejected", each mapping lower-case code names to counts (as pp1-spark
--json prints; "cuts_by_reason" counts the rounds whose block a fault cut, the
rows before it verified: docs/adaptive.md section 7).
A command that cannot start, or exits without ever connecting, stops the suite
with one line saying so (exit status 2)."""

Build = Callable[[Step], bytes]


async def shut(
    server: asyncio.Server | None,
    tasks: Iterable[asyncio.Future[Any]] = (),
    closers: Iterable[Callable[[], object]] = (),
) -> None:
    """Stop a loopback test server: cancel its pending ``tasks``, close its connections
    (each of ``closers``), then stop listening and wait until it has."""
    for t in tasks:
        t.cancel()
    for close in closers:
        close()
    if server is not None:
        server.close()
        await server.wait_closed()


# -- the hostile worker ---------------------------------------------------------------------


class Conn(asyncio.Protocol):
    """One connection to the Spark side under test: a worker core plus the case's hooks."""

    def __init__(self, worker: HostileWorker) -> None:
        self.worker = worker
        self.core = WorkerProtocol(
            worker.config, worker.drafter, session=len(worker.conns) + 1, now=time.monotonic()
        )
        self.decoder = framing.FrameDecoder(1 << 24)
        self.inbound: list[Message] = []
        self.honest: list[bytes] = []  # every honest reply the core produced, in order
        self.transport: asyncio.Transport | None = None
        self.greeting = worker.case.greeting
        # While a hook paces a reply out, later output waits here, so frames are
        # never interleaved mid-frame (a slow worker is slow, not corrupt).
        self.held: list[bytes] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Register the connection."""
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.worker.conns.append(self)

    def data_received(self, data: bytes) -> None:
        """Record what the Spark side sent, feed the worker core, pass its output on."""
        try:
            self.inbound += [f.message for f in self.decoder.feed(data)]
        except Exception:  # a broken frame is graded from the record
            self.inbound.append(Error(code=int(ErrorCode.HEADER_INVALID), answers=0, scope=0))
        greeting, self.greeting = self.greeting, None
        if greeting is not None:
            # After the Spark side's HELLO, before ours: it is waiting for HELLO.
            self.write(greeting)
        self.core.receive_data(data, time.monotonic())
        out = b"".join(self.core.data_to_send())
        if out:
            self._forward(out)

    def _forward(self, out: bytes) -> None:
        case = self.worker.case
        plain: list[bytes] = []
        reply: list[bytes] = []
        for f in framing.FrameDecoder(1 << 26).feed(out):
            # A keyed session's frames carry their integrity tag after ``raw``.
            raw = bytes(f.raw) if f.tag is None else bytes(f.raw) + bytes(f.tag)
            edit = case.edits.get(f.type)
            if edit is not None:
                edited = edit(f.message)
                if not isinstance(edited, bytes):
                    edited = framing.encode_frame(edited, bytes(f.payload))
                raw = edited
            (reply if f.type in (MsgType.REPLY, MsgType.COMPLETION) else plain).append(raw)
        if plain:
            self.write(b"".join(plain))
        if not reply:
            return
        first = self.worker.conns[0]
        honest = b"".join(reply)
        index = len(self.honest)
        self.honest.append(honest)
        step = self.core.slots[0].fence.last_step if 0 in self.core.slots else None
        if case.reply is None or index != case.on_reply or step is None or self is not first:
            self.write(honest)
            return
        self.worker.target = (step.generation, step.round)
        result = case.reply(self, msgspec.structs.replace(step), honest)
        if result is not None:
            self.worker.tasks.append(asyncio.ensure_future(result))

    def write(self, data: bytes) -> None:
        """Send ``data`` to the Spark side (after any paced reply still going out)."""
        if self.held is not None:
            self.held.append(data)
        else:
            self.write_now(data)

    def write_now(self, data: bytes) -> None:
        """Send ``data`` at once if the connection is still open."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    async def pace(self, data: bytes, chunk: int, seconds: float) -> None:
        """Send ``data`` ``chunk`` bytes at a time, evenly over ``seconds`` from now, holding
        other output; records in :attr:`HostileWorker.gap` how long after the call the last
        byte went out (never less than ``seconds``)."""
        self.held = []
        started = time.monotonic()
        starts = range(0, len(data), chunk)
        pause = seconds / max(len(starts) - 1, 1)
        try:
            for n, i in enumerate(starts):
                due = started + (seconds if n == len(starts) - 1 else n * pause)
                while (left := due - time.monotonic()) > 0:
                    await asyncio.sleep(left)
                self.write_now(data[i : i + chunk])
                await asyncio.sleep(0)
            self.worker.gap = time.monotonic() - started
        finally:
            held, self.held = self.held, None
            self.write_now(b"".join(held))

    def abort(self) -> None:
        """Cut the connection without a goodbye."""
        if self.transport is not None:
            self.transport.abort()


ReplyHook = Callable[[Conn, Step, bytes], Awaitable[None] | None]


class Expect(Enum):
    """What a conforming Spark side does in a case."""

    DISCARD = "discard"  # never consume the proposal; decode the round target-only
    CUT = "cut"  # verify the rows before the fault as the round's block; no fallback
    DROP = "drop"  # ignore the stray frames (counted as dropped); consume the honest proposal
    REJECT = "reject"  # as DROP, counted as rejected
    REFUSE = "refuse"  # fatal ERROR with the code; no OPEN or STEP on that connection
    USE = "use"  # an honest proposal delivered oddly: consume it, no fallback


class Timing(Enum):
    """The gap a timing case claims between the STEP and its reply's last byte."""

    PAST = "past"  # 1.5 reply timeouts: the proposal must time out
    WITHIN = "within"  # under half the reply timeout: the proposal must be used


@dataclass
class SparkCase:
    """One numbered Spark-side case."""

    id: str
    title: str
    rule: str
    expect: Expect
    code: ErrorCode | None
    support: int = 0
    reply: ReplyHook | None = None
    on_reply: int = 0  # which reply of the first connection the hook gets (0 = first)
    #: Per frame type, what the worker sends instead: a message, or a whole frame's bytes.
    edits: dict[MsgType, Callable[[Any], Message | bytes]] = field(default_factory=dict)
    greeting: bytes | None = None
    worker_psk: bytes | None = None
    spark_psk: bytes | None = None
    also_dropped: ErrorCode | None = None  # a DISCARD case whose later frames must be dropped
    timing: Timing | None = None  # a case whose reply is paced against the reply timeout
    kept: int | None = None  # a CUT case: the most rows that arrive before the fault
    stop: str | None = None  # the stop rule the command runs with ({stop_args})


@dataclass(frozen=True)
class _SchemeWithoutKey(WorkerConfig):
    """A worker that skips authentication: no key, yet it takes the keyed HELLO's scheme."""

    @property
    def integrity(self) -> str:
        """The scheme a keyed Spark side names, so the worker answers HELLO at once."""
        return integrity.SCHEME


@dataclass
class HostileWorker:
    """A listening worker core (toy drafter, vocabulary 8) whose frames ``case`` may change."""

    case: SparkCase
    reply_timeout: float = DEFAULT_REPLY_TIMEOUT
    conns: list[Conn] = field(default_factory=list)
    tasks: list[asyncio.Future[None]] = field(default_factory=list)
    #: (generation, round) of the STEP whose reply the case changed.
    target: tuple[int, int] | None = None
    #: A paced reply: seconds from the STEP's arrival to its last byte.
    gap: float | None = None
    server: asyncio.Server | None = None

    def __post_init__(self) -> None:
        """Build the worker's configuration and drafter."""
        self.config = WorkerConfig(vocab_size=VOCAB, psk=self.case.worker_psk)
        if self.case.spark_psk is not None and self.case.worker_psk is None:
            self.config = _SchemeWithoutKey(vocab_size=VOCAB)
        self.drafter = ToyLM(VOCAB, 3, draft=True).logits

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen on ``host:port`` (port 0: any free one); returns the port."""
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: Conn(self), host, port)
        return int(self.server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        """Cancel pending hooks, abort every connection and stop listening."""
        await shut(self.server, self.tasks, [c.abort for c in self.conns])


# -- running and grading --------------------------------------------------------------------


@dataclass
class SparkRun:
    """What one case's Spark process did."""

    returncode: int | None
    stderr: str
    summary: dict[str, Any] | None


class CaseFailedError(Exception):
    """The Spark side under test broke the case's rule."""


class CommandFailedError(CaseFailedError):
    """The Spark command did not run the case at all (it never connected)."""


@dataclass(frozen=True)
class SparkResult:
    """One case's verdict: ``problem`` is None when the Spark side passed."""

    problem: str | None
    command_failed: bool = False


async def _spark(cmd: str, timeout: float) -> SparkRun:
    proc = await asyncio.create_subprocess_shell(
        cmd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        out, err = await proc.communicate()
    summary = None
    lines = [ln for ln in out.decode(errors="replace").splitlines() if ln.strip()]
    if lines:
        with contextlib.suppress(ValueError):
            loaded = json.loads(lines[-1])
            summary = loaded if isinstance(loaded, dict) else None
    return SparkRun(proc.returncode, err.decode(errors="replace"), summary)


def _count(summary: dict[str, Any], key: str, code: ErrorCode) -> int:
    table = summary.get(key) or {}
    return int(table.get(code.name.lower(), 0)) if isinstance(table, dict) else 0


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "(nothing on stderr)"


def _check_timing(case: SparkCase, worker: HostileWorker) -> None:
    """A timing case grades only the gap it claims: CaseFailedError if it did not make it."""
    if case.timing is None:
        return
    timeout, gap = worker.reply_timeout, worker.gap
    if gap is None:
        raise CaseFailedError("(suite) the paced reply never finished")
    if case.timing is Timing.PAST and gap < 1.5 * timeout:
        raise CaseFailedError(
            f"(suite) the reply's last byte came {gap:.2f} s after the STEP, "
            f"not 1.5 x the {timeout:g} s reply timeout"
        )
    if case.timing is Timing.WITHIN and gap >= 0.5 * timeout:
        raise CaseFailedError(
            f"(suite) the reply took {gap:.2f} s, not under half the {timeout:g} s reply "
            "timeout: a loaded machine; nothing graded"
        )


#: Where the command's summary must count the case's code, by what the case expects.
_COUNTED = {
    Expect.CUT: "cuts_by_reason",
    Expect.DROP: "frames_dropped",
    Expect.REJECT: "frames_rejected",
}


def grade(case: SparkCase, worker: HostileWorker, run: SparkRun, reasons: bool) -> None:
    """Check what the Spark side did against the case's rule.

    Raises:
        CommandFailedError: the command exited (or was stopped) without connecting.
        CaseFailedError: with one line saying what broke the rule.
    """
    if not worker.conns:
        if run.returncode is None or run.returncode < 0:
            raise CommandFailedError("the Spark command was stopped before it connected")
        raise CommandFailedError(
            f"the Spark command exited with status {run.returncode} without connecting"
            f" to the suite: {_last_line(run.stderr)}"
        )
    first = worker.conns[0].inbound
    kinds = [type(m).__name__ for m in first]
    if case.expect is Expect.REFUSE:
        if any(k in ("Open", "Step", "Commit") for k in kinds):
            raise CaseFailedError(f"the Spark side went on past a refused handshake: {kinds}")
        codes = [ErrorCode(m.code).name for m in first if isinstance(m, Error)]
        assert case.code is not None
        if case.code.name not in codes:
            raise CaseFailedError(f"expected a fatal ERROR {case.code.name}, got {codes or 'none'}")
        return
    if run.returncode != 0:
        raise CaseFailedError(f"exit status {run.returncode}: {run.stderr.strip()[-300:]}")
    target = worker.target
    if target is None:
        raise CaseFailedError("the Spark side never sent the STEP the case answers")
    _check_timing(case, worker)
    generation, round_id = target
    commits = [m for m in first if isinstance(m, Commit) and m.generation == generation]
    used = [c for c in commits if c.round == round_id]
    if case.expect is Expect.DISCARD:
        if used:
            raise CaseFailedError(
                f"round {round_id} of generation {generation} was committed "
                f"(accepted={used[0].accepted}) from a bad proposal"
            )
        later = [c for c in commits if c.round > round_id]
        if later and later[0].accepted != 0:
            raise CaseFailedError(f"the fallback COMMIT has accepted={later[0].accepted}, not 0")
    elif case.expect is Expect.CUT and case.code is ErrorCode.CONNECTION_LOST:
        if used:  # the connection is gone: the round is committed locally, then reopened
            raise CaseFailedError(f"a COMMIT of round {round_id} after the connection closed")
    elif not used:
        what = "the rows before the fault" if case.expect is Expect.CUT else "the honest proposal"
        raise CaseFailedError(f"{what} of round {round_id} (generation {generation}) was not used")
    elif case.expect is Expect.CUT and case.kept is not None and used[0].accepted > case.kept:
        raise CaseFailedError(
            f"round {round_id} committed {used[0].accepted} drafts; at most {case.kept} "
            "arrived before the fault"
        )
    if not reasons:
        return
    if run.summary is None:
        raise CaseFailedError("no JSON summary on the last stdout line (or pass --no-reasons)")
    fallbacks = run.summary.get("fallbacks_by_reason") or {}
    if case.expect is Expect.DISCARD:
        assert case.code is not None
        if _count(run.summary, "fallbacks_by_reason", case.code) < 1:
            raise CaseFailedError(f"fallback reasons {fallbacks}, expected {case.code.name}")
        if case.also_dropped and _count(run.summary, "frames_dropped", case.also_dropped) < 1:
            raise CaseFailedError(f"no frame dropped as {case.also_dropped.name}")
        return
    if fallbacks:
        raise CaseFailedError(f"fell back ({fallbacks}) where nothing was wrong with the proposal")
    key = _COUNTED.get(case.expect)
    if key is not None:
        assert case.code is not None
        if _count(run.summary, key, case.code) < 1:
            raise CaseFailedError(f"{key} {run.summary.get(key)}, expected {case.code.name}")


async def run_spark_case(
    case: SparkCase,
    template: str,
    *,
    reasons: bool = True,
    reply_timeout: float = DEFAULT_REPLY_TIMEOUT,
    host: str = "127.0.0.1",
    port: int = 0,
) -> SparkResult:
    """Run one case: what the Spark side did wrong, if anything. The hostile worker listens
    on ``host:port`` (where a Spark side with a fixed worker address expects it); the
    command is stopped after 20 s plus three reply timeouts.

    Raises:
        OSError: the address cannot be listened on.
        KeyError: the template names a placeholder the suite does not fill.
    """
    worker = HostileWorker(case, reply_timeout)
    port = await worker.start(host, port)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            psk_args = ""
            if case.spark_psk is not None:
                key = os.path.join(tmp, "psk")
                with open(key, "wb") as f:
                    f.write(case.spark_psk)
                psk_args = f"--psk-file {shlex.quote(key)}"
            cmd = template.format(
                worker=f"{host}:{port}",
                vocab=VOCAB,
                support=case.support,
                q=f"sparse:{case.support}" if case.support else "dense",
                reply_timeout=f"{reply_timeout:g}",
                psk_args=psk_args,
                stop_args=f"--stop {case.stop}" if case.stop else "",
            )
            run = await _spark(cmd, 20.0 + 3 * reply_timeout)
            grade(case, worker, run, reasons)
    except CommandFailedError as exc:
        return SparkResult(str(exc), command_failed=True)
    except CaseFailedError as exc:
        return SparkResult(str(exc))
    finally:
        await worker.stop()
    return SparkResult(None)
