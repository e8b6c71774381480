"""The base of the events the sans-IO cores hand to their shells, and the one both report.

An event is a small frozen dataclass: :class:`Event` makes every subclass one,
so each kind is only its docstring and fields. :mod:`pp1wire.wire.spark_events`
and :mod:`pp1wire.wire.worker_events` define the kinds of each side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, dataclass_transform

from pp1wire.wire.messages import Hello


@dataclass_transform(frozen_default=True)
class Event:
    """A frozen dataclass of whatever fields a subclass declares (compared by value)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Make the subclass a frozen dataclass."""
        super().__init_subclass__(**kwargs)
        dataclass(frozen=True)(cls)


class HandshakeDone(Event):
    """The handshake completed: the peer's HELLO was accepted (and authentication
    passed, where a key is configured); ``session`` is on every later message."""

    session: int
    peer: Hello
