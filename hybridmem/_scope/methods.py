"""A scope on a context manager's ``__enter__``: what it covers, decided per scope.

A sharding manager's author stacks decorators on ``__enter__`` (where the engine wakes
and the weights are synced) and means the state they set to hold through the ``with``
block (the rollout)::

    class ShardingManager:
        @hm.expandable_segments(False)
        @hm.ipc_safe()
        def __enter__(self): ...

A scope that holds a state (allocator scopes, an offload, a recording, the train and
rollout phases) therefore treats ``@scope`` on a class body's ``__enter__`` or
``__aenter__`` exactly as ``@scope`` on the class for that protocol: it is entered
before ``__enter__`` runs and left after the matching ``__exit__``, whatever either
raises. A scope that is an action at one moment (a cache release; the wake_up,
weight_sync and sleep phases, which are the work ``__enter__`` and ``__exit__`` do)
stays on the call it decorates. ``__exit__`` and every other method keep the scope on
their own call. docs/phases.md has the table.

The class does not exist yet when the decorator runs, so the decorator returns a
:class:`SpanningEnter`, which finishes the job in ``__set_name__``, when Python
creates the class. Where that never happens (another decorator wraps it, or it is
assigned to a class later), the first call warns once and the scope covers only the
call, as it says.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from typing import Any

from hybridmem._log import warn_at, warn_once
from hybridmem._scope.classes import decorate_class
from hybridmem._scope.functions import Scope

__all__ = ["ENTER_METHODS", "SpanningEnter", "is_class_body_enter"]

#: An entering method's name -> (the exiting method that ends its block, async).
ENTER_METHODS: dict[str, tuple[str, bool]] = {
    "__enter__": ("__exit__", False),
    "__aenter__": ("__aexit__", True),
}


def is_class_body_enter(target: object) -> bool:
    """True for a function written as ``__enter__``/``__aenter__`` in a class body."""
    name = getattr(target, "__name__", None)
    if name not in ENTER_METHODS or not callable(target):
        return False
    owner, _, _ = str(getattr(target, "__qualname__", "")).rpartition(".")
    return bool(owner) and not owner.endswith("<locals>")


class SpanningEnter:
    """An ``__enter__`` whose scopes span each ``with`` block, until its class exists.

    Args:
        method: the method as written (call-only scopes already wrapped around it).
        scopes: the spanning scopes, innermost first.
        wrap_call: how a scope wraps a single call (the fallback where no class
            takes this object).
    """

    def __init__(
        self,
        method: Callable[..., Any],
        scopes: tuple[Scope, ...],
        wrap_call: Callable[[Any, Callable[..., Any]], Callable[..., Any]],
    ) -> None:
        self.method = method
        self.scopes = scopes
        self._wrap_call = wrap_call
        self._fallback: Callable[..., Any] | None = None
        functools.update_wrapper(self, method)

    def with_scope(self, scope: Scope, *, spans: bool) -> SpanningEnter:
        """This method with ``scope`` stacked on top (spanning or on the call only)."""
        if spans:
            return SpanningEnter(self.method, (*self.scopes, scope), self._wrap_call)
        # A call-only scope written outside spanning ones still runs inside them: the
        # spanning scopes are entered before the method is called at all.
        return SpanningEnter(self._wrap_call(scope, self.method), self.scopes, self._wrap_call)

    def __set_name__(self, owner: type, name: str) -> None:
        exit_name, is_async = ENTER_METHODS.get(name, (None, False))
        if exit_name is None or not callable(getattr(owner, exit_name, None)):
            why = (
                f"it was assigned as {name!r}"
                if exit_name is None
                else f"{owner.__qualname__} has no {exit_name}"
            )
            warn_once(
                f"spanning-enter:{owner.__qualname__}.{name}",
                f"{self._names()} on {owner.__qualname__}.{name} cover only that call: {why}. "
                f"Define {exit_name or '__exit__'} so the scopes can span the `with` block.",
            )
            setattr(owner, name, self._call_only())
            return
        setattr(owner, name, self.method)
        for scope in self.scopes:  # innermost first: the last one wraps the others
            decorate_class(scope, owner, is_async=is_async)

    def __get__(self, instance: object, owner: type | None = None) -> Any:
        return self if instance is None else types.MethodType(self, instance)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._fallback is None:
            code = getattr(inspect.unwrap(self.method), "__code__", None)
            where = f"spanning-enter-unbound:{self.__qualname__}"  # type: ignore[attr-defined]
            said = (
                f"{self._names()} on {self.__qualname__} covers only the call, not the "  # type: ignore[attr-defined]
                "`with` block: another decorator wraps it (or it was assigned after the "
                "class was made); put hybridmem's decorators outermost, or decorate the class"
            )
            if code is None:
                warn_once(where, said)
            else:
                warn_at(where, said, code)
            self._fallback = self._call_only()
        return self._fallback(*args, **kwargs)

    def _call_only(self) -> Callable[..., Any]:
        method = self.method
        for scope in self.scopes:
            method = self._wrap_call(scope, method)
        return method

    def _names(self) -> str:
        return ", ".join(f"@{scope!r}" for scope in reversed(self.scopes))
