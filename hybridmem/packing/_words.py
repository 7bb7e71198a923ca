"""The device's half of packing: rows moved as the widest words that tile them.

Scope: pure functions of their tensors; thread-safe.
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = ["INTEGER_WORDS", "TORCH_WORDS", "as_words", "differentiable", "word_dtype"]


#: The words the torch path moves rows in, widest first (``index_*`` take complex128).
TORCH_WORDS = (torch.complex128, torch.int64, torch.int32, torch.int16, torch.uint8)
#: The words a Triton kernel moves rows in (Triton has no complex dtype).
INTEGER_WORDS = TORCH_WORDS[1:]


@functools.lru_cache(maxsize=64)
def word_dtype(row_bytes: int, words: tuple[torch.dtype, ...] = TORCH_WORDS) -> torch.dtype:
    """The widest of ``words`` that tiles a row of ``row_bytes``.

    Moving a bf16 row as 16-byte words instead of 2-byte elements is what makes
    ``index_copy_``, ``index_select`` and ``index_fill_`` run at the copy rate
    (measured on an H200, 0.5 M rows of 8 KiB: ``index_copy_`` 6.0 ms as bf16, 2.4 ms
    as int64, 2.1 ms as complex128; ``index_fill_`` of 0.56 M rows 5.9, 1.6 and
    0.9 ms). The bits move unchanged (no arithmetic touches them), so any dtype works;
    an all-zero word is zero in every dtype.
    """
    return next(w for w in words if row_bytes % w.itemsize == 0)  # uint8 always tiles


def as_words(rows: torch.Tensor, words: tuple[torch.dtype, ...] = TORCH_WORDS) -> torch.Tensor:
    """``rows`` ([n, *rest]) as [n, k] of the widest of ``words`` that tiles a row.

    A view at an odd address takes the widest word its address allows.
    """
    flat = rows.reshape(rows.shape[0], math.prod(rows.shape[1:])).contiguous()
    row_bytes = flat.shape[1] * flat.element_size()
    address = flat.data_ptr()
    word = next(w for w in words if row_bytes % w.itemsize == 0 and address % w.itemsize == 0)
    return flat.view(torch.uint8).view(word)


def differentiable(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
