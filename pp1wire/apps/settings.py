"""Command-line settings shared by the daemons: flag types, and flags filled, highest first, from
the command line, ``PP1_<FLAG>`` environment variables, the ``--config`` TOML file and the
defaults; JSON log lines."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import logging
import math
import os
import sys
import tempfile
import tomllib
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar, cast

from pp1wire.apps.models import DEFAULT_VOCAB

ENV_PREFIX = "PP1_"

_V = TypeVar("_V")


class SettingsError(ValueError):
    """A setting could not be read or parsed (bad file, bad environment value)."""


def _whole(raw: object) -> int:
    """An integer from a flag, an environment value or TOML; never a rounded float or a bool."""
    if isinstance(raw, bool | float):
        raise argparse.ArgumentTypeError(f"{raw!r} is not an integer")
    try:
        return int(str(raw).strip()) if not isinstance(raw, int) else raw
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not an integer") from None


def _real(raw: object) -> float:
    if isinstance(raw, bool):
        raise argparse.ArgumentTypeError(f"{raw!r} is not a number")
    try:
        value = float(raw) if isinstance(raw, int | float) else float(str(raw).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{raw!r} is not a finite number")
    return value


def _described(
    check: Callable[[object], _V], meaning: str, kind: type | tuple[type, ...]
) -> Callable[[object], _V]:
    """``check`` as a flag type meaning ``meaning``, whose TOML values must be ``kind``."""
    check.__doc__ = (
        f"Flag type: {meaning}.\n\nRaises:\n    argparse.ArgumentTypeError: for anything else.\n"
    )
    check.kind = kind  # type: ignore[attr-defined]
    return check


def _int_type(lo: int, hi: int, meaning: str) -> Callable[[object], int]:
    """A flag type accepting integers in ``lo..hi``; ``meaning`` names the range."""

    def check(raw: object) -> int:
        value = _whole(raw)
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is not {meaning}")
        return value

    return _described(check, f"{meaning} (a TOML float such as 2.7 is refused, not truncated)", int)


def _real_type(
    lo: float, inclusive: bool, meaning: str, hi: float = math.inf
) -> Callable[[object], float]:
    """A flag type accepting finite numbers above ``lo`` (or equal: ``inclusive``) to ``hi``."""

    def check(raw: object) -> float:
        value = _real(raw)
        if value < lo or (value == lo and not inclusive) or value > hi:
            raise argparse.ArgumentTypeError(f"{value} is not {meaning}")
        return value

    return _described(check, meaning, float)


def _text_type(max_length: int, meaning: str) -> Callable[[object], str]:
    """A flag type accepting strings of at most ``max_length`` characters."""

    def check(raw: object) -> str:
        if not isinstance(raw, str):
            raise argparse.ArgumentTypeError(f"{raw!r} is not a string")
        if len(raw) > max_length:
            raise argparse.ArgumentTypeError(f"{raw[:20]!r}... is not {meaning}")
        return raw

    return _described(check, meaning, str)


_U64_MAX = (1 << 64) - 1  # the widest integer field on the wire
#: The most FP32 entries a dense row may have: 4 bytes each within the 64 MiB frame cap.
MAX_ENTRIES = 1 << 24
#: The most ranks a group (``--tp``, ``--vocab-shards``) may have.
MAX_RANKS = 16
MAX_SECONDS = 7 * 86400.0
MAX_THREADS = 1024
count = _int_type(0, _U64_MAX, "an integer >= 0")
positive = _int_type(1, _U64_MAX, "an integer >= 1")
port = _int_type(0, 65535, "a port (0..65535; 0: any free port)")
seconds = _real_type(0.0, False, "a duration above 0 seconds, at most a week (604800)", MAX_SECONDS)
temperature = _real_type(0.0, True, "a temperature (finite, >= 0; 0: greedy)")
u16 = _int_type(1, 0xFFFF, "an integer in 1..65535 (it travels in a 16-bit field)")
vocabulary = _int_type(
    2, MAX_ENTRIES, f"a vocabulary size in 2..{MAX_ENTRIES} (a dense row must fit a 64 MiB frame)"
)
entries = _int_type(
    1, MAX_ENTRIES, f"a row length in 1..{MAX_ENTRIES} entries (a row must fit a 64 MiB frame)"
)
prefix_tokens = _int_type(
    1, MAX_ENTRIES, f"a prefix length in 1..{MAX_ENTRIES} tokens (it must fit a 64 MiB frame)"
)
depth = _int_type(1, 5, "a depth in 1..5")
support = _int_type(0, 0xFFFFFFFF, "a support in 0..4294967295 (0: dense)")
ranks = _int_type(1, MAX_RANKS, f"a number of ranks in 1..{MAX_RANKS}")
threads = _int_type(0, MAX_THREADS, f"a number of threads in 0..{MAX_THREADS}")
pace_ms = _real_type(0.0, True, "a duration in 0..60000 ms", 60_000.0)
draw_batch = _int_type(1, 4096, "a number of STEPs in 1..4096")
prepare = _int_type(0, 8, "a number of blocks in 0..8")
connections = _int_type(1, 0xFFFF, "a number of connections in 1..65535")
rate = _real_type(0.0, False, "a rate above 0 and at most 1000000 per second", 1e6)
ipv6_prefix = _int_type(1, 128, "a prefix length in 1..128 bits")
name = _text_type(128, "a name of at most 128 characters (a HELLO field)")


def _listen_host(raw: object) -> str:
    if not isinstance(raw, str):
        raise argparse.ArgumentTypeError(f"{raw!r} is not a string")
    if not (raw.startswith("[") or raw.endswith("]")):
        return raw
    inner = raw[1:-1] if raw.startswith("[") and raw.endswith("]") else ""
    try:
        ipaddress.IPv6Address(inner)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{raw!r} is not a listen address (brackets hold an IPv6 address, as in [::1])"
        ) from None
    return inner


#: A listen address (``--host``, ``--metrics-host``): a name, an IPv4 address, or an IPv6
#: address with or without brackets (``[::1]`` listens on ``::1``).
listen_host = _described(
    _listen_host,
    "a listen address: a name, an IPv4 address, or an IPv6 address ([::1] or ::1)",
    str,
)


def address_text(host: str, port: int) -> str:
    """``HOST:PORT`` as :func:`host_port` reads it back (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _depth_or_auto(raw: object) -> int | str:
    if isinstance(raw, str) and raw.strip().lower() == "auto":
        return "auto"
    try:
        return count(raw)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a depth (0..5) or auto") from None


depth_or_auto = _described(  # TOML: depth = 3 or "auto"
    _depth_or_auto, "auto, or an integer >= 0 (a depth, range-checked by the command)", (int, str)
)


def parse_support(text: str) -> int:
    """``--support``: ``dense`` → 0, ``sparse:K`` → K (ASCII digits, K >= 1; the vocabulary's
    bound is the command's check).

    Raises:
        SettingsError: for anything else.
    """
    if text == "dense":
        return 0
    kind, sep, k = text.partition(":")
    if kind == "sparse" and sep and k.isascii() and k.isdigit() and int(k) > 0:
        return int(k)
    raise SettingsError(f"--support {text!r}: use dense or sparse:K")


def _exact(action: argparse.Action, raw: object) -> str | None:
    """Why a TOML value has the wrong type for ``action``, or None (TOML types its values:
    a string is not a port, 2 is not a path)."""
    if isinstance(action, argparse._StoreTrueAction):
        return None if isinstance(raw, bool) else f"{raw!r} is not a boolean (true or false)"
    if action.nargs in ("*", "+"):
        ok = isinstance(raw, list) and all(isinstance(x, str) for x in raw)
        return None if ok else f"{raw!r} is not a list of strings"
    kind = getattr(action.type, "kind", action.type if isinstance(action.type, type) else str)
    kinds = kind if isinstance(kind, tuple) else (kind,)  # a tuple: one of several TOML types
    accepted = tuple(t for k in kinds for t in _ACCEPTED.get(k, (str,)))
    if isinstance(raw, bool) or not isinstance(raw, accepted):
        return f"{raw!r} is not {' or '.join(_KIND_NAMES.get(k, 'a string') for k in kinds)}"
    return None


_ACCEPTED: dict[type, tuple[type, ...]] = {int: (int,), float: (int, float), str: (str,)}
_KIND_NAMES = {int: "an integer", float: "a number", str: "a string"}


def _convert(action: argparse.Action, raw: object, source: str, *, typed: bool = False) -> object:
    """Convert a value from the environment (a string) or, ``typed``, a TOML file."""
    if typed:
        wrong = _exact(action, raw)
        if wrong is not None:
            raise SettingsError(f"{source}: {wrong}")
    if isinstance(action, argparse._StoreTrueAction):
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off", ""):
            return False
        raise SettingsError(f"{source}: {raw!r} is not a boolean")
    if action.nargs in ("*", "+"):
        items = raw if isinstance(raw, list) else str(raw).split()
        return [_convert_one(action, x, source) for x in items]
    return _convert_one(action, raw, source)


def _convert_one(action: argparse.Action, raw: object, source: str) -> object:
    convert: Any = action.type
    if convert is None or (isinstance(convert, type) and isinstance(raw, convert)):
        value = raw
    else:
        try:
            value = convert(raw)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
            raise SettingsError(f"{source}: {exc}") from None
    if action.choices is not None and value not in action.choices:
        raise SettingsError(f"{source}: {value!r} is not one of {sorted(action.choices)}")
    return value


def one_line_errors(parser: argparse.ArgumentParser) -> None:
    """Make ``parser`` raise a bad flag as a :class:`SettingsError` (one line), not exit."""

    def one_line(message: str) -> NoReturn:
        raise SettingsError(message)

    parser.error = one_line  # type: ignore[method-assign]


def parse(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> argparse.Namespace:
    """Parse ``argv``, filling every option the flags left unset from, in order, ``PP1_<FLAG>``
    in the environment, the ``--config`` TOML file (keys named like the flags), the defaults.

    Raises:
        SettingsError: for a bad flag, an unreadable or invalid TOML file (not
            UTF-8 included), an unknown key in it, or a value that does not convert.
    """
    one_line_errors(parser)
    env = os.environ if environ is None else environ
    defaults: dict[str, Any] = {}
    for action in parser._actions:
        if action.dest != "help":
            defaults[action.dest] = action.default
            # --help runs inside parse_args, while the defaults are set aside.
            action.shown_default = action.default  # type: ignore[attr-defined]
            action.default = None
    try:
        args = parser.parse_args(argv)
    finally:
        for action in parser._actions:
            if action.dest in defaults:
                action.default = defaults[action.dest]
    config_path = getattr(args, "config", None) or env.get(ENV_PREFIX + "CONFIG")
    file_values: dict[str, Any] = {}
    if config_path:
        try:
            file_values = tomllib.loads(Path(config_path).read_text())
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise SettingsError(f"config file {config_path}: {exc}") from None
    known = {a.dest: a for a in parser._actions if a.dest != "help"}
    for key in file_values:
        if key.replace("-", "_") not in known:
            raise SettingsError(f"config file {config_path}: unknown key {key!r}")
    for dest, action in known.items():
        if getattr(args, dest) is not None:
            continue
        env_name = ENV_PREFIX + dest.upper()
        if env_name in env:
            setattr(args, dest, _convert(action, env[env_name], env_name))
        elif dest in file_values or dest.replace("_", "-") in file_values:
            raw = file_values.get(dest, file_values.get(dest.replace("_", "-")))
            setattr(args, dest, _convert(action, raw, f"{config_path}: {dest}", typed=True))
        else:
            setattr(args, dest, defaults[dest])
    return args


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg and any ``extra`` fields."""

    _skip = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message"}

    def format(self, record: logging.LogRecord) -> str:
        """Render ``record`` as a JSON line."""
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in self._skip:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str) -> None:
    """JSON log lines on stderr at ``level`` (debug, info, warning, error).

    Raises:
        SettingsError: for an unknown level name.
    """
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise SettingsError(f"unknown log level {level!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("pp1wire")
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    root.propagate = False


def make_plugin(spec: str, **kwargs: Any) -> Callable[..., Any]:
    """Import the factory ``module:attribute`` and call it with ``kwargs``, for a callable.

    Raises:
        SettingsError: if the spec is malformed, the import fails, the factory is
            not callable, raises, or makes something that is not callable.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise SettingsError(f"plugin {spec!r} must look like module:factory")
    import importlib  # noqa: PLC0415 - plugins are imported only when asked for

    try:
        module = importlib.import_module(module_name)
        factory = getattr(module, attr)
    except (ImportError, AttributeError) as exc:
        raise SettingsError(f"plugin {spec!r}: {exc}") from None
    except Exception as exc:  # a plugin module that fails while it is imported
        raise SettingsError(f"plugin {spec!r}: importing it raised {exc!r}") from None
    if not callable(factory):
        raise SettingsError(f"plugin {spec!r} is a {type(factory).__name__}, not a callable")
    try:
        made = factory(**kwargs)
    except Exception as exc:  # a plugin's own failure, reported in one line
        raise SettingsError(f"plugin {spec!r}: the factory raised {exc!r}") from None
    if not callable(made):
        raise SettingsError(
            f"plugin {spec!r} made a {type(made).__name__}, not a callable (prefix -> logits)"
        )
    return cast(Callable[..., Any], made)


def host_port(text: str) -> tuple[str, int]:
    """Parse ``HOST:PORT``, an IPv6 host in brackets (``[::1]:7070``), the port 0..65535.

    Raises:
        SettingsError: if it does not parse (a bare IPv6 address such as ``::1``
            included: it has no port) or the port is out of range.
    """
    if text.startswith("["):
        host, sep, port_text = text[1:].partition("]:")
        if not sep or not host or ":" not in host:
            raise SettingsError(f"{text!r} is not HOST:PORT (IPv6: [ADDRESS]:PORT)")
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or not host:
            raise SettingsError(f"{text!r} is not HOST:PORT")
        if ":" in host:
            raise SettingsError(
                f"{text!r} is not HOST:PORT (an IPv6 address goes in brackets: [ADDRESS]:PORT)"
            )
    if not (port_text.isascii() and port_text.isdigit()) or int(port_text) > 65535:
        raise SettingsError(f"{text!r} is not HOST:PORT (a port is 0..65535)")
    return host, int(port_text)


def _principal_rate(raw: object) -> tuple[str | None, float | None]:
    if not isinstance(raw, str):
        raise argparse.ArgumentTypeError(f"{raw!r} is not [ID=]RATE")
    ident, sep, value = raw.rpartition("=")
    if sep and ident == "-":
        ident = ""  # the default key's ID, as a key table writes it
    if sep and len(ident) > 128:
        raise argparse.ArgumentTypeError(f"{ident[:20]!r}... is not a key ID (128 characters)")
    if value.strip().lower() == "off":
        return (ident if sep else None), None
    return (ident if sep else None), rate(value)


principal_rate = _described(
    _principal_rate,
    "RATE (every principal's cap) or ID=RATE (key ID ID's; = or -= the default key's), a "
    "number of fresh draws a second above 0, or off",
    str,
)


def install_uvloop() -> None:
    """Use uvloop's event loop where it is installed."""
    try:
        import uvloop  # noqa: PLC0415
    except ImportError:  # pragma: no cover - uvloop is a runtime dependency
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``--help`` that gives each flag's default after its text (unless the text does)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = getattr(action, "shown_default", action.default)
        if (
            not action.option_strings
            or "default" in text
            or default is None
            or default is False
            or default == argparse.SUPPRESS
        ):
            return text
        shown = str(default).replace("%", "%%")
        return f"{text} (default: {shown})"


def parser(prog: str, description: str | None) -> argparse.ArgumentParser:
    """An argument parser whose ``--help`` shows every flag's default."""
    return argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=HelpFormatter
    )


def adder(p: argparse.ArgumentParser, helps: Mapping[str, str]) -> Callable[..., None]:
    """``add(flag, kind, default, metavar, **more)``, adding ``flag`` to ``p`` with the help
    ``helps[flag]``: one line a flag, the help texts in a table of their own (a ``None``
    type, default or metavar is argparse's own)."""

    def add(
        flag: str, kind: Any = None, default: Any = None, metavar: str | None = None, **more: Any
    ) -> None:
        given = {"type": kind, "default": default, "metavar": metavar}
        chosen = {k: v for k, v in given.items() if v is not None}
        p.add_argument(flag, help=helps[flag], **chosen, **more)

    return add


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


_HELP: dict[str, str] = {
    "--vocab": "vocabulary size in token IDs",
    "--vocab-hash": "hash of the global token-ID map (an unsigned 64-bit integer)",
    "--row-entries": "dense row length in FP32 entries, padding included (default: --vocab); both "
    "sides must use the same value",
    "--vocab-shards": "split the vocabulary evenly over N ranks, one link per rank pair (the "
    "daemons: with --tp N, needs torch): worker rank r listens on its port + r and Spark rank r "
    "connects to the worker address's port + r; each link carries only its range of q",
    "--target-identity": "the target model's identity, declared in HELLO (at most 128 characters)",
    "--psk-file": "file holding the pre-shared key, at least 16 bytes, or a key table (first line "
    "pp1-keys-v1, then one 'ID KEY' per line; ID - is the default key): a worker accepts every key "
    "of it, each its own principal (default: none, no authentication)",
    "--key-id": "the ID of this Spark side's key, sent in HELLO: a key table's entry, or the ID "
    "the worker's table gives this file's one key ('' or -: the default key)",
    "--worker": "the worker's address ([IPV6]:PORT for IPv6); a sharded rank r uses PORT + r",
    "--tls-ca": "CA / certificate file: connect with TLS, trusting it (default: plaintext)",
    "--metrics-host": "address of the Prometheus endpoint; an address other than loopback needs "
    "--metrics-token-file or --insecure",
    "--metrics-port": "Prometheus port, GET /metrics (0: any free port; default: unset, no "
    "endpoint)",
    "--metrics-token-file": "file holding a bearer token of at least 16 printable characters: GET "
    "/metrics then needs 'Authorization: Bearer TOKEN' (else 401), with or without --psk-file "
    "(default: none, anyone who reaches the endpoint reads it)",
    "--insecure": "listen on an address other than loopback without its credential (the worker's "
    "--host without --psk-file, either daemon's --metrics-host without --metrics-token-file): "
    "anyone who can reach it may use it (open sessions and make the worker draw; read /metrics)",
    "--log-level": "JSON log lines on stderr at this level: " + ", ".join(LOG_LEVELS),
    "--config": "TOML file with any of these settings, keys named like the flags (default: none)",
}


def add_link_flags(p: argparse.ArgumentParser) -> None:
    """The flags of what both sides of a link must agree on: vocabulary, split, target, key."""
    add = adder(p, _HELP)
    add("--vocab", vocabulary, DEFAULT_VOCAB, "TOKENS")
    add("--vocab-hash", count, 0, "HASH")
    add("--row-entries", entries, None, "ENTRIES")
    add("--vocab-shards", ranks, 1, "N")
    add("--target-identity", name, "pp1-toy-target", "NAME")
    add("--psk-file", None, None, "FILE")
    add("--key-id", name, "", "ID")


def add_connect_flags(p: argparse.ArgumentParser) -> None:
    """How a Spark side (``pp1-spark``, ``pp1-conformance``) reaches its worker."""
    add = adder(p, _HELP)
    add("--worker", None, "127.0.0.1:7070", "HOST:PORT")
    add("--tls-ca", None, None, "FILE")


def add_common_flags(p: argparse.ArgumentParser, *, log_level: str) -> None:
    """The flags both daemons take with the same meaning: the link's, metrics, logging, config."""
    add_link_flags(p)
    add = adder(p, _HELP)
    add("--metrics-host", listen_host, "127.0.0.1", "HOST")
    add("--metrics-port", port, None, "PORT")
    add("--metrics-token-file", None, None, "FILE")
    add("--insecure", action="store_true")
    add("--log-level", None, log_level, "LEVEL", choices=LOG_LEVELS)
    add_config(p)


def add_config(p: argparse.ArgumentParser) -> None:
    """``--config``: a TOML file of settings (see :func:`parse`)."""
    add = adder(p, _HELP)
    add("--config", None, None, "FILE")


def exposed(host: str) -> bool:
    """Whether listening on ``host`` may be reachable from other machines: anything but
    ``localhost`` and loopback addresses (a name is not resolved)."""
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return True


def check_listeners(listeners: Sequence[tuple[str, str, str, bool]], *, insecure: bool) -> None:
    """Protected mode: each of ``listeners``, ``(flag, host, credential flag, credential
    given)``, beyond loopback (:func:`exposed`) needs its credential or ``insecure``.

    Raises:
        SettingsError: naming the first listener beyond loopback without its credential
            or ``--insecure``.
    """
    if insecure:
        return
    for flag, host, credential, given in listeners:
        if exposed(host) and not given:
            raise SettingsError(
                f"{flag} {host} without {credential}: anyone who can reach it could use it; "
                f"give {credential}, listen on 127.0.0.1, or pass --insecure"
            )


def check_group_waits(group_timeout: float, waits: Mapping[str, float]) -> None:
    """Each of a rank's waits for its link (``waits``: flag -> seconds) must end before the
    others' collective gives up (``group_timeout``), or a legitimate wait fails the group.

    Raises:
        SettingsError: naming the first wait that is not below ``group_timeout``.
    """
    for flag, seconds in waits.items():
        if seconds >= group_timeout:
            raise SettingsError(
                f"{flag} {seconds:g} is not below --group-timeout {group_timeout:g}: the "
                "other ranks wait for that long in a collective, which would fail the group"
            )


def linked_address(text: str, shards: int) -> tuple[str, int]:
    """``--worker HOST:PORT`` of a Spark side with ``shards`` links (rank r: PORT + r).

    Raises:
        SettingsError: as :func:`host_port`, or a last rank's port above 65535.
    """
    host, port = host_port(text)
    if port + shards - 1 > 0xFFFF:
        raise SettingsError(
            f"--worker {text} with --vocab-shards {shards}: rank {shards - 1} would connect to "
            f"port {port + shards - 1}, above 65535"
        )
    return host, port


def check_writable(flag: str, path: str) -> None:
    """Check that a run could write ``path`` at its end, creating and changing nothing.

    Raises:
        SettingsError: if an existing ``path`` cannot be opened for writing (a folder,
            a file without write permission), or its folder is missing or cannot be
            written.
    """
    target = Path(path)
    try:
        # No O_CREAT: a missing file stays missing (its folder must take it); O_NONBLOCK:
        # a FIFO without a reader is refused, not waited on.
        with contextlib.suppress(FileNotFoundError):
            os.close(os.open(target, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK))
        with tempfile.TemporaryFile(dir=target.parent):
            pass
    except OSError as exc:
        raise SettingsError(f"{flag} {path}: {exc.strerror or exc}") from None


def run_daemon(
    prog: str,
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    body: Callable[[argparse.Namespace], Coroutine[Any, Any, int]],
) -> int:
    """A daemon's ``main``: parse settings, set up logging and uvloop, run ``body``; its exit
    code, or with one line on stderr 2 for a bad setting, 1 for an operating-system error."""
    try:
        args = parse(parser, argv)
        setup_logging(args.log_level)
        install_uvloop()
        return asyncio.run(body(args))
    except SettingsError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1


def row_entries(args: argparse.Namespace) -> int:
    """``--row-entries``, checked: at least the vocabulary (default: equal to it).

    Raises:
        SettingsError: for a value below ``--vocab``.
    """
    entries = args.vocab if args.row_entries is None else args.row_entries
    if entries < args.vocab:
        raise SettingsError("--row-entries must be at least --vocab")
    return int(entries)
