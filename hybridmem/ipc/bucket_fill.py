"""How a WeightBucket packs tensors into its buffers: the plan (cached), and each batch's fill.

The plan packs the tensors at
256-byte-aligned offsets, splitting those larger than a buffer (a group that must
arrive together is packed into one batch whenever it fits: :func:`plan_group`); a
batch is filled by copying each tensor as it is into a view of the buffer with its
dtype and shape (small ones batched), the views made once per plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hybridmem import _torch
from hybridmem.ipc._plan import ALIGN, Batch, plan_batches, plan_group
from hybridmem.ipc._wire import Entry, byte_offset, flat_words, word_unit

__all__ = ["Filler", "Plan"]

#: How many layouts a filler keeps plans and views for (a sync of groups has one per
#: group; beyond this the cache is emptied and rebuilt as layouts repeat).
_PLANS = 1024


@dataclass(frozen=True)
class Plan:
    """How one list of (name, dtype, shape) is packed: batches and their messages."""

    batches: tuple[Batch, ...]
    entries: tuple[tuple[Entry, ...], ...]
    units: tuple[tuple[int, torch.dtype], ...]  # per tensor: the words its split pieces move as
    serial: int = 0  # which cached plan: its buffer views are kept under it


class Filler:
    """A bucket's buffers as typed views and words, and its cached plan.

    Args:
        views: the buffers, as flat uint8 tensors.
        nbytes: bytes per buffer.
        device: where the buffers live (the padding is made there).
    """

    def __init__(self, views: list[torch.Tensor], nbytes: int, device: torch.device) -> None:
        self._views = views
        self.nbytes = nbytes
        self.device = device
        self._plans: dict[tuple[Any, ...], Plan] = {}
        self._serial = 0
        self._word_views: list[dict[torch.dtype, torch.Tensor]] = []
        self._target_views: dict[tuple[int, int, int], tuple[torch.Tensor | None, ...]] = {}

    def clear(self) -> None:
        """Forget the plans and views (the bucket is closing)."""
        self._word_views.clear()
        self._target_views.clear()
        self._plans.clear()

    def make_plan(self, items: list[tuple[str, torch.Tensor]], *, together: bool = False) -> Plan:
        """Pack the tensors' layout; cached while names, dtypes and shapes repeat.

        Args:
            items: the ``(name, tensor)`` pairs, in order.
            together: one batch for all of them whenever they fit (:func:`plan_group`).
        """
        key = (together, *((name, t.dtype, t.shape, byte_offset(t) % 8) for name, t in items))
        cached = self._plans.get(key)
        if cached is not None:
            return cached
        if len(self._plans) >= _PLANS:
            self._plans.clear()
            self._target_views.clear()  # they follow the plans
        sizes = [t.nbytes for _, t in items]
        if together:
            elements = [t.element_size() for _, t in items]
            batches = tuple(plan_group(sizes, elements, self.nbytes, ALIGN))
        else:
            batches = tuple(plan_batches(sizes, self.nbytes, ALIGN))
        entries = tuple(
            tuple(
                (
                    items[p.index][0],
                    str(items[p.index][1].dtype),
                    tuple(items[p.index][1].shape),
                    p.start,
                    p.nbytes,
                    p.offset,
                    sizes[p.index],
                )
                for p in batch.pieces
            )
            for batch in batches
        )
        units = tuple(word_unit(t.nbytes, byte_offset(t)) for _, t in items)
        self._serial += 1
        plan = self._plans[key] = Plan(batches, entries, units, self._serial)
        return plan

    def _buffer_words(self, buffer: int, dtype: torch.dtype) -> torch.Tensor:
        while len(self._word_views) <= buffer:
            self._word_views.append({})
        views = self._word_views[buffer]
        if dtype not in views:
            views[dtype] = self._views[buffer].view(dtype)
        return views[dtype]

    def _targets(
        self, buffer: int, number: int, plan: Plan, items: list[tuple[str, torch.Tensor]]
    ) -> tuple[torch.Tensor | None, ...]:
        """Where each piece of batch ``number`` goes in ``buffer``; made once per plan.

        A whole tensor's place is a view of the buffer with the tensor's own dtype
        and shape, so that the fill copies the tensor as it is, with no view of it
        made per sync; a piece of a split tensor's place is a slice of the buffer's
        words. The views hold the bucket's own buffers only.
        """
        key = (plan.serial, buffer, number)
        targets = self._target_views.get(key)
        if targets is not None:
            return targets
        made: list[torch.Tensor | None] = []
        for piece in plan.batches[number].pieces:
            tensor = items[piece.index][1]
            if not piece.nbytes:
                made.append(None)
            elif piece.start == 0 and piece.nbytes == tensor.nbytes:
                place = self._views[buffer][piece.offset : piece.offset + piece.nbytes]
                made.append(place.view(tensor.dtype).view(tensor.shape))
            else:
                size, unit = plan.units[piece.index]
                words = self._buffer_words(buffer, unit)
                made.append(words[piece.offset // size : (piece.offset + piece.nbytes) // size])
        targets = self._target_views[key] = tuple(made)
        return targets

    def fill(
        self,
        buffer: int,
        number: int,
        plan: Plan,
        items: list[tuple[str, torch.Tensor]],
        flats: dict[int, torch.Tensor],
    ) -> None:
        """Copy batch ``number`` into ``buffer`` (asynchronously, on the current stream).

        Each whole tensor is copied as it is into a view of the buffer with its own
        dtype and shape (made once per plan); small ones of one dtype together, in one
        ``torch._foreach_copy_``. Per tensor and sync that is one copy to launch and
        no view to make: view making was most of a sync's host time
        (``benchmarks/sync_anatomy.py``). Pieces of a split tensor go as words.
        """
        batch = plan.batches[number]
        targets = self._targets(buffer, number, plan, items)
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for piece, target in zip(batch.pieces, targets, strict=True):
            if target is None:
                continue
            tensor = items[piece.index][1]
            if piece.start == 0 and piece.nbytes == tensor.nbytes:
                srcs.append(tensor)
            else:
                size, unit = plan.units[piece.index]
                flat = flats.get(piece.index)
                if flat is None:  # made once per sync, for the pieces that follow
                    flat = flats[piece.index] = flat_words(tensor, unit)
                srcs.append(flat[piece.start // size : (piece.start + piece.nbytes) // size])
            dsts.append(target)
        if srcs:
            with torch.no_grad():  # parameters may require grad; the copies are not autograd's
                _torch.copy_many(dsts, srcs)
