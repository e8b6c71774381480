"""Running the cases: grades, reports and the ``pp1-conformance`` command line."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import secrets
import ssl as ssl_module
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence

from pp1wire.apps import settings
from pp1wire.apps.settings import SettingsError, check_writable, host_port, linked_address, parse
from pp1wire.errors import ErrorCode
from pp1wire.testing.conformance import spark_cases, spark_side
from pp1wire.testing.conformance.core import (
    CASES,
    Case,
    CaseFailed,
    Grade,
    NonStrict,
    NonStrictSkip,
    Outcome,
    Peer,
    Settings,
)
from pp1wire.wire.messages import Challenge, Error


async def run_case(c: Case, s: Settings) -> Outcome:
    """Run one case with an overall time limit, as a group session of its own on a
    sharded worker group (a fresh nonce: a worker rank keeps a nonce whose link
    closed out of use while its session could still be matched, §6.7)."""
    if s.shards > 1:
        s = dataclasses.replace(s, group=secrets.token_bytes(len(s.group)))
    try:
        await asyncio.wait_for(c.fn(s), timeout=max(s.handshake_wait, s.match_wait) + 20)
    except NonStrictSkip as exc:
        return Outcome(Grade.INFO, f"skipped: {exc}")
    except NonStrict as exc:
        return Outcome(Grade.INFO if c.informational else Grade.NON_STRICT, str(exc))
    except CaseFailed as exc:
        return Outcome(Grade.INFO if c.informational else Grade.FAIL, str(exc))
    except TimeoutError:
        return Outcome(Grade.INFO if c.informational else Grade.FAIL, "case timed out")
    except (ConnectionError, OSError) as exc:
        return Outcome(Grade.INFO if c.informational else Grade.FAIL, f"connection: {exc!r}")
    except Exception as exc:  # a broken worker must not crash the suite
        return Outcome(Grade.INFO if c.informational else Grade.FAIL, f"unexpected: {exc!r}")
    return Outcome(Grade.INFO if c.informational else Grade.PASS)


def select(ids: Sequence[str] | None) -> list[Case]:
    """The cases to run (all, or those whose ID equals or starts a given one)."""
    if not ids:
        return list(CASES)
    return [c for c in CASES if any(c.id == i or c.id.startswith(i + ".") for i in ids)]


def junit(results: list[tuple[Case, Outcome, float]], path: str, strict: bool) -> None:
    """Write a JUnit XML report."""
    suite = ET.Element("testsuite", name="pp1-conformance", tests=str(len(results)))
    failures = 0
    for c, o, secs in results:
        tc = ET.SubElement(
            suite, "testcase", classname=c.category, name=f"{c.id} {c.title}", time=f"{secs:.3f}"
        )
        if o.grade is Grade.FAIL or (strict and o.grade is Grade.NON_STRICT):
            failures += 1
            ET.SubElement(tc, "failure", message=o.detail).text = c.rule
        elif o.grade is Grade.INFO:
            ET.SubElement(tc, "skipped", message=o.detail or "informational")
    suite.set("failures", str(failures))
    ET.ElementTree(suite).write(path, encoding="utf-8", xml_declaration=True)


# What to pass when the worker refuses the suite's HELLO for a setting of ours.
_FLAG_FOR = {
    ErrorCode.VOCAB_SIZE_MISMATCH: "pass the worker's vocabulary size with --vocab",
    ErrorCode.VOCAB_HASH_MISMATCH: "pass the worker's vocabulary hash with --vocab-hash",
    ErrorCode.IDENTITY_MISMATCH: "pass the worker's target identity with --target-identity",
    ErrorCode.AUTH_REQUIRED: "the worker wants a key: pass --psk-file",
    ErrorCode.AUTH_FAILED: "the key was refused: check --psk-file",
    ErrorCode.LIMIT_EXCEEDED: "the worker's limits are below what the suite asks for "
    "(2 slots, depth 5, sparse support 8, and --vocab entries per row)",
}


async def probe(s: Settings) -> str | None:
    """One handshake before the cases: None if it works, else one line saying what to change."""
    try:
        peer = await Peer(s).connect()
    except OSError as exc:
        return f"cannot connect ({exc})"
    async with peer:
        try:
            await peer.handshake()
        except CaseFailed:
            err = peer.pending[0].message if peer.pending else None
            if isinstance(err, Challenge):
                return _FLAG_FOR[ErrorCode.AUTH_REQUIRED]
            code = None
            if isinstance(err, Error):
                with contextlib.suppress(ValueError):  # a code this version does not know
                    code = ErrorCode(err.code)
            if code is None:
                return "no HELLO came back (is it a pp1 worker, and is TLS needed: --tls-ca?)"
            hint = _FLAG_FOR.get(code, "see docs/protocol.md section 9 for the code")
            return f"the worker refused our HELLO with {code.name}: {hint}"
    return None


#: The help of the flags that take a value in seconds or a count.
_HELP: dict[str, str] = {
    "--timeout": "how long to wait for a reaction",
    "--handshake-wait": "how long the handshake-timeout case waits",
    "--match-wait": "longer than a sharded worker group's match timeout: how long the 6.7 "
    "cases wait for an unmatched STEP's answer",
    "--idle-wait": "run the idle-timeout case, waiting this long (more than the worker's idle "
    "timeout; default: unset, the case is skipped)",
    "--reply-timeout": "Spark-side suite: the reply timeout the command uses ({reply_timeout}); "
    "the timing cases pace their replies against it",
    "--jobs": "Spark-side suite: run up to N cases at once (each its own listener and "
    "command); the timing cases still run alone, after the others",
}


def build_parser() -> argparse.ArgumentParser:
    """The ``pp1-conformance`` argument parser."""
    p = settings.parser("pp1-conformance", __doc__)
    p.epilog = spark_side.TEMPLATE_CONTRACT
    settings.add_connect_flags(p)
    p.add_argument("--strict", action="store_true", help="non-strict reactions fail")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--junit", metavar="FILE", help="write a JUnit XML report (default: none)")
    p.add_argument(
        "--case",
        nargs="*",
        default=None,
        metavar="ID",
        help="run only these cases, or the cases under these section numbers (default: all)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object per case")
    settings.add_link_flags(p)
    add = settings.adder(p, _HELP)
    add("--timeout", settings.seconds, 3.0, "SECONDS")
    add("--handshake-wait", settings.seconds, 12.0, "SECONDS")
    add("--match-wait", settings.seconds, 8.0, "SECONDS")
    add("--idle-wait", settings.seconds, None, "SECONDS")
    p.add_argument(
        "--spark",
        action="store_true",
        help="run the Spark-side suite: act as a hostile worker against --spark-cmd",
    )
    p.add_argument(
        "--spark-cmd",
        default=spark_side.DEFAULT_SPARK_CMD,
        metavar="TEMPLATE",
        help="command that starts the Spark side under test, once per case: "
        "placeholders {worker} {vocab} {support} {q} {reply_timeout} {psk_args} "
        "{stop_args}; what "
        "it must do is below (default: pp1-spark)",
    )
    add("--reply-timeout", settings.seconds, spark_side.DEFAULT_REPLY_TIMEOUT, "SECONDS")
    add("--jobs", settings.positive, 1, "N")
    p.add_argument(
        "--listen",
        default="127.0.0.1:0",
        metavar="HOST:PORT",
        help="Spark-side suite: where the hostile worker listens (port 0: a free one)",
    )
    p.add_argument(
        "--no-reasons",
        action="store_true",
        help="Spark-side suite: do not read fallback and drop reasons from the command's "
        "last stdout line",
    )
    settings.add_config(p)
    return p


#: What --spark-cmd's placeholders are filled with when the template is checked.
_PLACEHOLDERS = {
    "worker": "127.0.0.1:1",
    "vocab": 8,
    "support": 0,
    "q": "dense",
    "reply_timeout": 2.0,
    "psk_args": "",
    "stop_args": "",
}


def check_spark_cmd(template: str) -> None:
    """Refuse a ``--spark-cmd`` that names a placeholder there is no value for.

    Raises:
        SettingsError: for an unknown placeholder or a malformed template.
    """
    try:
        cmd = template.format(**_PLACEHOLDERS)
    except (KeyError, IndexError) as exc:
        known = " ".join("{" + k + "}" for k in _PLACEHOLDERS)
        raise SettingsError(
            f"--spark-cmd: unknown placeholder {exc} (the placeholders are {known}; write a "
            "literal brace as {{ or }})"
        ) from None
    except ValueError as exc:
        raise SettingsError(f"--spark-cmd: {exc}") from None
    if not cmd.strip():
        raise SettingsError("--spark-cmd is empty")


_SparkRow = tuple[spark_side.SparkCase, spark_side.SparkResult, float]


def spark_main(args: argparse.Namespace) -> int:
    """The Spark-side suite: list or run its cases against ``args.spark_cmd``."""
    cases = [
        c
        for c in spark_cases.SPARK_CASES
        if not args.case or any(c.id == i or c.id.startswith(i + ".") for i in args.case)
    ]
    if args.list:
        for c in cases:
            print(f"{c.id:8s} [{c.expect.value}] {c.title}\n         rule: {c.rule}")
        print(f"{len(cases)} cases")
        return 0
    if not cases:
        print("pp1-conformance: no case matches", file=sys.stderr)
        return 2
    try:
        check_spark_cmd(args.spark_cmd)
        host, port = host_port(args.listen)
    except SettingsError as exc:
        print(f"pp1-conformance: {exc}", file=sys.stderr)
        return 2
    if args.jobs > 1 and port != 0:
        # Each case listens on its own port: a fixed one can serve one case at a time.
        print("pp1-conformance: --jobs above 1 needs --listen with port 0", file=sys.stderr)
        return 2

    async def one(c: spark_side.SparkCase) -> _SparkRow:
        started = time.perf_counter()
        result = await spark_side.run_spark_case(
            c,
            args.spark_cmd,
            reasons=not args.no_reasons,
            reply_timeout=args.reply_timeout,
            host=host,
            port=port,
        )
        return c, result, time.perf_counter() - started

    async def run() -> list[_SparkRow]:
        # The first case alone: a command that cannot run stops the suite at once.
        out = [await one(cases[0])]
        if out[0][1].command_failed:
            return out
        gate = asyncio.Semaphore(args.jobs)

        async def gated(c: spark_side.SparkCase) -> _SparkRow:
            async with gate:
                return await one(c)

        rest = cases[1:]
        out += await asyncio.gather(*(gated(c) for c in rest if c.timing is None))
        # Timing cases alone: no other case's processes compete with their pacing.
        out += [await one(c) for c in rest if c.timing is not None]
        order = {c.id: n for n, c in enumerate(cases)}
        return sorted(out, key=lambda r: order[r[0].id])

    try:
        results = asyncio.run(run())
    except OSError as exc:
        print(f"pp1-conformance: cannot listen on {args.listen}: {exc}", file=sys.stderr)
        return 2
    first = results[0][1]
    if first.command_failed:
        print(f"pp1-conformance: {first.problem} (command: {args.spark_cmd})", file=sys.stderr)
        return 2
    failed = 0
    for c, result, secs in results:
        problem = result.problem
        failed += problem is not None
        if args.json:
            row = {"id": c.id, "title": c.title, "grade": "fail" if problem else "pass"}
            print(json.dumps(row | {"detail": problem or "", "seconds": secs}))
        else:
            line = f"{'FAIL' if problem else 'PASS'}  {c.id:8s} {c.title}"
            print(line + (f"  -- {problem}" if problem else ""))
    print(f"{len(results)} Spark-side cases: {len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


async def run_all(cases: list[Case], s: Settings) -> list[tuple[Case, Outcome, float]]:
    """Run cases one after another."""
    out = []
    for c in cases:
        started = time.perf_counter()
        outcome = await run_case(c, s)
        out.append((c, outcome, time.perf_counter() - started))
    return out


_MARK = {Grade.PASS: "PASS", Grade.NON_STRICT: "NSTR", Grade.FAIL: "FAIL", Grade.INFO: "INFO"}


def main(argv: Sequence[str] | None = None) -> int:
    """``pp1-conformance`` entry point; exit 0 only if every non-informational case passes."""
    parser = build_parser()
    try:
        args = parse(parser, argv)
        if args.junit:  # before any connection: a run never ends unable to report
            check_writable("--junit", args.junit)
        if args.spark:
            return spark_main(args)
        cases = select(args.case)
        if args.list:
            for c in cases:
                tag = " (informational)" if c.informational else ""
                print(f"{c.id:8s} [{c.category}] {c.title}{tag}\n         rule: {c.rule}")
            print(f"{len(cases)} cases")
            return 0
        host, port = linked_address(args.worker, args.vocab_shards)
        from pp1wire.apps.keys import key_id_flag, read_psk  # noqa: PLC0415

        ctx = ssl_module.create_default_context(cafile=args.tls_ca) if args.tls_ca else None
        settings = Settings(
            host=host,
            port=port,
            vocab=args.vocab,
            row_entries=args.row_entries,
            vocab_hash=args.vocab_hash,
            target_identity=args.target_identity,
            psk=read_psk(args.psk_file, key_id_flag(args.key_id)),
            key_id=key_id_flag(args.key_id),
            ssl=ctx,
            timeout=args.timeout,
            handshake_wait=args.handshake_wait,
            match_wait=args.match_wait,
            idle_wait=args.idle_wait,
            shards=args.vocab_shards,
        )
    except SettingsError as exc:
        print(f"pp1-conformance: {exc}", file=sys.stderr)
        return 2
    if not cases:
        print("pp1-conformance: no case matches", file=sys.stderr)
        return 2
    problem = asyncio.run(probe(settings))
    if problem is not None:
        print(f"pp1-conformance: {args.worker}: {problem}", file=sys.stderr)
        return 2
    results = asyncio.run(run_all(cases, settings))
    counts: dict[str, int] = {g.value: 0 for g in Grade}
    for c, o, secs in results:
        counts[o.grade.value] += 1
        if args.json:
            row = {"id": c.id, "category": c.category, "title": c.title, "grade": o.grade.value}
            print(json.dumps(row | {"detail": o.detail, "seconds": secs}))
        else:
            line = f"{_MARK[o.grade]}  {c.id:8s} {c.title}"
            print(line + (f"  -- {o.detail}" if o.detail else ""))
    if args.junit:
        junit(results, args.junit, args.strict)
    failed = counts["fail"] + (counts["non-strict"] if args.strict else 0)
    print(
        f"{len(results)} cases: {counts['pass']} passed, {counts['non-strict']} non-strict, "
        f"{counts['fail']} failed, {counts['informational']} informational"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
