"""Plan how named tensors are packed into fixed-size buckets (pure logic, no torch).

Each tensor's bytes go into one or more *pieces*; a piece is a byte range of one
tensor placed at an aligned offset of one batch (one fill of a bucket). Tensors
larger than the bucket are split across consecutive batches. Offsets are aligned
so that a receiver can view a piece as its own dtype (alignment 256 covers every
dtype and vectorised copies).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ALIGN", "Batch", "Piece", "align_up", "plan_batches"]

ALIGN = 256


@dataclass(frozen=True)
class Piece:
    """Bytes ``[start, start + nbytes)`` of tensor ``index`` at ``offset`` in a batch."""

    index: int
    start: int
    nbytes: int
    offset: int


@dataclass(frozen=True)
class Batch:
    """One fill of the bucket: the pieces it carries and the bytes it uses."""

    pieces: tuple[Piece, ...]
    used: int


def align_up(value: int, align: int = ALIGN) -> int:
    """Return the smallest multiple of ``align`` that is >= ``value``."""
    return (value + align - 1) // align * align


def plan_batches(sizes: Sequence[int], capacity: int, align: int = ALIGN) -> list[Batch]:
    """Pack tensors of byte sizes ``sizes`` (in order) into batches of ``capacity`` bytes.

    Greedy and order-preserving: a tensor starts at the next aligned offset of the
    current batch, fills it, and continues at offset 0 of the next batch. Empty
    tensors get a zero-byte piece (so the receiver still learns their shape).

    Args:
        sizes: byte size of each tensor, >= 0.
        capacity: bucket size in bytes, a positive multiple of ``align``.
        align: offset alignment in bytes.

    Returns:
        The batches, each with at least one piece (none when ``sizes`` is empty).

    Raises:
        ValueError: a negative size, or a capacity that is not a positive multiple
            of ``align``.
    """
    if capacity <= 0 or capacity % align:
        raise ValueError(f"capacity must be a positive multiple of {align}, got {capacity}")
    batches: list[Batch] = []
    pieces: list[Piece] = []
    cursor = 0

    def close() -> None:
        nonlocal pieces, cursor
        if pieces:
            batches.append(Batch(tuple(pieces), cursor))
        pieces = []
        cursor = 0

    for index, size in enumerate(sizes):
        if size < 0:
            raise ValueError(f"tensor {index} has a negative size {size}")
        if size == 0:
            pieces.append(Piece(index, 0, 0, min(align_up(cursor, align), capacity)))
            continue
        start = 0
        while start < size:
            offset = align_up(cursor, align)
            if offset >= capacity:
                close()
                offset = 0
            take = min(size - start, capacity - offset)
            pieces.append(Piece(index, start, take, offset))
            cursor = offset + take
            start += take
    close()
    return batches
