"""One base class that makes every primitive a context manager and a decorator.

A :class:`ScopedContext` is usable as ``with x:``, ``async with x:``, and as a
decorator on plain functions, coroutine functions (the context spans the awaited
body), generator and async-generator functions (the context is active while the
body runs and restored at each ``yield``), and on context-manager classes (the
context is entered before the class's ``__enter__``/``__aenter__`` and exited after
its ``__exit__``/``__aexit__``, so it spans the managed block).

Why not :class:`contextlib.ContextDecorator`? Decorating an ``async def`` with it
enters and exits around the creation of the coroutine, before the body runs, and
it knows nothing about generators or classes. We dispatch on the kind of target
ourselves, as ``unittest.mock._patch.__call__`` does, and give each decorated call
fresh state, as ``torch/utils/_contextlib.py`` does. (The standard library already
has every piece of ``contextlib2``; hybridmem needs neither.)
"""

from __future__ import annotations

import abc
import asyncio
import asyncio.events
import copy
import functools
import inspect
import threading
import types
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Generator
from types import TracebackType
from typing import Any, TypeVar, cast

from hybridmem._env import disabled
from hybridmem._log import warn_once
from hybridmem._platform.stdlib import running_loop

__all__ = ["ScopedContext"]

_Self = TypeVar("_Self", bound="ScopedContext")
_T = TypeVar("_T")

_DISABLED = object()  # token of an entry made while the kill switch was on
# What a plain function may return whose work runs after the call returned.
_DEFERRED = (types.CoroutineType, types.GeneratorType, types.AsyncGeneratorType, asyncio.Future)
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
        around the awaited coroutine too.
        """
        if isinstance(target, type):
            return cast(_T, self._decorate_class(target))
        if isinstance(target, (staticmethod, classmethod)):
            # Wrapping the descriptor itself would turn it into a plain function,
            # which a class then binds as an instance method.
            return cast(_T, type(target)(self(target.__func__)))
        if not inspect.isroutine(target) and _is_async_callable(target):
            return cast(_T, self._wrap_coroutine(cast(Callable[..., Awaitable[Any]], target)))
        if not callable(target):
            raise TypeError(
                f"{self!r} decorates functions, coroutine functions, generator functions "
                f"and context-manager classes; got {target!r} ({type(target).__name__}). "
                "To scope a block, use it as `with ...:` instead."
            )
        fn = cast(Callable[..., Any], target)
        if inspect.isasyncgenfunction(fn):
            return cast(_T, self._wrap_async_generator(fn))
        if inspect.isgeneratorfunction(fn):
            return cast(_T, self._wrap_generator(fn))
        if inspect.iscoroutinefunction(fn):
            return cast(_T, self._wrap_coroutine(fn))
        return cast(_T, self._wrap_function(fn))

    def _wrap_function(self, fn: Callable[..., _T]) -> Callable[..., _T]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> _T:
            with self._recreate():
                result = fn(*args, **kwargs)
            if not isinstance(result, _DEFERRED):  # the common case: one type check
                return result
            if isinstance(result, types.CoroutineType):
                # A sync function that hands back a coroutine (a wrapper of an async
                # def): its body runs when awaited, so the scope must be there then.
                return cast(_T, self._span(result))
            name = getattr(fn, "__qualname__", repr(fn))
            warn_once(
                f"decorated-returns:{name}",
                f"{self!r} decorates {name!r}, which returned a {type(result).__name__}: "
                "the scope covered only the call that made it, not the work it does "
                "later. Decorate the async def or generator function itself, or use "
                "`with` / `async with` where the work runs.",
            )
            return result

        return wrapper

    async def _span(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        async with self._recreate():
            return await coroutine

    def _wrap_coroutine(self, fn: Callable[..., Awaitable[_T]]) -> Callable[..., Awaitable[_T]]:
        @functools.wraps(fn)
        async def wrapper(*args: Any, **kwargs: Any) -> _T:
            async with self._recreate():
                return await fn(*args, **kwargs)

        return wrapper

    def _wrap_generator(
        self, fn: Callable[..., Generator[Any, Any, Any]]
    ) -> Callable[..., Generator[Any, Any, Any]]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Generator[Any, Any, Any]:
            ctx = self._recreate()
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

    def _wrap_async_generator(
        self, fn: Callable[..., AsyncGenerator[Any, Any]]
    ) -> Callable[..., AsyncGenerator[Any, Any]]:
        @functools.wraps(fn)
        async def wrapper(*args: Any, **kwargs: Any) -> AsyncGenerator[Any, Any]:
            ctx = self._recreate()
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

    def _decorate_class(self, cls: type) -> type:
        has_sync = callable(getattr(cls, "__enter__", None)) and callable(
            getattr(cls, "__exit__", None)
        )
        has_async = callable(getattr(cls, "__aenter__", None)) and callable(
            getattr(cls, "__aexit__", None)
        )
        if not (has_sync or has_async):
            raise TypeError(
                f"{self!r} can decorate a class only if it is a context manager "
                f"(defines __enter__/__exit__ or __aenter__/__aexit__); {cls.__qualname__} "
                "is not. Decorate its methods instead."
            )
        stacks = _InstanceStacks()
        self._patch_level(cls, stacks, force=True)
        # A subclass that overrides __enter__/__exit__ (calling super() or not) is
        # wrapped too, so every `with` statement enters the scope exactly once.
        template = self
        owner: Any = cls
        previous = cls.__dict__.get("__init_subclass__")

        def __init_subclass__(sub: Any, /, **kwargs: Any) -> None:
            if previous is not None:
                previous.__get__(None, sub)(**kwargs)
            else:
                super(owner, sub).__init_subclass__(**kwargs)
            template._patch_level(sub, stacks, force=False)

        owner.__init_subclass__ = classmethod(__init_subclass__)
        return cls

    def _patch_level(self, cls: type, stacks: _InstanceStacks, *, force: bool) -> None:
        """Wrap the context-manager methods this class level defines (all, if ``force``)."""
        own = cls.__dict__
        for enter, exit_, is_async in (
            ("__enter__", "__exit__", False),
            ("__aenter__", "__aexit__", True),
        ):
            if not (callable(getattr(cls, enter, None)) and callable(getattr(cls, exit_, None))):
                continue
            if force or enter in own:
                setattr(cls, enter, self._wrapped_enter(getattr(cls, enter), stacks, is_async))
            if force or exit_ in own:
                setattr(cls, exit_, self._wrapped_exit(getattr(cls, exit_), stacks, is_async))

    def _wrapped_enter(self, original: Any, stacks: _InstanceStacks, is_async: bool) -> Any:
        template = self
        if getattr(original, "__hybridmem_scope__", None) is stacks:
            return original  # this level already wraps it (inherited wrapper)
        if not is_async:

            @functools.wraps(original)
            def __enter__(instance: Any) -> Any:
                if not stacks.begin_call(instance, "enter"):  # inside a super() chain
                    try:
                        return original(instance)
                    finally:
                        stacks.end_call(instance, "enter")
                try:
                    ctx = template._recreate()
                    ctx.__enter__()
                    try:
                        result = original(instance)
                    except BaseException as exc:
                        ctx.__exit__(type(exc), exc, exc.__traceback__)
                        raise
                    stacks.push(instance, ctx)
                    return result
                finally:
                    stacks.end_call(instance, "enter")

            __enter__.__hybridmem_scope__ = stacks  # type: ignore[attr-defined]
            return __enter__

        @functools.wraps(original)
        async def __aenter__(instance: Any) -> Any:
            if not stacks.begin_call(instance, "aenter"):
                try:
                    return await original(instance)
                finally:
                    stacks.end_call(instance, "aenter")
            try:
                ctx = template._recreate()
                await ctx.__aenter__()
                try:
                    result = await original(instance)
                except BaseException as exc:
                    await ctx.__aexit__(type(exc), exc, exc.__traceback__)
                    raise
                stacks.push(instance, ctx)
                return result
            finally:
                stacks.end_call(instance, "aenter")

        __aenter__.__hybridmem_scope__ = stacks  # type: ignore[attr-defined]
        return __aenter__

    def _wrapped_exit(self, original: Any, stacks: _InstanceStacks, is_async: bool) -> Any:
        if getattr(original, "__hybridmem_scope__", None) is stacks:
            return original
        if not is_async:

            @functools.wraps(original)
            def __exit__(instance: Any, et: Any, ev: Any, tb: Any) -> Any:
                if not stacks.begin_call(instance, "exit"):
                    try:
                        return original(instance, et, ev, tb)
                    finally:
                        stacks.end_call(instance, "exit")
                try:
                    ctx = stacks.pop(instance)
                    try:
                        suppress = original(instance, et, ev, tb)
                    except BaseException as exc:
                        ctx.__exit__(type(exc), exc, exc.__traceback__)
                        raise
                    if suppress:
                        ctx.__exit__(None, None, None)
                    else:
                        ctx.__exit__(et, ev, tb)
                    return suppress
                finally:
                    stacks.end_call(instance, "exit")

            __exit__.__hybridmem_scope__ = stacks  # type: ignore[attr-defined]
            return __exit__

        @functools.wraps(original)
        async def __aexit__(instance: Any, et: Any, ev: Any, tb: Any) -> Any:
            if not stacks.begin_call(instance, "aexit"):
                try:
                    return await original(instance, et, ev, tb)
                finally:
                    stacks.end_call(instance, "aexit")
            try:
                ctx = stacks.pop(instance)
                try:
                    suppress = await original(instance, et, ev, tb)
                except BaseException as exc:
                    await ctx.__aexit__(type(exc), exc, exc.__traceback__)
                    raise
                if suppress:
                    await ctx.__aexit__(None, None, None)
                else:
                    await ctx.__aexit__(et, ev, tb)
                return suppress
            finally:
                stacks.end_call(instance, "aexit")

        __aexit__.__hybridmem_scope__ = stacks  # type: ignore[attr-defined]
        return __aexit__


def _is_async_callable(target: object) -> bool:
    """An object whose ``__call__`` is ``async def`` (a class with an async __call__)."""
    call = getattr(type(target), "__call__", None)  # noqa: B004 - the method itself is needed
    return call is not None and inspect.iscoroutinefunction(call)


class _InstanceStacks:
    """Contexts entered for each live instance of a decorated class.

    Keyed by ``id(instance)`` so that classes with ``__slots__`` or without hashing
    work; an entry is dropped as soon as its instance's stack is empty.
    """

    def __init__(self) -> None:
        self._stacks: dict[int, list[ScopedContext]] = {}
        self._calls: dict[tuple[int, str], int] = {}  # calls in progress, by (instance, kind)
        self._lock = threading.Lock()

    def begin_call(self, instance: object, kind: str) -> bool:
        """Count a call of ``kind`` on ``instance``; True if it is the outermost one.

        A subclass's ``__enter__`` calling ``super().__enter__()`` runs two wrapped
        levels in one call: only the outermost enters (or exits) the scope.
        """
        key = (id(instance), kind)
        with self._lock:
            depth = self._calls.get(key, 0)
            self._calls[key] = depth + 1
            return depth == 0

    def end_call(self, instance: object, kind: str) -> None:
        key = (id(instance), kind)
        with self._lock:
            depth = self._calls.get(key, 1) - 1
            if depth:
                self._calls[key] = depth
            else:
                self._calls.pop(key, None)

    def push(self, instance: object, ctx: ScopedContext) -> None:
        with self._lock:
            self._stacks.setdefault(id(instance), []).append(ctx)

    def pop(self, instance: object) -> ScopedContext:
        with self._lock:
            stack = self._stacks.get(id(instance))
            if not stack:
                raise RuntimeError(
                    f"{type(instance).__qualname__}.__exit__ ran without a matching __enter__"
                )
            ctx = stack.pop()
            if not stack:
                del self._stacks[id(instance)]
            return ctx
