"""verl's allocator toggle, keeping the user's settings; its colocated update, restored on failure.

verl's ``set_expandable_segments(enable)`` (``verl/utils/device.py``) writes
``expandable_segments:{enable}`` through torch's setter, which on every torch (2.4 to
2.15) resets ``max_split_size_mb``, ``garbage_collection_threshold`` and
``roundup_power2_divisions`` to their defaults (and, from 2.11,
``max_non_split_rounding_mb``). :func:`set_expandable_segments` sets
the process default through hybridmem's engine instead: every other setting is kept,
cached blocks of the old kind are released when the mode changes, and an explicit
``expandable_segments:False`` in the user's env is never overridden by an enable.

verl's colocated ``update_weights`` (``verl/workers/engine_workers.py``) turns
expandable segments off, wakes the engine, syncs, offloads, wakes the KV cache and
turns them on again, with nothing restored if a stage raises: :func:`restored_on_failure`
wraps it so that a failure puts the allocator mode back as it was before the call and
releases the cache the failed stages left, then re-raises with a note saying so.

Scope: process-global (the allocator's settings).
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from hybridmem._checks import check_bool
from hybridmem._log import info_once, logger
from hybridmem.allocator.state import ENGINE, allocator_state
from hybridmem.scopes.allocator import set_allocator_defaults
from hybridmem.scopes.release import release_cache

__all__ = ["restored_on_failure", "set_expandable_segments"]

_R = TypeVar("_R")

# True while an update wrapped by restored_on_failure runs in this task: a wrapper
# nested inside it passes through, so one failure is restored and reported once.
_restoring: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "hybridmem_verl_restoring", default=False
)


def set_expandable_segments(enable: bool) -> None:
    """verl's ``set_expandable_segments``: the process's mode, every other setting kept.

    Args:
        enable: True for expandable segments (training), False for classic ones
            (the rollout engine's pool, CUDA IPC without ``pidfd_getfd``).

    Raises:
        TypeError: ``enable`` is not a bool.

    Scope: process-global, as verl's is.

    Example:
        >>> from hybridmem import allocator_state
        >>> set_expandable_segments(True)   # training
        >>> allocator_state().expandable_segments
        True
        >>> set_expandable_segments(False)  # the rollout's pool
        >>> allocator_state().expandable_segments
        False
    """
    check_bool("enable", enable)
    if enable and ENGINE.env_expandable_false() is not None:
        info_once(
            "verl-respect-env",
            "verl's set_expandable_segments(True): kept expandable segments off, as the "
            "env sets expandable_segments:False explicitly",
        )
        return
    # Disabling is always allowed; an enable overrides only an env that enables too.
    set_allocator_defaults(expandable_segments=enable, force=True)


def restored_on_failure(
    update: Callable[..., Awaitable[_R]],
) -> Callable[..., Awaitable[_R]]:
    """Wrap verl's async ``update_weights``: a failure restores the allocator mode and releases.

    Args:
        update: the coroutine function (a method: ``self`` is passed through).

    Returns:
        The wrapped coroutine function; on success it returns what ``update`` does.

    Example:
        >>> import asyncio
        >>> from hybridmem import allocator_state
        >>> class Worker:  # verl's ActorRolloutRefWorker, as far as this goes
        ...     async def update_weights(self):
        ...         set_expandable_segments(False)
        ...         raise RuntimeError("the rollout did not wake")
        >>> Worker.update_weights = restored_on_failure(Worker.update_weights)
        >>> set_expandable_segments(True)  # training
        >>> asyncio.run(Worker().update_weights())
        Traceback (most recent call last):
        RuntimeError: the rollout did not wake...
        >>> allocator_state().expandable_segments  # as before the call
        True
        >>> set_expandable_segments(False)
    """
    if getattr(update, "__hybridmem_restored__", False):
        return update

    @functools.wraps(update)
    async def wrapper(*args: Any, **kwargs: Any) -> _R:
        if _restoring.get():
            # Inside another restored_on_failure (a subclass's override kept over the
            # one install() put on verl's method): that one restores, says so once.
            return await update(*args, **kwargs)
        before = allocator_state().expandable_segments
        armed = _restoring.set(True)
        try:
            return await update(*args, **kwargs)
        except BaseException as exc:
            set_expandable_segments(before)
            report = release_cache()
            logger.warning(
                "verl's update_weights failed (%s); expandable segments are back to %s and "
                "the cache was released (%s)",
                type(exc).__name__,
                before,
                report,
            )
            note = getattr(exc, "add_note", None)  # Python 3.11+
            if note is not None:
                note(
                    f"hybridmem: expandable_segments is back to {before}, every other "
                    "allocator setting kept, and the cache the failed stages left was "
                    "released; the engine may still be awake (as the failed stage left it)"
                )
            raise
        finally:
            _restoring.reset(armed)

    wrapper.__hybridmem_restored__ = True  # type: ignore[attr-defined]
    return wrapper
