"""Plan how named tensors are packed into fixed-size buckets (pure logic, no torch).

Each tensor's bytes go into one or more *pieces*; a piece is a byte range of one
tensor placed at an aligned offset of one batch (one fill of a bucket). Tensors
larger than the bucket are split across consecutive batches. Offsets are aligned
so that a receiver can view a piece as its own dtype (alignment 256 covers every
dtype and vectorised copies).

A *group* (:func:`plan_group`) is tensors that should arrive together: one batch
whenever they fit, so that a receiver can hand them out as views of one buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ALIGN", "Batch", "Piece", "align_up", "plan_batches", "plan_group"]

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


def plan_group(
    sizes: Sequence[int], elements: Sequence[int], capacity: int, align: int = ALIGN
) -> list[Batch]:
    """Pack one group of tensors into a single batch if they fit, else as :func:`plan_batches`.

    Offsets are ``align``-aligned when the group fits so; else each tensor's offset is
    rounded up only to its element size (the tightest packing a receiver can still view
    as each tensor's dtype, and the rule verl's own bucket packs by, so a group that
    fits verl's bucket fits a buffer as large). A group that fits neither way is split
    across batches as :func:`plan_batches` splits it.

    Args:
        sizes: byte size of each tensor, >= 0.
        elements: element size of each tensor in bytes (1, 2, 4, 8 ...), one per size.
        capacity: bucket size in bytes, a positive multiple of ``align``.
        align: the preferred offset alignment in bytes.

    Returns:
        The batches: one when the group fits (with at least one piece unless the group
        is empty: then none).

    Raises:
        ValueError: as :func:`plan_batches`, or an element size that is not positive
            and a divisor of ``align``, or ``elements`` of another length.

    Example:
        >>> [b.used for b in plan_group([300, 2], [4, 2], 512)]
        [302]
    """
    if len(elements) != len(sizes):
        raise ValueError(f"{len(sizes)} sizes but {len(elements)} element sizes")
    for index, element in enumerate(elements):
        if element <= 0 or align % element:
            raise ValueError(
                f"tensor {index} has element size {element}: a divisor of {align} is needed"
            )
    batches = plan_batches(sizes, capacity, align)
    if len(batches) <= 1:
        return batches
    pieces: list[Piece] = []
    cursor = 0
    for index, (size, element) in enumerate(zip(sizes, elements, strict=True)):
        offset = align_up(cursor, element)
        pieces.append(Piece(index, 0, size, offset))
        cursor = offset + size
    if cursor > capacity:
        return batches
    return [Batch(tuple(pieces), cursor)]
