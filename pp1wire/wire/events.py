"""The base of the events the sans-IO cores hand to their shells (each kind a frozen
dataclass: its docstring and fields), and the one both report."""

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
    """The handshake completed (HELLO accepted, and AUTH where keyed); ``session`` is on
    every later message."""

    session: int
    peer: Hello
