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

One module per job:

- :mod:`~hybridmem._scope.context`: the base, its token stacks, ``with`` and
  ``async with``, and the decorator's dispatch on the kind of target;
- :mod:`~hybridmem._scope.functions`: wrapping functions, coroutine functions,
  generator and async-generator functions;
- :mod:`~hybridmem._scope.classes`: decorating context-manager classes, the sync and
  async methods from one template.
"""

from __future__ import annotations

from hybridmem._scope.context import ScopedContext

__all__ = ["ScopedContext"]
