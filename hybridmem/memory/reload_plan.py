"""How a reload goes: the memory it needs, the slots it moves first, the copies by kernel.

A reload reallocates each storage before copying into it, so it needs device memory
for them all (rounded as the caching allocator rounds each request); a partial one
takes the first slots within a budget; where the engine has just freed its memory,
the copy engines run at half rate for a while, and the copies after a first share go
by kernels reading the pool through its device mapping (``by="kernel"``).

Scope: pure functions of the slots.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridmem._checks import check_number
from hybridmem.memory.slots import Slot
from hybridmem.scopes.profiles import RELOAD_WAYS

__all__ = ["RELOAD_WAYS", "check_reload_way", "first_slots", "kernel_split", "reload_need"]

# How the CUDA caching allocator rounds requests (c10/cuda/CUDACachingAllocator):
# small ones (<= 1 MiB) to 512 B inside 2 MiB blocks, large ones to 2 MiB.
_SMALL_SIZE, _SMALL_ROUND, _LARGE_ROUND = 1 << 20, 512, 2 << 20
_HEADROOM = 20 << 20  # one large block for what rounding misses


def reload_need(slots: Sequence[Slot]) -> int:
    """Device memory reallocating ``slots`` needs, about (bytes; 0 for none).

    Each storage rounded as the caching allocator rounds it, plus one 20 MiB block
    (:meth:`~hybridmem.memory.offload.Offloader.reload_bytes`). Storages allocated
    already, to be refilled (a reload feed's), need nothing more.
    """
    total = 0
    for slot in slots:
        if slot.refill and slot.storage.nbytes():  # a reload feed's, allocated already
            continue
        unit = _SMALL_ROUND if slot.nbytes <= _SMALL_SIZE else _LARGE_ROUND
        total += -(-slot.nbytes // unit) * unit
    return total + _HEADROOM if total else 0


def check_reload_way(by: object, copy_engine_first: object) -> int | None:
    """Check a reload's ``by`` and ``copy_engine_first``; the bytes after which kernels copy.

    Returns:
        None for ``by="copy_engine"`` (no kernel), else ``copy_engine_first``.

    Raises:
        ValueError: ``by`` is not one of :data:`RELOAD_WAYS`, or ``copy_engine_first``
            is negative.
        TypeError: ``copy_engine_first`` is not an int.
    """
    if by not in RELOAD_WAYS:
        raise ValueError(f"by must be one of {', '.join(map(repr, RELOAD_WAYS))}, got {by!r}")
    first = check_number("copy_engine_first", copy_engine_first, integer=True, minimum=0)
    return int(first) if by == "kernel" else None


def first_slots(slots: list[Slot], max_bytes: object) -> list[Slot]:
    """The first ``slots`` within ``max_bytes`` (at least one), or all for None.

    Raises:
        TypeError: ``max_bytes`` is not an int or None.
        ValueError: ``max_bytes`` is below 1.
    """
    if max_bytes is None:
        return slots
    limit = check_number(
        "max_bytes", max_bytes, integer=True, minimum=1, expected="a positive int or None"
    )
    taken: list[Slot] = []
    total = 0
    for slot in slots:
        if taken and total + slot.nbytes > limit:
            break
        taken.append(slot)
        total += slot.nbytes
    return taken


def kernel_split(slots: Sequence[Slot], kernel_after: int | None) -> int:
    """The index of the first slot a reload copies by kernel (``len(slots)``: none).

    That slot is the first to start at or past ``kernel_after`` bytes; None: no kernel.
    """
    done = 0
    for index, slot in enumerate(slots):
        if kernel_after is not None and done >= kernel_after:
            return index
        done += slot.nbytes
    return len(slots)
