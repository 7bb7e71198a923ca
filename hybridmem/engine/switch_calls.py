"""How a switch's drivers run its stages: each operation a call, sync or awaited or in a thread.

A direction of the switch is a generator of :class:`Call` s (the sans-IO core); the
sync driver runs each, the async one awaits it, off the event loop where it blocks
for long (:data:`BLOCKING`: copies and collectives), in a thread that is never
abandoned (:func:`in_thread`). An operation may itself return an awaitable:
:func:`then_run` chains what comes after it either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from hybridmem.engine.ranks import SYNC_POINTS

__all__ = ["BLOCKING", "Call", "in_thread", "then_run"]

# Stages that block the host for long (copies, collectives): run off the event loop.
BLOCKING = frozenset({"offload", "reload", "barrier_plan"}) | SYNC_POINTS


@dataclass(frozen=True)
class Call:
    """One operation of a direction, for a driver to run (in a thread if ``blocking``)."""

    fn: Callable[[], object]
    blocking: bool
    name: str


async def in_thread(fn: Callable[[], object]) -> object:
    """``await`` ``fn()`` in a worker thread; if cancelled, wait for the thread to end first.

    The thread cannot be stopped (an offload or reload midway): recovery must not
    touch the same state until it has finished.
    """
    task = asyncio.ensure_future(asyncio.to_thread(fn))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        while not task.done():  # the thread cannot be stopped: let it finish
            with contextlib.suppress(BaseException):
                await asyncio.shield(task)
        raise


def then_run(first: Awaitable[Any] | None, then: Callable[[], object]) -> Any:
    """Run ``then`` after ``first``, awaiting both where they are awaitable.

    ``first`` None: ``then()`` now, its result returned (an awaitable stays for the
    driver to await); else a coroutine that awaits ``first``, runs ``then`` and
    awaits what it returns.

    Example:
        >>> then_run(None, lambda: 3)
        3
    """
    if first is None:
        return then()

    async def chain() -> None:
        await first
        result = then()
        if inspect.isawaitable(result):
            await result

    return chain()
