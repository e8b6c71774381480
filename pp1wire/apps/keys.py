"""Pre-shared keys and bearer tokens read from files (a key table, ``docs/protocol.md`` §5),
and the link fields both sides must agree on, from their flags."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TypedDict

from pp1wire.apps.settings import SettingsError, row_entries

#: The first line of a key file that holds several keys, each under its ID.
KEY_TABLE_HEADER = b"pp1-keys-v1"
#: The ID a key table writes for the default key (ID ``""``, a single-key file's).
DEFAULT_KEY_ID = "-"
_KEY_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:@+-")


def key_id(raw: str) -> str:
    """A key ID as a key table writes it (§5): 1 to 128 of ``A-Z a-z 0-9 . _ : @ + -``, or
    ``-`` (also ``""``) for the default key ``""``.

    Raises:
        ValueError: for anything else.
    """
    if raw in ("", DEFAULT_KEY_ID):
        return ""
    if len(raw) > 128 or not set(raw) <= _KEY_ID_CHARS:
        raise ValueError(f"{raw[:20]!r} is not a key ID (1 to 128 of A-Z a-z 0-9 . _ : @ + -)")
    return raw


def read_keys(path: str) -> dict[str, bytes]:
    """The pre-shared keys of a key file, by ID (§5): after a first line ``pp1-keys-v1``, one
    ``ID KEY`` per line (``#`` comments and blank lines skipped); any other file is the
    default key (ID ``""``), stripped. Every key has at least 16 bytes.

    Raises:
        SettingsError: if the file cannot be read, a key is shorter than 16 bytes, or
            a table line is malformed, names a bad or repeated ID, or the table is empty.
    """
    return _key_file(path)[0]


def _key_file(path: str) -> tuple[dict[str, bytes], bool]:
    """:func:`read_keys`, and whether the file is a key table."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise SettingsError(f"psk file {path}: {exc}") from None
    first, _, rest = data.partition(b"\n")
    if first.strip() != KEY_TABLE_HEADER:
        if len(data.strip()) < 16:
            raise SettingsError(f"psk file {path}: a key needs at least 16 bytes")
        return {"": data.strip()}, False
    table: dict[str, bytes] = {}
    for n, line in enumerate(rest.split(b"\n"), 2):
        words = line.split()
        if not words or words[0].startswith(b"#"):
            continue
        where = f"psk file {path}:{n}"
        if len(words) != 2:
            raise SettingsError(f"{where}: a key table line is: ID KEY")
        try:
            ident = key_id(words[0].decode("ascii"))
        except ValueError:  # UnicodeDecodeError included
            raise SettingsError(
                f"{where}: not a key ID (1 to 128 of A-Z a-z 0-9 . _ : @ + -)"
            ) from None
        if ident in table:
            raise SettingsError(f"{where}: key ID {words[0].decode()!r} given twice")
        if len(words[1]) < 16:
            raise SettingsError(f"{where}: a key needs at least 16 bytes")
        table[ident] = words[1]
    if not table:
        raise SettingsError(f"psk file {path}: a key table with no key")
    return table, True


def read_psk(path: str | None, key_id: str = "") -> bytes | None:
    """A Spark side's pre-shared key: a single-key file's (under any ``key_id``), or the key of
    ``key_id`` in a key table; None without a file.

    Raises:
        SettingsError: as :func:`read_keys`, or a table without ``key_id``.
    """
    if not path:
        return None
    keys, table = _key_file(path)
    if not table:
        return keys[""]
    if key_id not in keys:
        shown = key_id or DEFAULT_KEY_ID
        raise SettingsError(f"psk file {path}: the key table has no key ID {shown!r} (--key-id)")
    return keys[key_id]


def read_token(path: str) -> bytes:
    """A bearer token from a file (``--metrics-token-file``), stripped: at least 16 printable
    ASCII characters without spaces (what an ``Authorization`` header can carry).

    Raises:
        SettingsError: if the file cannot be read or the token is not such.
    """
    try:
        token = Path(path).read_bytes().strip()
    except OSError as exc:
        raise SettingsError(f"token file {path}: {exc}") from None
    if len(token) < 16 or not all(0x21 <= b <= 0x7E for b in token):
        raise SettingsError(
            f"token file {path}: a token is at least 16 printable ASCII characters, no spaces"
        )
    return token


class LinkFields(TypedDict):
    """The ``PeerConfig`` fields the link flags give (``--vocab-shards``: where ranks are known)."""

    vocab_size: int
    vocab_hash: int
    row_entries: int
    target_identity: str
    psk: bytes | None
    key_id: str
    keys: tuple[tuple[str, bytes], ...]


def link_fields(args: argparse.Namespace, *, worker: bool = False) -> LinkFields:
    """What both sides of a link must agree on, from the flags, the keys read: a Spark side's
    one key under ``--key-id``, or (``worker``) every key of the file, by ID.

    Raises:
        SettingsError: as :func:`row_entries`, :func:`read_psk` and :func:`read_keys`.
    """
    table = worker and bool(args.psk_file)
    ident = "" if worker else key_id_flag(args.key_id)
    if ident and not args.psk_file:
        raise SettingsError("--key-id names a key: give --psk-file with it")
    return LinkFields(
        vocab_size=args.vocab,
        vocab_hash=args.vocab_hash,
        row_entries=row_entries(args),
        target_identity=args.target_identity,
        psk=None if worker else read_psk(args.psk_file, ident),
        key_id=ident if args.psk_file else "",
        keys=tuple(read_keys(args.psk_file).items()) if table else (),
    )


def key_id_flag(raw: str) -> str:
    """``--key-id``: ``-`` (or ``""``) is the default key ``""``, anything else as given."""
    return "" if raw == DEFAULT_KEY_ID else raw
