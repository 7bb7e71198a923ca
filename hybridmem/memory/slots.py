"""Each device storage's slot in the pinned pool, and freeing and refilling it in place.

An offload frees every storage of its targets in place (``resize_(0)``: every
``Parameter`` and view keeps its identity) once its bytes are in its slot; a reload
reallocates each to its size and copies its bytes back. Before anything is freed,
the storages torch cannot resize are refused; before a reload, a storage someone
else reallocated meanwhile is.

Scope: one Offloader's storages; not thread-safe.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from hybridmem import _torch
from hybridmem.memory.targets import GROUPS, Group, StorageEntry

__all__ = [
    "Slot",
    "allocate",
    "check_freeable",
    "check_refillable",
    "collect_slots",
    "groups_of",
    "unallocate",
]


class Slot:
    """One device storage and its place in the pinned pool."""

    __slots__ = ("group", "key", "name", "nbytes", "offloaded", "offset", "refill", "storage")

    def __init__(self, storage: torch.UntypedStorage, name: str, group: Group) -> None:
        self.storage = storage
        self.key = _torch.storage_key(storage)
        self.nbytes = storage.nbytes()
        self.name = name
        self.group = group
        self.offset = 0
        # The pool holds its only good copy: its device storage is freed, or refill.
        self.offloaded = False
        # This Offloader reallocated the storage and has not filled it yet: a retry
        # may fill it, where a storage someone else reallocated is refused.
        self.refill = False


def groups_of(slots: Sequence[Slot]) -> tuple[str, ...]:
    """The groups ``slots`` belong to, each once, in :data:`~.targets.GROUPS` order."""
    return tuple(sorted({slot.group for slot in slots}, key=GROUPS.index))


def check_freeable(slots: Sequence[Slot]) -> None:
    """Refuse, before anything is freed, storages torch cannot free in place."""
    for slot in slots:
        if not _torch.storage_resizable(slot.storage):
            raise ValueError(
                f"Offloader cannot free {slot.name}: its memory is not this process's "
                "to free (imported through CUDA IPC or DLPack, or wrapping an external "
                "buffer), so torch cannot resize its storage. Leave it out of the "
                "targets, or clone it into memory this process owns; nothing was offloaded"
            )


def check_refillable(slots: Sequence[Slot]) -> None:
    """Refuse to reload over a storage someone else reallocated while it was offloaded."""
    for slot in slots:
        if slot.storage.nbytes() != 0 and not slot.refill:
            raise RuntimeError(
                f"{slot.name} was reallocated while offloaded ({slot.storage.nbytes()} bytes); "
                "refusing to overwrite it. Do not touch offloaded tensors before reload()."
            )


def allocate(slot: Slot) -> None:
    """Reallocate a freed storage, to be refilled (current stream)."""
    if slot.storage.nbytes() == 0:
        slot.refill = True  # before: a failing resize may have allocated already
        _torch.resize_storage(slot.storage, slot.nbytes)


def collect_slots(
    storages: Iterable[StorageEntry],
    device: torch.device | None,
) -> tuple[list[Slot], torch.device | None]:
    """One slot per storage of the walk, and the one device they are all on.

    Args:
        storages: the walk of an Offloader's targets.
        device: the device the Offloader was made for (None: the targets').

    Returns:
        ``(slots, device)``: ``device`` as given, or the storages' where None.

    Raises:
        ValueError: the storages span several devices, or lie on another than ``device``.
    """
    slots: list[Slot] = []
    devices: dict[torch.device, str] = {}
    for name, storage, group, on in storages:
        devices.setdefault(on, name)
        slots.append(Slot(storage, name, group))
    if len(devices) > 1:
        listed = ", ".join(f"{d} ({n})" for d, n in devices.items())
        raise ValueError(
            f"Offloader targets span several devices: {listed}. Use one Offloader per device."
        )
    if devices:
        (found,) = devices
        if device is not None and found != device:
            raise ValueError(f"Offloader was made for {device}, but {devices[found]} is on {found}")
        device = found
    return slots, device


def unallocate(slots: Sequence[Slot], stream: Any) -> None:
    """Free again the slots reallocated but not refilled, so a retry starts from freed.

    One that cannot be freed stays marked ``refill``: a retry fills it. It runs while
    a failure is handled, and its callers raise an ``OffloadError`` saying what stays
    offloaded right after; so nothing here may escape, an interrupt included, or that
    error (and, in ``hm.compact``, the pool's only reference) would be lost.

    Args:
        slots: the slots of the failed reload.
        stream: where their copies were queued: those must land first.
    """
    with contextlib.suppress(BaseException):  # copies queued before the failure must land
        _torch.synchronize_stream(stream)
    for slot in slots:
        if slot.refill:
            with contextlib.suppress(BaseException):
                _torch.resize_storage(slot.storage, 0)
                slot.refill = False
    with contextlib.suppress(BaseException):
        _torch.empty_cache()  # give the partial allocations back to the driver
