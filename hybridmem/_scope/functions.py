"""What a decorated function, coroutine, generator or async generator becomes.

Each call gets a fresh copy of the scope (``scope._recreate()``), as
``torch/utils/_contextlib.py`` does, so calls on several threads or tasks never share
one entry.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import types
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Generator
from typing import Any, Protocol, TypeVar, cast

from hybridmem._log import warn_once

__all__ = [
    "Scope",
    "is_async_callable",
    "wrap_async_generator",
    "wrap_coroutine",
    "wrap_function",
    "wrap_generator",
]

_T = TypeVar("_T")


class Scope(Protocol):
    """What the wrappers need of a ScopedContext (the base imports this module, not it the base)."""

    def _recreate(self) -> Any:
        """A fresh, unentered copy: a context manager, sync and async."""


# What a plain function may return whose work runs after the call returned.
_DEFERRED = (types.CoroutineType, types.GeneratorType, types.AsyncGeneratorType, asyncio.Future)


def wrap_function(scope: Scope, fn: Callable[..., _T]) -> Callable[..., _T]:
    """The scope around each call; around the awaited body if the call returns a coroutine."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> _T:
        with scope._recreate():
            result = fn(*args, **kwargs)
        # the common case: a plain value (two type checks)
        if not isinstance(result, _DEFERRED) and not hasattr(type(result), "__await__"):
            return result
        if isinstance(result, (types.CoroutineType, Coroutine)):
            # A sync function that hands back a coroutine (a wrapper of an async def,
            # or a compiled one): its body runs when awaited, so the scope must be
            # there then.
            return cast(_T, _span(scope, result))
        name = getattr(fn, "__qualname__", repr(fn))
        kind = type(result).__name__
        if not isinstance(result, _DEFERRED):
            # an awaitable of another kind (an engine's future, a Ray ref): whatever it
            # does when awaited runs after the scope; it is handed back as it is, since
            # its caller may need what it is, not a coroutine around it
            kind += " (an awaitable)"
        warn_once(
            f"decorated-returns:{name}",
            f"{scope!r} decorates {name!r}, which returned a {kind}: the scope covered "
            "only the call that made it, not the work it does later. Decorate the async "
            "def or generator function itself, or use `with` / `async with` where the "
            "work runs.",
        )
        return result

    return wrapper


async def _span(scope: Scope, coroutine: Coroutine[Any, Any, _T]) -> _T:
    async with scope._recreate():
        return await coroutine


def wrap_coroutine(scope: Scope, fn: Callable[..., Awaitable[_T]]) -> Callable[..., Awaitable[_T]]:
    """The scope around the awaited body of each call."""

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> _T:
        async with scope._recreate():
            return await fn(*args, **kwargs)

    return wrapper


def wrap_generator(
    scope: Scope, fn: Callable[..., Generator[Any, Any, Any]]
) -> Callable[..., Generator[Any, Any, Any]]:
    """The scope around each stretch of the body, left at every ``yield``."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Generator[Any, Any, Any]:
        ctx = scope._recreate()
        gen = fn(*args, **kwargs)
        try:
            with ctx:
                response = gen.send(None)
            while True:
                try:
                    request = yield response
                except GeneratorExit:
                    with ctx:
                        gen.close()
                    raise
                except BaseException as exc:
                    with ctx:
                        response = gen.throw(exc)
                else:
                    with ctx:
                        response = gen.send(request)
        except StopIteration as stop:
            return stop.value

    return wrapper


def wrap_async_generator(
    scope: Scope, fn: Callable[..., AsyncGenerator[Any, Any]]
) -> Callable[..., AsyncGenerator[Any, Any]]:
    """The scope around each stretch of the body, left at every ``yield``."""

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> AsyncGenerator[Any, Any]:
        ctx = scope._recreate()
        agen = fn(*args, **kwargs)
        try:
            async with ctx:
                response = await agen.asend(None)
            while True:
                try:
                    request = yield response
                except GeneratorExit:
                    async with ctx:
                        await agen.aclose()
                    raise
                except BaseException as exc:
                    async with ctx:
                        response = await agen.athrow(exc)
                else:
                    async with ctx:
                        response = await agen.asend(request)
        except StopAsyncIteration:
            return

    return wrapper


def is_async_callable(target: object) -> bool:
    """An object whose ``__call__`` is ``async def`` (a class with an async __call__)."""
    call = getattr(type(target), "__call__", None)  # noqa: B004 - the method itself is needed
    return call is not None and inspect.iscoroutinefunction(call)
