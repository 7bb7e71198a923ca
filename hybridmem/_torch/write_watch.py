"""torch 2.10 - 2.11: the last allocator-settings string, seen where it is written.

torch 2.12+ answers "what string was set last, by anyone" with a getter that costs
microseconds. torch 2.10 - 2.11 has no getter: the string is in the allocator
snapshot only (``torch.cuda.memory._snapshot()["allocator_settings"]``), and a
snapshot walks every block of every segment, even when asked for one pool: 0.3 ms at
100 live blocks, 26 ms at 50,000 on an H100 (``benchmarks/scope_cost.py``). hybridmem
needs the string at every scope entry and exit, to see a write made outside it (vLLM's
sleep-mode pool toggles expandable segments, verl writes ``expandable_segments:<bool>``).

So on these versions the string is kept where it is written. The one Python entry to
torch's parser, ``torch._C._accelerator_setAllocatorSettings`` (which
``torch.cuda.memory._set_allocator_settings``, vLLM's ``set_alloc_conf`` and verl's
platform setter all look up when they call), is replaced by a function that notes the
string and calls torch's own: the note is what torch's 2.12 getter would say. The
string in force when the watch starts is read from the snapshot, before the wrapper goes
in and once more after it (a write another thread made in between is not lost).

What the watch cannot see is a call that does not look the name up: a reference to
torch's function bound before the watch started (``from torch._C import ...`` at
module level, a closure, a ``functools.partial``), or a C++ caller. The first kind is
looked for when the watch starts (the objects that refer to torch's function,
``gc.get_referrers``: a dict holding it as a value, a closure cell, a partial; not the
interpreter's init-time copy of ``torch._C``'s namespace, which nothing calls through); where
one is found the watch does not start, and every read is a snapshot as before, said
once at INFO with where the reference is. A C++ caller of ``parseArgs`` is not looked
for: none is known (torch's own code does not call it; vLLM's and verl's go through
Python).

Scope: process-global; thread-safe (a tuple assignment notes each string).
"""

from __future__ import annotations

import functools
import gc
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

from hybridmem._log import logger

__all__ = ["WriteWatch"]


class WriteWatch:
    """The last settings string given to ``owner.name``, noted by a wrapper around it.

    Args:
        owner: the module that holds torch's setter (``torch._C``).
        name: the setter's attribute name (``"_accelerator_setAllocatorSettings"``).
        read_snapshot: reads the last string from the allocator snapshot (costly):
            when the watch starts (twice), and on every read where it cannot start.

    Example:
        >>> import types
        >>> calls = []
        >>> owner = types.SimpleNamespace(setter=calls.append)
        >>> watch = WriteWatch(owner, "setter", lambda: "")
        >>> watch.last()  # starts the watch: the string in force is read
        ''
        >>> owner.setter("expandable_segments:True")  # anyone's call, through the name
        >>> watch.last(), calls
        ('expandable_segments:True', ['expandable_segments:True'])
        >>> watch.stop()
        >>> owner.setter == calls.append
        True
    """

    def __init__(self, owner: object, name: str, read_snapshot: Callable[[], str | None]) -> None:
        self._owner = owner
        self._name = name
        self._read_snapshot = read_snapshot
        self._lock = threading.Lock()
        self._original: Callable[[str], Any] | None = None
        self._wrapper: Callable[[str], Any] | None = None
        # None: not started; a str: the last string; _SNAPSHOT: reads go to the snapshot
        self._last: object = None
        self.captured: tuple[str, ...] = ()  # where a reference bypasses the watch

    @property
    def started(self) -> bool:
        """True once the string in force was read (the watch in place, or snapshot reads)."""
        return self._last is not None

    @property
    def watching(self) -> bool:
        """True while the wrapper is in place (reads cost nothing)."""
        return self._wrapper is not None

    def last(self) -> str | None:
        """The last settings string torch was given, by anyone (None: not readable)."""
        last = self._last
        if type(last) is str:  # the hot path: the string the wrapper noted
            return last
        if last is _SNAPSHOT:
            return self._read_snapshot()
        return self._start()

    def _start(self) -> str | None:
        with self._lock:
            if self._last is not None:
                return self.last()
            now = self._read_snapshot()
            if now is None:
                return None  # the snapshot cannot say yet: try again at the next read
            original = getattr(self._owner, self._name, None)
            if not callable(original):
                self._last = _SNAPSHOT
                return now
            captured = _bound_elsewhere(original, self._owner)
            if captured:
                self.captured = captured
                self._last = _SNAPSHOT
                logger.info(
                    "allocator settings: %s is also held by %s, which would write without "
                    "being seen; hybridmem reads the allocator snapshot at each scope instead "
                    "(a walk of every live block; torch 2.12+ has a getter)",
                    self._name,
                    ", ".join(captured),
                )
                return now
            wrapper = _noting(self, original)
            self._last = now  # before the wrapper is in place: a note from then on wins
            try:
                setattr(self._owner, self._name, wrapper)
            except (AttributeError, TypeError):  # a module that refuses new attributes
                self._last = _SNAPSHOT
                return now
            self._original, self._wrapper = original, wrapper
            # a write made by another thread between the first read and the wrapper
            again = self._read_snapshot()
            if self._last is now and again is not None:
                self._last = again
            logger.debug("allocator settings: writes noted at %s (no getter)", self._name)
            return self.last()

    def note(self, settings: object) -> None:
        """Note ``settings`` as the last string given (a str only, as torch takes)."""
        if type(settings) is str:
            self._last = settings

    def stop(self) -> None:
        """Put torch's own setter back (where the wrapper is still in place) and forget."""
        with self._lock:
            if self._wrapper is not None and getattr(self._owner, self._name, None) is (
                self._wrapper
            ):
                setattr(self._owner, self._name, self._original)
            self._original = self._wrapper = None
            self._last = None
            self.captured = ()


_SNAPSHOT = object()  # the watch could not start: every read is a snapshot
_NONE = object()


def _noting(watch: WriteWatch, original: Callable[[str], Any]) -> Callable[[str], Any]:
    """``original`` behind a function that notes each string on ``watch`` first.

    torch notes the string before it parses it, so a refused string is noted too; what
    ``original`` returns or raises passes through unchanged.
    """
    note = watch.note

    @functools.wraps(original)
    def set_allocator_settings(settings: str) -> Any:
        note(settings)
        return original(settings)

    return set_allocator_settings


def _bound_elsewhere(function: object, owner: object) -> tuple[str, ...]:
    """Where a reference to ``function`` would call it without looking its name up.

    Every object that refers to it but ``owner``'s namespace, frames (locals of calls
    running now), dicts that hold it only as a key (torch.compile's rule maps), and the
    interpreter's init-time copy of ``owner``'s namespace (see ``_init_copy``).
    """
    home = getattr(owner, "__dict__", None)
    found: list[str] = []
    referrers = gc.get_referrers(function)
    for referrer in referrers:
        if referrer is home or isinstance(referrer, types.FrameType):
            continue
        if isinstance(referrer, dict) and _init_copy(referrer, owner, referrers):
            continue
        if isinstance(referrer, dict):
            # a loop, not a comprehension: one would hold `function` in a cell of its own
            name: object = _NONE
            for key, value in referrer.items():
                if value is function:
                    name = key
                    break
            if name is _NONE:
                continue  # a key only: never called through
            found.append(_describe(referrer, name))
        else:
            found.append(type(referrer).__name__)
    return tuple(found)


def _init_copy(namespace: dict[Any, Any], owner: object, referrers: list[Any]) -> bool:
    """True for the interpreter's copy of ``owner``'s namespace as its init left it.

    For an extension module of single-phase init (``torch._C`` is one) CPython keeps a
    copy of the module's dict as ``PyInit`` left it, in the module's C definition, to
    fill the module again should it be imported afresh after leaving ``sys.modules``.
    Nothing calls through that copy, and no Python object refers to it: that, and
    the owner's ``__name__``, is how it is told from a namespace someone could call
    through (seen on torch 2.11's CUDA build under CPython 3.12; not on every build).
    """
    name = getattr(owner, "__name__", None)
    if name is None or namespace.get("__name__") != name:
        return False
    return all(
        holder is referrers or isinstance(holder, types.FrameType)
        for holder in gc.get_referrers(namespace)
    )


def _describe(namespace: dict[Any, Any], name: object) -> str:
    """``module.name`` for a module's namespace, else ``a dict (name)``."""
    for module_name, module in list(sys.modules.items()):
        if getattr(module, "__dict__", None) is namespace:
            return f"{module_name}.{name}"
    return f"a dict ({name!r})"
