"""The base of every primitive: token stacks, ``with``/``async with``, the decorator's dispatch.

What a decorated target becomes is in :mod:`hybridmem._scope.functions` (functions,
coroutines, generators) and :mod:`hybridmem._scope.classes` (context-manager classes).
"""

from __future__ import annotations

import abc
import asyncio
import asyncio.events
import copy
import inspect
import threading
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, TypeVar, cast

from hybridmem._env import disabled
from hybridmem._platform.stdlib import running_loop
from hybridmem._scope.classes import decorate_class
from hybridmem._scope.functions import (
    is_async_callable,
    wrap_async_generator,
    wrap_coroutine,
    wrap_function,
    wrap_generator,
)
from hybridmem._scope.methods import SpanningEnter, is_class_body_enter

__all__ = ["ScopedContext"]

_Self = TypeVar("_Self", bound="ScopedContext")
_T = TypeVar("_T")

_DISABLED = object()  # token of an entry made while the kill switch was on
_fallback_lock = threading.Lock()


# The token stacks are keyed by (thread, asyncio task) so that each thread and
# task pairs its own entries and exits; bound once, they are on the hot path.
# Code outside any task uses 0 (no running loop) or id(None) as the task part.
_get_running_loop = running_loop
_current_task = asyncio.current_task
_get_ident = threading.get_ident


class ScopedContext(abc.ABC):
    """Base of every hybridmem primitive: ``with``, ``async with`` and decorator.

    Subclasses implement :meth:`_enter` (make the change, return a token) and
    :meth:`_exit` (undo it from the token). The base keeps a stack of tokens per
    instance and per thread/task, so one instance may be entered re-entrantly and
    from several threads; decorated calls use a fresh copy (:meth:`_recreate`).
    Exits always run, whatever the exception (``KeyboardInterrupt`` and
    ``asyncio.CancelledError`` included). With ``HYBRIDMEM_DISABLE=1`` entries
    change nothing.

    Thread-safety: the token stacks need no lock (each thread or task only touches
    its own stack, and single dict and list operations are atomic); the state a
    subclass changes is guarded by that subclass (allocator settings by one
    process-wide lock).
    """

    def __init__(self) -> None:
        # Token stacks by (thread, task). No lock: a key is only ever touched by its
        # own thread, and single dict/list operations are atomic.
        self._frames: dict[tuple[int, int], list[object]] = {}

    # ------------------------------------------------------------------ #
    # What subclasses implement
    # ------------------------------------------------------------------ #
    @abc.abstractmethod
    def _enter(self) -> object:
        """Make the change; return a token that :meth:`_exit` undoes."""

    @abc.abstractmethod
    def _exit(self, token: object, exc: BaseException | None) -> None:
        """Undo the change recorded by ``token``; ``exc`` is the exception in flight."""

    async def _aenter(self) -> object:
        """Async form of :meth:`_enter` (default: the sync one)."""
        return self._enter()

    async def _aexit(self, token: object, exc: BaseException | None) -> None:
        """Async form of :meth:`_exit` (default: the sync one)."""
        self._exit(token, exc)

    def _spans_with_block(self) -> bool:
        """Whether ``@self`` on a class body's ``__enter__`` spans each ``with`` block.

        True for a scope that holds a state the block needs (the default); False for
        an action at one moment, which stays on the call it decorates.
        """
        return True

    def _recreate(self: _Self) -> _Self:
        """Return a fresh, unentered copy with the same arguments (one per decorated call)."""
        clone = copy.copy(self)
        ScopedContext.__init__(clone)
        return clone

    # ------------------------------------------------------------------ #
    # Token stack
    # ------------------------------------------------------------------ #
    def _push(self, token: object) -> None:
        loop = _get_running_loop()
        key = (_get_ident(), id(_current_task(loop)) if loop is not None else 0)
        stack = self._frames.get(key)
        if stack is None:
            self._frames[key] = [token]
        else:
            stack.append(token)

    def _pop(self) -> object:
        loop = _get_running_loop()
        key = (_get_ident(), id(_current_task(loop)) if loop is not None else 0)
        stack = self._frames.get(key)
        if not stack:
            # Exited from another thread or task than it was entered in (an
            # ExitStack handed over, say): take an entry from wherever one is.
            with _fallback_lock:
                other = next((k for k, v in list(self._frames.items()) if v), None)
                if other is None:
                    raise RuntimeError(f"{self!r} was exited more often than it was entered")
                key = other
                stack = self._frames[key]
        token = stack.pop()
        if not stack:
            self._frames.pop(key, None)
        return token

    @property
    def active(self) -> bool:
        """True while this instance is entered (in any thread or task)."""
        return any(list(self._frames.values()))

    # ------------------------------------------------------------------ #
    # Context-manager protocol
    # ------------------------------------------------------------------ #
    def __enter__(self: _Self) -> _Self:
        token = _DISABLED if disabled() else self._enter()
        self._push(token)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        token = self._pop()
        if token is not _DISABLED:
            self._exit(token, exc)

    async def __aenter__(self: _Self) -> _Self:
        token = _DISABLED if disabled() else await self._aenter()
        self._push(token)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        token = self._pop()
        if token is not _DISABLED:
            await self._aexit(token, exc)

    # ------------------------------------------------------------------ #
    # Decorator protocol
    # ------------------------------------------------------------------ #
    def __call__(self, target: _T) -> _T:
        """Decorate a function, coroutine/generator/async-generator function or CM class.

        Also a ``staticmethod`` or ``classmethod`` object (the function inside is
        wrapped, and wrapped again the same way), and an object whose ``__call__``
        is ``async def`` (the scope spans the awaited body). A plain function that
        returns a coroutine (a sync wrapper of an ``async def``) gets the scope
        around the awaited coroutine too. On a class body's ``__enter__`` or
        ``__aenter__``, a scope that holds a state spans each ``with`` block, as on
        the class (:mod:`hybridmem._scope.methods`).
        """
        if isinstance(target, type):
            return cast(_T, decorate_class(self, target))
        if isinstance(target, SpanningEnter):
            return cast(_T, target.with_scope(self, spans=self._spans_with_block()))
        if is_class_body_enter(target):
            # A sharding manager's __enter__: a state spans the `with` block it opens.
            wrapped = cast(Callable[..., Any], target)
            if self._spans_with_block():
                return cast(_T, SpanningEnter(wrapped, (self,), _wrap_call))
            return cast(_T, SpanningEnter(_wrap_call(self, wrapped), (), _wrap_call))
        return _wrap_call(self, target)


def _wrap_call(scope: ScopedContext, target: _T) -> _T:
    """``scope`` around each call of ``target`` (a function, method object or callable)."""
    if isinstance(target, (staticmethod, classmethod)):
        # Wrapping the descriptor itself would turn it into a plain function,
        # which a class then binds as an instance method.
        return cast(_T, type(target)(scope(target.__func__)))
    if not inspect.isroutine(target) and is_async_callable(target):
        return cast(_T, wrap_coroutine(scope, cast(Callable[..., Awaitable[Any]], target)))
    if not callable(target):
        raise TypeError(
            f"{scope!r} decorates functions, coroutine functions, generator functions "
            f"and context-manager classes; got {target!r} ({type(target).__name__}). "
            "To scope a block, use it as `with ...:` instead."
        )
    fn = cast(Callable[..., Any], target)
    if inspect.isasyncgenfunction(fn):
        return cast(_T, wrap_async_generator(scope, fn))
    if inspect.isgeneratorfunction(fn):
        return cast(_T, wrap_generator(scope, fn))
    if inspect.iscoroutinefunction(fn):
        return cast(_T, wrap_coroutine(scope, fn))
    return cast(_T, wrap_function(scope, fn))
