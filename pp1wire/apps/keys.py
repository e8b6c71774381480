"""Pre-shared keys and tokens read from files, and the link fields they make.

A worker's ``--psk-file`` holds one key (the default, ID ``""``) or a key table
(``docs/protocol.md`` §5, :func:`read_keys`); a Spark side takes one key of it,
the one its ``--key-id`` names (:func:`read_psk`). ``--metrics-token-file``
holds a bearer token (:func:`read_token`). :func:`link_fields` is what both
sides of a link must agree on, from their flags.
"""

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
    """A key ID as a key table writes it (``docs/protocol.md`` §5): 1 to 128 of the
    characters ``A-Z a-z 0-9 . _ : @ + -``, or ``-`` (also ``""``) for the default
    key ``""``.

    Raises:
        ValueError: for anything else.
    """
    if raw in ("", DEFAULT_KEY_ID):
        return ""
    if len(raw) > 128 or not set(raw) <= _KEY_ID_CHARS:
        raise ValueError(f"{raw[:20]!r} is not a key ID (1 to 128 of A-Z a-z 0-9 . _ : @ + -)")
    return raw


def read_keys(path: str) -> dict[str, bytes]:
    """The pre-shared keys of a key file, by ID (``docs/protocol.md`` §5).

    A file whose first line is ``pp1-keys-v1`` is a key table: each later line is
    ``ID KEY`` (whitespace between; ``-`` as the ID names the default key ``""``),
    blank lines and lines starting with ``#`` are skipped. Any other file is one
    key, the default (ID ``""``): its bytes with surrounding ASCII whitespace
    removed. Every key has at least 16 bytes.

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
    """A Spark side's pre-shared key: the one key of a single-key file (whatever
    ``key_id`` it is sent under), or the key of ``key_id`` in a key table
    (:func:`read_keys`); None without a file.

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
    """A bearer token from a file (``--metrics-token-file``): its bytes with surrounding
    ASCII whitespace removed, at least 16 of them, printable ASCII without spaces
    (what an HTTP ``Authorization`` header can carry).

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
    """The :class:`~pp1wire.wire.handshake.PeerConfig` fields the :func:`add_link_flags`
    flags give (``--vocab-shards`` is a layout, made where the ranks are known)."""

    vocab_size: int
    vocab_hash: int
    row_entries: int
    target_identity: str
    psk: bytes | None
    key_id: str
    keys: tuple[tuple[str, bytes], ...]


def link_fields(args: argparse.Namespace, *, worker: bool = False) -> LinkFields:
    """What both sides of a link must agree on, from the flags: ``--row-entries`` checked,
    the keys read: a Spark side's one key under ``--key-id`` (:func:`read_psk`), or
    (``worker``) every key of the file, by ID (:func:`read_keys`).

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
    """``--key-id``: ``-`` (or ``""``) is the default key ``""``, anything else as given
    (a HELLO field of at most 128 characters: the flag type checks that)."""
    return "" if raw == DEFAULT_KEY_ID else raw
