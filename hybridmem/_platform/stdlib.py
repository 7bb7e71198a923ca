"""The three corners of the standard library that hybridmem reaches past its public API.

Each is guarded, with the Python versions it applies to, so the rest of the package
never names a private attribute.

Scope: process-global, thread-safe (both are reads).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Callable
from multiprocessing import resource_tracker, shared_memory
from multiprocessing.reduction import ForkingPickler
from typing import Any

__all__ = ["attach_shared_memory", "forking_reducer", "running_loop", "unlink_shared_memory"]

#: The running event loop of this thread, or None, without raising.
#: ``asyncio._get_running_loop`` (Python 3.7+; listed in ``asyncio.events.__all__``
#: for event-loop implementations): the public ``get_running_loop`` raises
#: RuntimeError outside a loop, and every scope entry and exit asks (hot path).
running_loop: Callable[[], asyncio.AbstractEventLoop | None] = asyncio._get_running_loop


def attach_shared_memory(name: str, *, own_process: bool = False) -> shared_memory.SharedMemory:
    """Open another process's shared memory segment without ever unlinking it.

    Python 3.13+: ``SharedMemory(track=False)``. Before, attaching registers the
    segment with this process's resource tracker, which unlinks it when this
    process exits (the producer's segment, gone); it is unregistered under the
    name the tracker was given (POSIX: with its leading slash). Where the segment
    was made by this very process (``own_process=True``: a producer and its
    receiver in one process, as vLLM's in-process engine runs), the registration is
    the producer's own and stays: unregistering it would make the producer's later
    ``unlink`` fail inside the tracker (``KeyError``).

    Example:
        >>> shm = attach_shared_memory("psm_1234")   # doctest: +SKIP
    """
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)
    shm = shared_memory.SharedMemory(name=name)
    if own_process:
        return shm
    with contextlib.suppress(Exception):
        resource_tracker.unregister(_tracked_name(name), "shared_memory")
    return shm


def _tracked_name(name: str) -> str:
    return name if name.startswith("/") or sys.platform == "win32" else "/" + name


def unlink_shared_memory(shm: shared_memory.SharedMemory) -> bool:
    """Remove the name of a segment this process created, whoever unregistered it.

    A receiver attaching on Python < 3.13 unregisters the name from *its* resource
    tracker, and a process started by ``multiprocessing`` (a spawned receiver,
    vLLM's engine core) shares its parent's: the producer's registration is then
    gone, and ``SharedMemory.unlink`` (which unregisters) makes the tracker print
    a ``KeyError`` traceback. Registering again first (the tracker keeps a set)
    makes the pair balance in every case.

    Returns:
        True if the name was removed, False if it was gone already.
    """
    tracked = _tracked_name(shm.name)
    with contextlib.suppress(Exception):
        resource_tracker.register(tracked, "shared_memory")
    try:
        shm.unlink()
    except FileNotFoundError:
        with contextlib.suppress(Exception):
            resource_tracker.unregister(tracked, "shared_memory")
        return False
    return True


def forking_reducer(cls: type) -> Any:
    """Return the reducer registered for ``cls`` with ``ForkingPickler.register``, or None.

    ``ForkingPickler`` (what ``multiprocessing`` queues and pipes pickle with) has a
    public ``register`` but no public getter; the registry is the class attribute
    ``_extra_reducers`` (Python 3.4 to 3.14). A scope that registers its own reducer
    reads the previous one here, to put it back on exit.
    """
    registry = getattr(ForkingPickler, "_extra_reducers", None)
    return registry.get(cls) if isinstance(registry, dict) else None
