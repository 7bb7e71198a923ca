"""verl's batching rule for its bucketed weight transfer: which tensors share a callback.

verl 0.9.1's ``BucketedWeightSender`` (``verl/workers/rollout/vllm_rollout/
bucketed_weight_transfer.py``) walks the tensors in order with an offset into a bucket
of ``bucket_size`` bytes:

- each offset is rounded up to the tensor's element size;
- a tensor that would end past the bucket closes a bucket that holds anything: that
  bucket is delivered (``is_last=False``) and the offset goes back to 0;
- a tensor larger than the whole bucket is delivered alone, in a callback of its own
  (``is_last=False``), by its CUDA-IPC path;
- after the last tensor the open bucket is delivered with ``is_last=True``, empty or
  not: an empty model gives one callback, ``([], True)``, and so does a model whose
  last tensor was larger than a bucket.

:class:`VerlBatches` replays it on a stream of tensors: the drop-in's sender cuts its
stream with it and sends each batch whole, so the receiver calls ``on_bucket_received``
with exactly the batches verl's own pair would deliver.
``tests/verl_transfer_oracle.py`` holds this module against verl's own code.

Scope: one sync; not thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["Batch", "OnBucket", "VerlBatches", "Weights"]

#: The tensors of one callback.
Weights = list[tuple[str, torch.Tensor]]
#: One callback's worth: the tensors, and whether it is the sync's last.
Batch = tuple[Weights, bool]
#: verl's callback: ``on_bucket_received(weights, is_last)``.
OnBucket = Callable[[Weights, bool], object]


class VerlBatches:
    """Group a stream of tensors into verl's callbacks (see the module).

    Args:
        bucket_size: verl's bucket, bytes (``bucket_size_mb << 20``).
        deliver: called with each batch and its ``is_last``, as verl's receiver
            calls ``on_bucket_received``.

    Example:
        >>> seen = []
        >>> batches = VerlBatches(8, lambda w, last: seen.append(([n for n, _ in w], last)))
        >>> for name, n in (("a", 6), ("b", 4), ("c", 16)):
        ...     batches.add(name, torch.zeros(n, dtype=torch.uint8))
        >>> batches.finish()
        >>> seen
        [(['a'], False), (['b'], False), (['c'], False), ([], True)]
    """

    def __init__(self, bucket_size: int, deliver: OnBucket) -> None:
        if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size < 1:
            raise ValueError(
                f"bucket_size must be a whole number of bytes >= 1, got {bucket_size!r}"
            )
        self.bucket_size = bucket_size
        self._deliver = deliver
        self._batch: Weights = []
        self._offset = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """The next tensor of the sync: delivers what verl's sender would deliver now."""
        size = tensor.element_size()
        self._offset = (self._offset + size - 1) // size * size
        nbytes = tensor.numel() * size
        if self._offset + nbytes > self.bucket_size and self._batch:
            self._flush(last=False)
        if self._offset + nbytes > self.bucket_size:
            self._deliver([(name, tensor)], False)  # alone: verl's CUDA-IPC path
            return
        self._batch.append((name, tensor))
        self._offset += nbytes

    def finish(self) -> None:
        """The sync's end: the open bucket, empty or not, with ``is_last=True``."""
        self._flush(last=True)

    def _flush(self, *, last: bool) -> None:
        batch, self._batch, self._offset = self._batch, [], 0
        self._deliver(batch, last)
