"""Command-line settings shared by the daemons: flags, environment, TOML file, defaults.

Precedence, highest first: command-line flags, ``PP1_*`` environment variables
(the flag's long name upper-cased, dashes as underscores: ``--max-slots`` is
``PP1_MAX_SLOTS``), the ``--config`` TOML file (keys are the flag names with
underscores, at top level), then the defaults. Log lines are JSON objects.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import sys
import tomllib
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any

from pp1wire.apps.models import DEFAULT_VOCAB

ENV_PREFIX = "PP1_"


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


def _int_type(lo: int, hi: int, meaning: str) -> Callable[[object], int]:
    """A flag type accepting integers in ``lo..hi``; ``meaning`` names the range."""

    def check(raw: object) -> int:
        value = _whole(raw)
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is not {meaning}")
        return value

    check.__doc__ = (
        f"Flag type: {meaning} (a TOML float such as 2.7 is refused, not truncated).\n\n"
        "Raises:\n    argparse.ArgumentTypeError: for anything else.\n"
    )
    return check


def _real_type(lo: float, inclusive: bool, meaning: str) -> Callable[[object], float]:
    """A flag type accepting finite numbers above ``lo`` (or equal, if ``inclusive``)."""

    def check(raw: object) -> float:
        value = _real(raw)
        if value < lo or (value == lo and not inclusive):
            raise argparse.ArgumentTypeError(f"{value} is not {meaning}")
        return value

    check.__doc__ = (
        f"Flag type: {meaning}.\n\nRaises:\n    argparse.ArgumentTypeError: for anything else.\n"
    )
    return check


_U64_MAX = (1 << 64) - 1  # the widest integer field on the wire
count = _int_type(0, _U64_MAX, "an integer >= 0")
positive = _int_type(1, _U64_MAX, "an integer >= 1")
port = _int_type(0, 65535, "a port (0..65535; 0: any free port)")
seconds = _real_type(0.0, False, "a duration above 0 seconds")
temperature = _real_type(0.0, True, "a temperature (finite, >= 0; 0: greedy)")


def _convert(action: argparse.Action, raw: object, source: str) -> object:
    if isinstance(action, argparse._StoreTrueAction):
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off", ""):
            return False
        raise SettingsError(f"{source}: {raw!r} is not a boolean")
    convert: Any = action.type
    if convert is None or (isinstance(convert, type) and isinstance(raw, convert)):
        return raw
    try:
        return convert(raw)
    except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
        raise SettingsError(f"{source}: {exc}") from None


def parse(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> argparse.Namespace:
    """Parse ``argv`` and fill every option the flags left unset from env, file, defaults.

    The parser must have a ``--config`` option. A bad flag is reported as a
    :class:`SettingsError` (one line), not argparse's usage text.

    Raises:
        SettingsError: for a bad flag, an unreadable or invalid TOML file (not
            UTF-8 included), an unknown key in it, or a value that does not convert.
    """

    def one_line(message: str) -> None:
        raise SettingsError(message)

    parser.error = one_line  # type: ignore[method-assign,assignment]
    env = os.environ if environ is None else environ
    defaults: dict[str, Any] = {}
    for action in parser._actions:
        if action.dest != "help":
            defaults[action.dest] = action.default
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
            setattr(args, dest, _convert(action, raw, f"{config_path}: {dest}"))
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


def load_factory(spec: str) -> Any:
    """Import ``module:attribute`` and return the attribute.

    Raises:
        SettingsError: if the spec is malformed or the import fails.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise SettingsError(f"plugin {spec!r} must look like module:factory")
    import importlib  # noqa: PLC0415 - plugins are imported only when asked for

    try:
        module = importlib.import_module(module_name)
        return getattr(module, attr)
    except (ImportError, AttributeError) as exc:
        raise SettingsError(f"plugin {spec!r}: {exc}") from None


def host_port(text: str) -> tuple[str, int]:
    """Parse ``HOST:PORT`` (IPv6 in brackets).

    Raises:
        SettingsError: if it does not parse.
    """
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise SettingsError(f"{text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def read_psk(path: str | None) -> bytes | None:
    """The pre-shared key from a file (surrounding whitespace stripped).

    Raises:
        SettingsError: if the file cannot be read or holds fewer than 16 bytes.
    """
    if not path:
        return None
    try:
        key = Path(path).read_bytes().strip()
    except OSError as exc:
        raise SettingsError(f"psk file {path}: {exc}") from None
    if len(key) < 16:
        raise SettingsError(f"psk file {path}: a key needs at least 16 bytes")
    return key


def install_uvloop() -> None:
    """Use uvloop's event loop where it is installed."""
    try:
        import uvloop  # noqa: PLC0415
    except ImportError:  # pragma: no cover - uvloop is a runtime dependency
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def add_common_flags(p: argparse.ArgumentParser, *, log_level: str) -> None:
    """The flags both daemons take with the same meaning (the two sides must agree on them)."""
    p.add_argument("--vocab", type=positive, default=DEFAULT_VOCAB, help="vocabulary size")
    p.add_argument("--vocab-hash", type=count, default=0, help="hash of the global token-ID map")
    p.add_argument(
        "--row-entries",
        type=positive,
        default=None,
        help="dense row length in FP32 entries, padding included (default: --vocab); "
        "both sides must use the same value",
    )
    p.add_argument(
        "--vocab-shards",
        type=positive,
        default=1,
        help="split the vocabulary evenly over N ranks, one link per rank pair (with --tp N, "
        "needs torch): worker rank r listens on --port + r and Spark rank r connects to the "
        "worker address's port + r; each link carries only its range of q",
    )
    p.add_argument("--target-identity", default="pp1-toy-target")
    p.add_argument("--psk-file", default=None, help="file holding the pre-shared key")
    p.add_argument("--metrics-host", default="127.0.0.1")
    p.add_argument(
        "--metrics-port",
        type=port,
        default=None,
        help="Prometheus port (0: any free port; unset: off)",
    )
    p.add_argument("--log-level", default=log_level)
    p.add_argument("--config", default=None, help="TOML file with any of these settings")


def run_daemon(
    prog: str,
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    body: Callable[[argparse.Namespace], Coroutine[Any, Any, int]],
) -> int:
    """A daemon's ``main``: parse settings, set up logging and uvloop, run ``body``.

    Returns ``body``'s exit code; 2 with one line on stderr for a bad setting,
    1 for an operating-system error (an address in use, an unreadable file).
    """
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
