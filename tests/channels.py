"""Fake channels for the bucket's protocol, one family (issue #27).

A channel is anything with ``send(obj)``, ``recv()`` and, to be waited on in slices,
``poll(timeout)``. :class:`ScriptedChannel` plays the other side from a script (and
answers what it is sent, if told how); :class:`FaultyChannel` wraps a real pipe end
and injects one fault at the N-th send.
"""

from __future__ import annotations

from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["FaultyChannel", "ScriptedChannel", "acking"]


class ScriptedChannel:
    """The other side played from a script; everything sent is recorded in ``sent``.

    Args:
        messages: what ``recv()`` returns, in order; ``poll()`` is true while some are
            left (none: a peer that never answers).
        answer: called with each message sent; what it returns joins the script (a
            receiver that acknowledges every batch: :func:`acking`).
    """

    def __init__(
        self,
        messages: list[Any] | None = None,
        answer: Callable[[Any], list[Any]] | None = None,
    ) -> None:
        self.messages = list(messages or [])
        self.answer = answer
        self.sent: list[Any] = []

    def send(self, obj: Any) -> None:
        self.sent.append(obj)
        if self.answer is not None:
            self.messages.extend(self.answer(obj))

    def recv(self) -> Any:
        if not self.messages:
            raise AssertionError("recv() without a message: the code read when poll said no")
        return self.messages.pop(0)

    def poll(self, timeout: float) -> bool:
        return bool(self.messages)


def acking(message: Any) -> list[Any]:
    """A receiver's answer: every batch and the end acknowledged at once."""
    if message[0] in ("batch", "end"):
        return [("ack", message[1], message[2])]
    return []


class FaultyChannel:
    """A real pipe end whose ``at``-th send drops, closes the pipe, or raises.

    Args:
        conn: the end to wrap.
        fault: ``"drop"`` (the message is lost), ``"close"`` (the end is closed and
            the send fails with OSError), ``"error"`` (the send raises RuntimeError).
        at: which send (1-based) fails.
    """

    def __init__(self, conn: Connection, fault: str, at: int) -> None:
        self.conn, self.fault, self.at, self.count = conn, fault, at, 0

    def send(self, obj: Any) -> None:
        self.count += 1
        if self.count == self.at:
            if self.fault == "drop":
                return
            if self.fault == "close":
                self.conn.close()
                raise OSError("closed on purpose")
            if self.fault == "error":
                raise RuntimeError("injected send failure")
        self.conn.send(obj)

    def recv(self) -> Any:
        return self.conn.recv()

    def poll(self, timeout: float) -> bool:
        return self.conn.poll(timeout)
