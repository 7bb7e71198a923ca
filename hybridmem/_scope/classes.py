"""Decorating a context-manager class: the scope spans each ``with`` block of its instances.

The class's ``__enter__``/``__exit__`` (and ``__aenter__``/``__aexit__``) are wrapped,
and so are those a subclass defines later (``__init_subclass__``), so that every
``with`` statement enters the scope exactly once, ``super()`` chains included.

One template for sync and async: each protocol (enter, exit) is written
once as a generator that yields the steps to take (enter the scope, call the class's
own method, exit the scope) and receives their results; :func:`_run` performs the
steps, :func:`_arun` awaits them. The price of sharing: a step that raises
``StopIteration`` reaches the caller as ``RuntimeError`` (PEP 479), as from any
generator.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Generator
from typing import Any

from hybridmem._scope.functions import Scope

__all__ = ["decorate_class"]

# The steps a protocol yields: (CALL,) the class's own method; (ENTER, ctx) the scope's
# entry; (EXIT, ctx, type, value, traceback) its exit.
_CALL, _ENTER, _EXIT = "call", "enter", "exit"
_Protocol = Generator[tuple[Any, ...], Any, Any]
# (entering method, exiting method, async), indexed by async.
_PROTOCOLS = (("__enter__", "__exit__", False), ("__aenter__", "__aexit__", True))


def decorate_class(scope: Scope, cls: type, *, is_async: bool | None = None) -> type:
    """Make ``scope`` span every ``with`` block of ``cls``'s instances (and its subclasses').

    Args:
        scope: the scope.
        cls: a context-manager class.
        is_async: None spans both protocols the class has; False only ``with``
            blocks, True only ``async with`` blocks (a scope written on
            ``__enter__`` or ``__aenter__``).
    """
    protocols = _PROTOCOLS if is_async is None else (_PROTOCOLS[is_async],)
    if not any(_has(cls, enter, exit_) for enter, exit_, _ in protocols):
        raise TypeError(
            f"{scope!r} can decorate a class only if it is a context manager "
            f"(defines __enter__/__exit__ or __aenter__/__aexit__); {cls.__qualname__} "
            "is not. Decorate its methods instead."
        )
    stacks = _InstanceStacks()
    _patch_level(scope, cls, stacks, protocols, force=True)
    # A subclass that overrides __enter__/__exit__ (calling super() or not) is
    # wrapped too, so every `with` statement enters the scope exactly once.
    owner: Any = cls
    previous = cls.__dict__.get("__init_subclass__")

    def __init_subclass__(sub: Any, /, **kwargs: Any) -> None:
        if previous is not None:
            previous.__get__(None, sub)(**kwargs)
        else:
            super(owner, sub).__init_subclass__(**kwargs)
        _patch_level(scope, sub, stacks, protocols, force=False)

    owner.__init_subclass__ = classmethod(__init_subclass__)
    return cls


def _has(cls: type, enter: str, exit_: str) -> bool:
    return callable(getattr(cls, enter, None)) and callable(getattr(cls, exit_, None))


def _patch_level(
    scope: Scope,
    cls: type,
    stacks: _InstanceStacks,
    protocols: tuple[tuple[str, str, bool], ...],
    *,
    force: bool,
) -> None:
    """Wrap the context-manager methods this class level defines (all, if ``force``)."""
    own = cls.__dict__
    for enter, exit_, is_async in protocols:
        if not _has(cls, enter, exit_):
            continue
        for name, protocol in ((enter, _entering), (exit_, _exiting)):
            if force or name in own:
                method = getattr(cls, name)
                setattr(cls, name, _wrapped(scope, method, stacks, protocol, name, is_async))


def _outermost(
    protocol: Callable[..., _Protocol],
    scope: Scope,
    stacks: _InstanceStacks,
    instance: Any,
    kind: str,
    exc: tuple[Any, ...],
) -> _Protocol:
    """``protocol`` for the outermost call of ``kind`` on ``instance``; else pass through.

    A subclass's ``__enter__`` calling ``super().__enter__()`` runs two wrapped levels
    in one call: only the outermost enters (or exits) the scope.
    """
    outermost = stacks.begin_call(instance, kind)
    try:
        if not outermost:  # inside a super() chain
            return (yield (_CALL,))
        return (yield from protocol(scope, stacks, instance, exc))
    finally:
        stacks.end_call(instance, kind)


def _entering(
    scope: Scope, stacks: _InstanceStacks, instance: Any, _exc: tuple[Any, ...]
) -> _Protocol:
    """Enter a fresh copy of the scope, then the class's own ``__enter__``."""
    ctx = scope._recreate()
    yield (_ENTER, ctx)
    try:
        result = yield (_CALL,)
    except BaseException as exc:
        yield (_EXIT, ctx, type(exc), exc, exc.__traceback__)
        raise
    stacks.push(instance, ctx)
    return result


def _exiting(
    scope: Scope, stacks: _InstanceStacks, instance: Any, exc: tuple[Any, ...]
) -> _Protocol:
    """The class's own ``__exit__``, then the scope's (told of a suppressed exception)."""
    ctx = stacks.pop(instance)
    try:
        suppress = yield (_CALL,)
    except BaseException as raised:
        yield (_EXIT, ctx, type(raised), raised, raised.__traceback__)
        raise
    yield (_EXIT, ctx, None, None, None) if suppress else (_EXIT, ctx, *exc)
    return suppress


def _run(protocol: _Protocol, call: Callable[[], Any]) -> Any:
    """Perform a protocol's steps synchronously; return what it returns."""
    step = next(protocol)
    while True:
        try:
            if step[0] == _CALL:
                value = call()
            elif step[0] == _ENTER:
                value = step[1].__enter__()
            else:
                value = step[1].__exit__(*step[2:])
        except BaseException as exc:
            try:
                step = protocol.throw(exc)
            except StopIteration as stop:
                return stop.value
        else:
            try:
                step = protocol.send(value)
            except StopIteration as stop:
                return stop.value


async def _arun(protocol: _Protocol, call: Callable[[], Any]) -> Any:
    """Perform a protocol's steps, awaiting each; return what it returns."""
    step = next(protocol)
    while True:
        try:
            if step[0] == _CALL:
                value = await call()
            elif step[0] == _ENTER:
                value = await step[1].__aenter__()
            else:
                value = await step[1].__aexit__(*step[2:])
        except BaseException as exc:
            try:
                step = protocol.throw(exc)
            except StopIteration as stop:
                return stop.value
        else:
            try:
                step = protocol.send(value)
            except StopIteration as stop:
                return stop.value


def _wrapped(
    scope: Scope,
    original: Any,
    stacks: _InstanceStacks,
    protocol: Callable[..., _Protocol],
    name: str,
    is_async: bool,
) -> Any:
    """``original`` (the class's method ``name``) with ``protocol`` around it."""
    if getattr(original, "__hybridmem_scope__", None) is stacks:
        return original  # this level already wraps it (inherited wrapper)
    kind = name.strip("_")  # "enter", "aexit": calls in progress are counted per kind
    wrapper: Any
    if is_async:

        @functools.wraps(original)
        async def wrapper(instance: Any, *exc: Any) -> Any:
            steps = _outermost(protocol, scope, stacks, instance, kind, exc)
            return await _arun(steps, lambda: original(instance, *exc))

    else:

        @functools.wraps(original)
        def wrapper(instance: Any, *exc: Any) -> Any:
            steps = _outermost(protocol, scope, stacks, instance, kind, exc)
            return _run(steps, lambda: original(instance, *exc))

    wrapper.__hybridmem_scope__ = stacks
    return wrapper


class _InstanceStacks:
    """Contexts entered for each live instance of a decorated class.

    Keyed by ``id(instance)`` so that classes with ``__slots__`` or without hashing
    work; an entry is dropped as soon as its instance's stack is empty.
    """

    def __init__(self) -> None:
        self._stacks: dict[int, list[Any]] = {}
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

    def push(self, instance: object, ctx: Any) -> None:
        with self._lock:
            self._stacks.setdefault(id(instance), []).append(ctx)

    def pop(self, instance: object) -> Any:
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
