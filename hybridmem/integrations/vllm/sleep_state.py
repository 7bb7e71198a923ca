"""What vLLM's sleep-mode pool holds asleep now, read from the allocator vLLM loaded.

vLLM's ``CuMemAllocator`` (``vllm/device_allocator/cumem.py``) records each allocation
of its pool with its tag and whether it sleeps (its memory unmapped). A weight update
that writes into sleeping weights touches unmapped memory: vLLM segfaults instead of
refusing (vllm#57853). :func:`refuse_while_asleep` refuses first, with the state and the
fix, before anything is received or written.

Never imports vLLM: it reads the module vLLM (or
:func:`~hybridmem.integrations.vllm.sleep_files.load_cumem`) put in ``sys.modules``.
Scope: the calling process's pool; the allocator's own dict is read without its lock
(vLLM takes none), so a read races a sleep in another thread as vLLM's own code does.
"""

from __future__ import annotations

import sys

from hybridmem._errors import EngineAsleepError

__all__ = ["EngineAsleepError", "asleep_bytes", "asleep_tags", "refuse_while_asleep"]

_CUMEM = "vllm.device_allocator.cumem"


def _records() -> list[object] | None:
    """The records of the pool vLLM's module holds (a copy of the list), or None: no pool."""
    module = sys.modules.get(_CUMEM)
    allocator = getattr(getattr(module, "CuMemAllocator", None), "instance", None)
    records = getattr(allocator, "pointer_to_data", None)
    return list(records.values()) if isinstance(records, dict) else None


def asleep_tags() -> frozenset[str]:
    """The tags of vLLM's sleep-mode pool with memory asleep now (empty: none, or no pool).

    Example:
        >>> asleep_tags()   # doctest: +SKIP
        frozenset({'weights', 'kv_cache'})
    """
    records = _records()
    return frozenset(
        str(getattr(data, "tag", "")) for data in records or () if getattr(data, "is_asleep", False)
    )


def asleep_bytes(tag: str) -> int | None:
    """Bytes of ``tag``'s memory asleep in vLLM's pool: what waking ``tag`` maps (None: no pool).

    Each record's handle carries its size (``handle[1]``, vLLM 0.22 to 0.33). vLLM
    before 0.25 keeps no ``is_asleep`` flag: there every record of ``tag`` counts,
    which is what a wake maps when the caller asks before waking.

    Example:
        >>> asleep_bytes("kv_cache")   # doctest: +SKIP
        41875931136
    """
    records = _records()
    if records is None:
        return None
    total = 0
    for data in records:
        if getattr(data, "tag", None) != tag or not getattr(data, "is_asleep", True):
            continue
        handle = getattr(data, "handle", None)
        size = handle[1] if isinstance(handle, tuple) and len(handle) > 1 else None
        if not isinstance(size, int):
            return None  # a record this reading does not know: say nothing
        total += size
    return total


def refuse_while_asleep(tag: str, action: str) -> None:
    """Raise :class:`EngineAsleepError` when ``tag``'s memory sleeps in vLLM's pool.

    Args:
        tag: the pool tag the action writes (``"weights"``, ``"kv_cache"``).
        action: what was asked, for the message (``"a weight update"``).

    Raises:
        EngineAsleepError: naming the tags asleep and the call that wakes them.

    Example:
        >>> refuse_while_asleep("weights", "a weight update")   # doctest: +SKIP
    """
    asleep = asleep_tags()
    if tag in asleep:
        raise EngineAsleepError(
            f"{action} came while vLLM's {tag!r} memory sleeps (asleep: "
            f"{', '.join(sorted(asleep))}): nothing was received or written, and the engine "
            f"is as it was. Wake it first: llm.wake_up(tags=[{tag!r}]) (verl wakes "
            "['weights'], syncs, then wakes ['kv_cache'])"
        )
