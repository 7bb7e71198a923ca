"""An offload's copies queued while the targets are walked, if they still match the plan.

Every offload walks the
targets, since they may have changed since the last one. When nothing is offloaded and
the walk finds the planned storages in the planned order, each copy is queued as soon
as its storage is found, so the walk overlaps the transfers instead of preceding them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from hybridmem import _torch
from hybridmem.memory.host_pool import HostPool
from hybridmem.memory.offload_free import Landing
from hybridmem.memory.offload_report import CopyClock
from hybridmem.memory.slots import Slot
from hybridmem.memory.targets import Group, StorageEntry

__all__ = ["stream_to_host"]

Storages = Iterable[StorageEntry]


def stream_to_host(
    planned: Sequence[Slot],
    storages: Storages,
    *,
    host: HostPool,
    device: torch.device,
    side: Any,
    wanted: Sequence[Group],
    landing: Landing | None,
    clock: CopyClock,
) -> list[Slot] | None:
    """Queue each wanted storage's copy to the pool as the walk finds it, on ``side``.

    Any difference from the plan (another storage, group or size, one more or one
    fewer) stops the walk: the copies queued so far only wrote the pool, and the
    caller plans again and copies everything.

    Args:
        planned: the Offloader's slots, in the targets' order (nothing offloaded).
        storages: the walk of the targets (``Offloader._storages()``).
        host: the pool; device: the targets' device; side: the copy stream.
        wanted: the groups to offload.
        landing: events for freeing as the copies land (None: all at once).
        clock: times the copies on ``side``.

    Returns:
        The slots copied, or None (the targets changed, or none is wanted): then
        every queued copy has landed, and the pool may be re-planned.

    Example:
        >>> stream_to_host([], [], host=HostPool(True), device=torch.device("cpu"),
        ...                side=None, wanted=["optimizer"], landing=None, clock=CopyClock())

    Scope: the Offloader's device, on the thread that offloads.
    """
    _torch.wait_stream(side, _torch.current_stream(device))
    clock.start(side)
    slots = iter(planned)
    todo: list[Slot] = []
    try:
        with _torch.stream_scope(side):
            for _, storage, group, _ in storages:
                slot = next(slots, None)
                if (
                    slot is None
                    or slot.key != _torch.storage_key(storage)
                    or slot.group != group
                    or slot.nbytes != storage.nbytes()
                ):
                    break
                if group in wanted:
                    host.copy_one(slot, device, to_host=True)
                    todo.append(slot)
                    if landing is not None:
                        landing.copied(side, slot.nbytes)
            else:
                if next(slots, None) is None:
                    return todo or None
    except BaseException:
        # Nothing is freed yet; the copies in flight only write the pool, and
        # must land before anything may reuse or free it.
        _torch.synchronize_stream(side)
        raise
    _torch.synchronize_stream(side)  # a re-plan may free the pool
    return None
