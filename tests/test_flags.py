"""Every flag of the worker, demo and conformance commands: documented, range-checked
where it is read, refused in one line (exit 2) before anything starts.

The refusals run in one child process, each command's ``main`` in turn (a
process per case would cost a second each); a case that got past its checks
would start serving, which the child's alarm turns into a failure naming it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pp1wire.apps import settings, worker
from pp1wire.apps.launch import worker_process
from pp1wire.apps.settings import SettingsError

from . import cli

ROOT = Path(__file__).resolve().parents[1]

# -- help ------------------------------------------------------------------------------------

PARSERS = [
    pytest.param("pp1wire.apps.worker", id="pp1-worker"),
    pytest.param("pp1wire.apps.demo", id="pp1-demo"),
    pytest.param("pp1wire.testing.conformance.runner", id="pp1-conformance"),
    pytest.param("pp1wire.apps.spark", id="pp1-spark"),
]


def _flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


@pytest.mark.parametrize("module", PARSERS)
def test_every_flag_has_help_a_unit_and_its_default(module):
    parser = importlib.import_module(module).build_parser()
    formatter = settings.HelpFormatter(parser.prog)
    problems = []
    for action in _flags(parser):
        flag = action.option_strings[-1]
        text = formatter._get_help_string(action) or ""
        if not (action.help or "").strip():
            problems.append(f"{flag}: no help text")
        if action.nargs != 0 and action.metavar is None:
            problems.append(f"{flag}: no metavar naming its unit (SECONDS, PORT, N, ...)")
        if action.type is settings.seconds and action.metavar != "SECONDS":
            problems.append(f"{flag}: a duration whose metavar is not SECONDS")
        default = action.default
        if default is None and action.nargs != 0 and "default" not in text:
            problems.append(f"{flag}: unset by default, and the help does not say what that means")
        if default is not None and default is not False and "default" not in text:
            problems.append(f"{flag}: the help does not give the default {default!r}")
    assert not problems, "\n".join(problems)


def test_help_shows_the_defaults_when_the_settings_parser_runs_it(capsys):
    from pp1wire.apps.worker import build_parser

    with pytest.raises(SystemExit) as done:
        settings.parse(build_parser(), ["--help"], environ={})
    assert done.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "(default: 7070)" in shown
    assert "(default: 10.0)" in shown  # --slot-idle-timeout


# -- shared checks -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("127.0.0.1:7070", ("127.0.0.1", 7070)),
        ("[::1]:7070", ("::1", 7070)),
        ("[fe80::1%eth0]:1", ("fe80::1%eth0", 1)),
        ("worker.example:0", ("worker.example", 0)),
    ],
)
def test_host_port_parses(text, parsed):
    assert settings.host_port(text) == parsed


@pytest.mark.parametrize(
    "text", ["::1", "[::1]", "[::1]7070", "[]:1", ":7070", "host", "host:", "h:65536", "h:٣"]
)
def test_host_port_refuses_what_is_not_host_colon_port(text):
    with pytest.raises(SettingsError, match="is not HOST:PORT"):
        settings.host_port(text)


def _parse_toml(tmp_path, module: str, text: str):
    path = tmp_path / "c.toml"
    path.write_text(text)
    parser = importlib.import_module(module).build_parser()
    return settings.parse(parser, ["--config", str(path)], environ={})


@pytest.mark.parametrize(
    ("module", "toml", "says"),
    [
        ("pp1wire.apps.worker", 'port = "7070"', "port: '7070' is not an integer"),
        ("pp1wire.apps.worker", "port = 7070.0", "port: 7070.0 is not an integer"),
        ("pp1wire.apps.worker", "insecure = 1", "insecure: 1 is not a boolean"),
        ("pp1wire.apps.worker", "host = 1", "host: 1 is not a string"),
        ("pp1wire.apps.worker", "idle_timeout = true", "idle_timeout: True is not a number"),
        ("pp1wire.apps.worker", 'log_level = "loud"', "'loud' is not one of"),
        ("pp1wire.testing.conformance.runner", 'case = "4.1"', "'4.1' is not a list of strings"),
    ],
)
def test_a_toml_value_of_the_wrong_type_is_refused(tmp_path, module, toml, says):
    with pytest.raises(SettingsError, match=says.replace("(", r"\(").replace(")", r"\)")):
        _parse_toml(tmp_path, module, toml)


def test_toml_values_of_the_right_type_are_taken(tmp_path):
    args = _parse_toml(
        tmp_path,
        "pp1wire.apps.worker",
        "port = 7071\nidle_timeout = 30\ninsecure = true\nhost = '::1'\n",
    )
    assert (args.port, args.idle_timeout, args.insecure, args.host) == (7071, 30, True, "::1")
    cases = _parse_toml(tmp_path, "pp1wire.testing.conformance.runner", 'case = ["4.1", "7"]')
    assert cases.case == ["4.1", "7"]


def test_a_list_flag_from_the_environment_is_split():
    from pp1wire.testing.conformance.runner import build_parser

    args = settings.parse(build_parser(), [], environ={"PP1_CASE": "4.1 7.2"})
    assert args.case == ["4.1", "7.2"]


def test_plugins_must_be_callables_that_make_callables():
    with pytest.raises(SettingsError, match="is a str, not a callable"):
        settings.make_plugin("os:sep")
    with pytest.raises(SettingsError, match="made a int, not a callable"):
        settings.make_plugin("builtins:int")
    with pytest.raises(SettingsError, match="the factory raised TypeError"):
        settings.make_plugin("builtins:abs")
    assert settings.make_plugin("pp1wire.apps.models:drafter_factory", vocab_size=8, seed=0)


def test_a_bracketed_ipv6_listen_address_is_the_address():
    # Before: --host [::1] passed the exposure check and failed to bind.
    parser = worker.build_parser()
    args = settings.parse(parser, ["--host", "[::1]", "--metrics-host", "[::1]"], environ={})
    assert (args.host, args.metrics_host) == ("::1", "::1")
    assert settings.address_text("::1", 7070) == "[::1]:7070"
    assert settings.host_port(settings.address_text("::1", 7070)) == ("::1", 7070)
    assert settings.address_text("127.0.0.1", 7070) == "127.0.0.1:7070"


def _ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_a_worker_listens_on_a_bracketed_ipv6_address_and_says_where():
    with worker_process("--host", "[::1]", "--metrics-port", "0", "--metrics-host", "[::1]") as w:
        assert w.address.startswith("[::1]:"), w.address
        assert w.metrics is not None
        assert w.metrics.startswith("[::1]:"), w.metrics
        done = cli.module("pp1wire.apps.worker", "--check", w.address, "--vocab", "16")
    assert done.returncode == 0, done.stderr


def test_exposed_addresses():
    assert not any(map(settings.exposed, ["127.0.0.1", "127.0.0.5", "::1", "[::1]", "localhost"]))
    assert all(map(settings.exposed, ["0.0.0.0", "::", "", "10.0.0.1", "worker.example"]))


# -- command lines, in one child process ---------------------------------------------------------

WORKER = "pp1wire.apps.worker"
DEMO = "pp1wire.apps.demo"
CONFORMANCE = "pp1wire.testing.conformance.runner"

# module, arguments, what the one line must say
CASES = [
    (WORKER, ["--host", "0.0.0.0"], "--host 0.0.0.0 without --psk-file"),
    (WORKER, ["--host", "::", "--port", "0"], "--host :: without --psk-file"),
    (WORKER, ["--tp", "2", "--vocab-shards", "2", "--port", "65535"], "would listen on port 65536"),
    # Before: protected mode covered --host only; /metrics was served on 0.0.0.0.
    (
        WORKER,
        ["--metrics-host", "0.0.0.0", "--metrics-port", "0"],
        "--metrics-host 0.0.0.0 without --metrics-token-file",
    ),
    (WORKER, ["--host", "[::1", "--port", "0"], "'[::1' is not a listen address (brackets"),
    (WORKER, ["--host", "[localhost]"], "'[localhost]' is not a listen address (brackets hold"),
    (WORKER, ["--metrics-host", "[10.0.0.1]"], "'[10.0.0.1]' is not a listen address"),
    (WORKER, ["--tp", "100000"], "--tp: 100000 is not a number of ranks in 1..16"),
    (WORKER, ["--group-timeout", "1e300"], "--group-timeout: 1e+300 is not a duration"),
    (WORKER, ["--idle-timeout", "inf"], "--idle-timeout: 'inf' is not a finite number"),
    (WORKER, ["--vocab", "99999999999"], "--vocab: 99999999999 is not a vocabulary size"),
    (WORKER, ["--row-entries", "99999999999"], "--row-entries: 99999999999 is not a row length"),
    (WORKER, ["--vocab", "4", "--vocab-shards", "5"], "--vocab-shards must not exceed --vocab"),
    (WORKER, ["--drafter", "os:sep"], "plugin 'os:sep' is a str, not a callable"),
    (WORKER, ["--drafter", "builtins:abs"], "the factory raised TypeError"),
    (WORKER, ["--drafter", "nosuchmodule:f"], "plugin 'nosuchmodule:f': No module named"),
    (WORKER, ["--max-slots", "70000"], "--max-slots: 70000 is not an integer in 1..65535"),
    (WORKER, ["--max-depth", "6"], "--max-depth: 6 is not a depth in 1..5"),
    (WORKER, ["--max-prefix", "99999999999"], "--max-prefix: 99999999999 is not a prefix"),
    (WORKER, ["--max-support", "-1"], "--max-support: -1 is not a support"),
    (WORKER, ["--draw-threads", "100000"], "--draw-threads: 100000 is not a number of threads"),
    (WORKER, ["--max-draw-batch", "0"], "--max-draw-batch: 0 is not a number of STEPs in 1..4096"),
    (WORKER, ["--max-per-address", "0"], "--max-per-address: 0 is not a number of connections"),
    (WORKER, ["--max-draw-rate", "0"], "--max-draw-rate: 0.0 is not a rate above 0"),
    (WORKER, ["--max-draw-rate", "nan"], "--max-draw-rate: 'nan' is not a finite number"),
    (WORKER, ["--draw-burst", "4"], "--draw-burst needs --max-draw-rate"),
    (WORKER, ["--slot-idle-timeout", "0"], "--slot-idle-timeout: 0.0 is not a duration"),
    (WORKER, ["--draft-identity", "x" * 200], "--draft-identity: 'xxxxxxxxxxxxxxxxxxxx'..."),
    (WORKER, ["--tls-key", "k.pem"], "--tls-key needs --tls-cert"),
    (WORKER, ["--log-level", "loud"], "argument --log-level: invalid choice: 'loud'"),
    (WORKER, ["--check", "::1"], "'::1' is not HOST:PORT (an IPv6 address goes in brackets"),
    (DEMO, ["--requests", "-1"], "--requests: -1 is not an integer >= 1"),
    (DEMO, ["--max-tokens", "0"], "--max-tokens: 0 is not an integer >= 1"),
    (DEMO, ["--vocab", "1"], "--vocab: 1 is not a vocabulary size"),
    (DEMO, ["--depth", "9"], "--depth: 9 is not a depth in 1..5"),
    (DEMO, ["--target-ms", "-1"], "--target-ms: -1.0 is not a duration in 0..60000 ms"),
    (DEMO, ["--temperature", "-2"], "--temperature: -2.0 is not a temperature"),
    (DEMO, ["--support", "sparse:x", "--in-process"], "--support 'sparse:x' is not dense"),
    (DEMO, ["--support", "sparse:\u00b2", "--in-process"], "--support 'sparse:\u00b2' is not"),
    (DEMO, ["--support", "sparse:0", "--in-process"], "--support 'sparse:0' is not dense"),
    (DEMO, ["--support", "sparse:99", "--vocab", "8", "--in-process"], "K in 1..8"),
    (DEMO, ["--support", "dense"], "--support applies only with --in-process"),
    (
        CONFORMANCE,
        ["--spark", "--spark-cmd", "{nosuch}"],
        "--spark-cmd: unknown placeholder 'nosuch'",
    ),
    (CONFORMANCE, ["--spark", "--listen", "::1"], "'::1' is not HOST:PORT"),
    (CONFORMANCE, ["--worker", "::1"], "'::1' is not HOST:PORT"),
    (CONFORMANCE, ["--vocab", "-3"], "--vocab: -3 is not a vocabulary size"),
    (CONFORMANCE, ["--timeout", "1e300"], "--timeout: 1e+300 is not a duration"),
    (CONFORMANCE, ["--vocab-shards", "0"], "--vocab-shards: 0 is not a number of ranks"),
    # Before: checked only once the cases had run against a worker.
    (CONFORMANCE, ["--junit", "/"], "--junit /: Is a directory"),
    (CONFORMANCE, ["--junit", "/no/such/dir/r.xml"], "--junit /no/such/dir/r.xml: No such file"),
    (
        CONFORMANCE,
        ["--worker", "127.0.0.1:65535", "--vocab-shards", "2"],
        "rank 1 would connect to port 65536, above 65535",
    ),
]

PROG = {WORKER: "pp1-worker", DEMO: "pp1-demo", CONFORMANCE: "pp1-conformance"}


def _child() -> None:
    """Run each case read from stdin; print one JSON line per case (run in a child)."""
    import contextlib
    import io
    import signal

    class StartedError(Exception):
        pass

    def alarm(*_: object) -> None:
        raise StartedError

    signal.signal(signal.SIGALRM, alarm)
    for module, args in json.loads(sys.stdin.read()):
        out, err = io.StringIO(), io.StringIO()
        code: object = None
        signal.alarm(20)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = importlib.import_module(module).main(args)
        except StartedError:
            code = "started: nothing refused it within 20 s"
        except SystemExit as exc:
            code = exc.code
        except BaseException as exc:
            code = f"raised {exc!r}"
        finally:
            signal.alarm(0)
        print(json.dumps([code, out.getvalue(), err.getvalue()]), flush=True)


@pytest.fixture(scope="module")
def refusals() -> list[tuple[object, str, str]]:
    done = subprocess.run(
        [sys.executable, "-c", "from tests.test_flags import _child; _child()"],
        input=json.dumps([[m, a] for m, a, _ in CASES]),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60 + 20 * len(CASES),
        check=False,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
    )
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(rows) == len(CASES), done.stderr[-3000:]
    return rows


@pytest.mark.parametrize("index", range(len(CASES)), ids=[" ".join(c[1])[:60] for c in CASES])
def test_a_bad_flag_is_one_line_exit_2_with_nothing_started(refusals, index):
    module, _, says = CASES[index]
    code, out, err = refusals[index]
    lines = err.strip().splitlines()
    assert code == 2, (code, err)
    assert out == ""  # nothing listened, nothing ran
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith(f"{PROG[module]}: "), lines[0]
    assert says in lines[0], lines[0]


def test_an_exposed_address_is_served_with_a_key_or_when_told_insecure():
    from pp1wire.apps.worker import check_exposure
    from pp1wire.wire.worker_core import WorkerConfig

    def args(host: str, insecure: bool, **kw: object) -> argparse.Namespace:
        return argparse.Namespace(host=host, insecure=insecure, key_id="", check=None, **kw)

    plain, keyed = WorkerConfig(vocab_size=8), WorkerConfig(vocab_size=8, psk=b"k" * 16)
    check_exposure(args("0.0.0.0", True), plain)
    check_exposure(args("0.0.0.0", False), keyed)
    check_exposure(args("127.0.0.1", False), plain)
    with pytest.raises(SettingsError, match="pass --insecure"):
        check_exposure(args("0.0.0.0", False), plain)
    # A key table is a key: the protocol listener is protected by it.
    table = WorkerConfig(vocab_size=8, keys=(("client", b"c" * 16), ("other", b"o" * 16)))
    check_exposure(args("0.0.0.0", False), table)


def test_a_metrics_listener_beyond_loopback_needs_its_own_token_with_or_without_a_key():
    # Before: with --psk-file, a metrics listener on 0.0.0.0 was let through, and
    # served /metrics to anyone (HTTP 200, no credential): the key protects the
    # protocol listener, not the endpoint. Now it needs --metrics-token-file.
    from pp1wire.apps.worker import check_exposure
    from pp1wire.wire.worker_core import WorkerConfig

    keyed = WorkerConfig(vocab_size=8, psk=b"k" * 16)

    def args(token: str | None) -> argparse.Namespace:
        return argparse.Namespace(
            host="0.0.0.0",
            insecure=False,
            key_id="",
            check=None,
            metrics_port=0,
            metrics_host="0.0.0.0",
            metrics_token_file=token,
        )

    says = r"--metrics-host 0\.0\.0\.0 without --metrics-token-file"
    with pytest.raises(SettingsError, match=says):
        check_exposure(args(None), keyed)
    check_exposure(args("token-file"), keyed)


def test_the_health_check_hellos_with_the_workers_row_entries():
    # Before: --check left row_entries at --vocab, so a padded worker refused its own check.
    padded = ("--vocab", "16", "--row-entries", "24")
    with worker_process("--row-entries", "24", vocab=16) as running:
        done = cli.module("pp1wire.apps.worker", "--check", running.address, *padded, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("healthy"), done.stdout
