"""How a WeightBucket packs tensors into its buffers: the plan (cached), and each batch's fill.

Split out of :mod:`hybridmem.ipc.bucket` (issue #27). The plan packs the tensors at
256-byte-aligned offsets, splitting those larger than a buffer; a batch is filled
with one ``torch.cat`` into the buffer's words (alignment gaps from a small zero
tensor), or with batched copies into a host buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hybridmem import _torch
from hybridmem.ipc._plan import ALIGN, Batch, plan_batches
from hybridmem.ipc._wire import UNITS, Entry, byte_offset, flat_words, word_unit

__all__ = ["Filler", "Plan"]


@dataclass(frozen=True)
class Plan:
    """How one list of (name, dtype, shape) is packed: batches and their messages."""

    batches: tuple[Batch, ...]
    entries: tuple[tuple[Entry, ...], ...]
    units: tuple[tuple[int, torch.dtype], ...]  # per tensor
    batch_units: tuple[tuple[int, torch.dtype], ...]  # per batch: the narrowest of its tensors


class Filler:
    """A bucket's buffers as words of each width, its padding, and its cached plan.

    Args:
        views: the buffers, as flat uint8 tensors.
        nbytes: bytes per buffer.
        device: where the buffers live (the padding is made there).
    """

    def __init__(self, views: list[torch.Tensor], nbytes: int, device: torch.device) -> None:
        self._views = views
        self.nbytes = nbytes
        self.device = device
        self._plan_key: tuple[Any, ...] | None = None
        self._plan: Plan | None = None
        self._word_views: list[dict[torch.dtype, torch.Tensor]] = []
        self._pads: dict[torch.dtype, torch.Tensor] = {}

    def clear(self) -> None:
        """Forget the views (the bucket is closing)."""
        self._word_views.clear()
        self._pads.clear()

    def make_plan(self, items: list[tuple[str, torch.Tensor]]) -> Plan:
        """Pack the tensors' layout; cached while names, dtypes and shapes repeat."""
        key = tuple((name, t.dtype, t.shape, byte_offset(t) % 8) for name, t in items)
        if self._plan is not None and key == self._plan_key:
            return self._plan
        sizes = [t.nbytes for _, t in items]
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
        batch_units = tuple(
            min((units[p.index] for p in batch.pieces), default=UNITS[-1]) for batch in batches
        )
        self._plan = Plan(batches, entries, units, batch_units)
        self._plan_key = key
        return self._plan

    def _buffer_words(self, buffer: int, dtype: torch.dtype) -> torch.Tensor:
        while len(self._word_views) <= buffer:
            self._word_views.append({})
        views = self._word_views[buffer]
        if dtype not in views:
            views[dtype] = self._views[buffer].view(dtype)
        return views[dtype]

    def fill(
        self,
        buffer: int,
        number: int,
        plan: Plan,
        items: list[tuple[str, torch.Tensor]],
        flats: dict[int, torch.Tensor],
    ) -> None:
        """Copy batch ``number`` into ``buffer`` (asynchronously, on the current stream).

        One ``torch.cat`` into the buffer, alignment gaps filled from a small zero
        tensor: a handful of launches however many tensors the batch holds (one
        ``copy_`` per piece is launch-bound: a 24 MiB copy takes less GPU time than
        its launch).
        """
        batch = plan.batches[number]
        size, dtype = plan.batch_units[number]
        pad = self._pad(dtype)
        words = self._buffer_words(buffer, dtype)
        parts: list[torch.Tensor] = []
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        cursor = 0
        for piece in batch.pieces:
            if not piece.nbytes:
                continue
            if piece.offset > cursor:
                parts.append(pad[: (piece.offset - cursor) // size])
            flat = flats.get(piece.index)
            if flat is None:  # made here, batch by batch: host work overlaps the copies
                flat = flats[piece.index] = flat_words(
                    items[piece.index][1], plan.units[piece.index][1]
                )
            if flat.dtype != dtype:
                flat = flat.view(dtype)
            if piece.start or piece.nbytes != flat.numel() * size:
                flat = flat[piece.start // size : (piece.start + piece.nbytes) // size]
            parts.append(flat)
            srcs.append(flat)
            dsts.append(words[piece.offset // size : (piece.offset + piece.nbytes) // size])
            cursor = piece.offset + piece.nbytes
        if not srcs:
            return
        if words.device == srcs[0].device:
            torch.cat(parts, out=words[: cursor // size])
        else:  # host transport: device-to-host copies into the pinned buffer
            _torch.copy_many(dsts, srcs)

    def _pad(self, dtype: torch.dtype) -> torch.Tensor:
        pad = self._pads.get(dtype)
        if pad is None:
            pad = self._pads[dtype] = torch.zeros(ALIGN, dtype=dtype, device=self.device)
        return pad
