"""Where torch's caching allocator puts a request: its rounding, its pools, private pools.

What :func:`hybridmem.one_segment` and ``hybridmem.compact(into="segment")`` rely
on, from ``c10/cuda/CUDACachingAllocator.cpp`` (constants unchanged in the torch
releases hybridmem supports; the placement checked on an H200 with torch 2.11):

- ``kMinBlockSize = 512``: a request is rounded up to a multiple of 512 bytes
  (``round_size``), unless ``roundup_power2_divisions`` asks for more;
- ``kSmallSize = 1 MiB``: a request of at most that goes to the small pool (2 MiB
  segments shared by many tensors); a larger one to the large pool, where a free
  block is split when more than ``kSmallSize`` would remain of it;
- a free block serves the smallest request it fits (best fit) on the stream it was
  allocated on, so one block as large as the sum of several requests, freed, is
  carved into them back to back.

These are a model of the allocator: the GPU tests check what it predicts (every
storage carved from the one block) against the real allocator, and
:func:`hybridmem.compact` reports each storage that landed elsewhere.
"""

from __future__ import annotations

import torch

from hybridmem._torch.settings import snapshot

#: ``kMinBlockSize``: every request is rounded up to a multiple of this.
MIN_BLOCK_BYTES = 512
#: ``kSmallSize``: requests up to this size go to the small pool.
SMALL_REQUEST_BYTES = 1 << 20


def block_bytes(nbytes: int) -> int:
    """The bytes the allocator gives a request of ``nbytes`` (default rounding).

    Example:
        >>> block_bytes(1), block_bytes(512), block_bytes(513)
        (512, 512, 1024)
    """
    return max(1, -(-nbytes // MIN_BLOCK_BYTES)) * MIN_BLOCK_BYTES


def private_pool_ranges(index: int) -> list[tuple[int, int]]:
    """``(address, size)`` of device ``index``'s segments that belong to a private pool.

    A private pool (a CUDA graph's, a ``torch.cuda.MemPool``: every torch_memory_saver
    region, in both hook modes) keeps its free segments through ``empty_cache`` until
    the pool is destroyed.
    Read from the allocator snapshot's ``segment_pool_id`` (``(0, 0)`` is the default
    pool); empty where the snapshot does not say (an older torch). Costly (walks every
    segment): once per call of a one-off operation, never a hot path.
    """
    snap = snapshot()
    if snap is None:
        return []
    ranges: list[tuple[int, int]] = []
    for segment in snap.get("segments", []):
        if segment.get("device") != index:
            continue
        pool = segment.get("segment_pool_id")
        if pool is not None and tuple(pool) != (0, 0):
            ranges.append((int(segment["address"]), int(segment["total_size"])))
    return ranges


def hold_block(nbytes: int, device: torch.device) -> int:
    """Allocate ``nbytes`` on ``device`` and free them at once; return their address.

    The caching allocator keeps the freed block cached for the current stream, in the
    pool the caller allocates from (a torch_memory_saver region's, inside one): the
    next requests on that stream and pool are carved from it.

    Raises:
        torch.OutOfMemoryError: no room for one block of ``nbytes``.
    """
    block = torch.empty(nbytes, dtype=torch.uint8, device=device)
    address = int(block.data_ptr())
    del block
    return address


def storage_address(storage: torch.UntypedStorage) -> int:
    """The device address of ``storage``'s first byte (0 while it holds none)."""
    return int(storage.data_ptr())
