"""A sync's bucket sized by the sync: the first batches read ahead, the buffers they need.

verl's sender allocates one buffer of ``bucket_size`` bytes per sync, whatever the
sync holds. The drop-in reads up to ``count`` batches ahead before it makes a sync's
bucket: a sync whose last batch is among them (a LoRA adapter, a small model) gets
no more buffers than it has batches, each as large as its largest batch packed;
any other sync gets ``count`` buffers of ``bucket_size``. Reading ahead never loses
a failure: where verl's weights raise while being read, the error reaches the sync
where it would have without the look-ahead.

Scope: one sync; pure functions.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from hybridmem.integrations.verl.batches import Batch
from hybridmem.ipc._plan import ALIGN, align_up

__all__ = ["bucket_shape", "look_ahead"]


def look_ahead(batches: Iterable[Batch], count: int) -> tuple[list[Batch], Iterator[Batch]]:
    """The first ``count`` batches (fewer where the last comes first), and all of them again.

    Where taking them fails (verl's weights failed), the batches taken come first and
    the error is raised after them, when the sync reaches it: the sync tells the
    worker, as it does for a failure later on.
    """
    iterator = iter(batches)
    ahead: list[Batch] = []
    failure: BaseException | None = None
    try:
        while len(ahead) < count and not (ahead and ahead[-1][1]):
            batch = next(iterator, None)
            if batch is None:
                break
            ahead.append(batch)
    except BaseException as exc:
        failure = exc

    def again() -> Iterator[Batch]:
        yield from ahead
        if failure is not None:
            raise failure
        yield from iterator

    return (ahead if failure is None else []), again()


def bucket_shape(ahead: list[Batch], bucket_size: int, count: int) -> tuple[int, int]:
    """``(bytes per buffer, buffers)`` of a bucket for a sync whose first batches are ``ahead``.

    A sync whose last batch is among them is known whole: its bucket has one buffer a
    batch (at most ``count``), each as large as its largest batch packed (a LoRA
    adapter's sync allocates its adapter's bytes, not verl's bucket). Otherwise, or
    where a batch holds a tensor larger than the bucket: ``count`` buffers of
    ``bucket_size``.

    Example:
        >>> import torch
        >>> small = ([("a", torch.zeros(10)), ("b", torch.zeros(3))], True)
        >>> bucket_shape([small], 1 << 20, 2)
        (512, 1)
        >>> bucket_shape([([("a", torch.zeros(10))], False)], 1 << 20, 2)
        (1048576, 2)
    """
    if not ahead or not ahead[-1][1]:
        return bucket_size, count
    need = max(sum(align_up(int(t.nbytes)) for _, t in weights) for weights, _ in ahead)
    return min(bucket_size, max(need, ALIGN)), min(count, len(ahead))
