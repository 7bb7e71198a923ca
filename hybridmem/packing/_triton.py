"""Pack and unpack in one kernel launch each, where Triton is installed (optional).

The torch path (``core.py``) queues about ten torch calls before its gather: find the
valid tokens, upload the layout, expand it to one index per position, gather, zero the
padding. On a host where one call costs 10-35 us (measured on an H200's host), that
is several times the time a batch of 8 rows takes to move. Here one cumulative sum of
the mask (each valid token's rank within its row) and one kernel do it all: each
program takes a block of one row's columns, reads where each valid token goes from the
row's padded offset and its rank, and moves the rows as words; unpack writes every
output row once, zeros included. The bytes moved are the floor's: valid rows read,
packed (or padded) rows written.

Used for tensors on a CUDA device that need no gradient, when ``triton`` imports;
unpack for ``cp_size == 1`` (with context parallelism the parts are separate tensors:
the torch path scatters them). ``HYBRIDMEM_PACKING_TRITON=0`` turns it off (the torch
path is then used everywhere). With ``TRITON_INTERPRET=1`` it runs on CPU tensors, which
is how CI tests it without a GPU.

Scope: the input's device; thread-safe (kernels are compiled once per process).
"""

from __future__ import annotations

import os

import torch

from hybridmem.packing._words import INTEGER_WORDS, as_words, differentiable

__all__ = ["MAX_BATCH", "enabled", "pack_rows", "token_ranks", "unpack_rows", "usable"]

try:  # optional: Triton ships with torch's CUDA builds on Linux, not with CPU builds
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None


def enabled() -> bool:
    """Triton imports and ``HYBRIDMEM_PACKING_TRITON`` is not ``0``."""
    return triton is not None and os.environ.get("HYBRIDMEM_PACKING_TRITON", "1") != "0"


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


#: A grid's second dimension (one program row per batch row) stops at 65535.
MAX_BATCH = 65535


def usable(values: torch.Tensor, batch: int) -> bool:
    """Whether the kernels can move ``values`` of a batch of ``batch`` rows.

    CUDA tensors without gradients (CPU ones under Triton's interpreter), and at most
    :data:`MAX_BATCH` rows.
    """
    on_device = values.device.type == "cuda" or (_interpreted() and values.device.type == "cpu")
    return enabled() and on_device and not differentiable(values) and batch <= MAX_BATCH


def _blocks(width: int) -> tuple[int, int]:
    """(columns, words) per program: about 4096 words a program, at most 128 words wide."""
    block_w = min(triton.next_power_of_2(max(width, 1)), 128)
    return max(16, min(1024, 4096 // block_w)), block_w


if triton is not None:
    # Triton reads parameter annotations as kernel types: only constexpr ones are
    # written (pyproject.toml lets mypy take these defs unannotated).

    @triton.jit  # type: ignore[untyped-decorator, unused-ignore]
    def _place(j, start, chunk, cp_size, cp_rank, split: tl.constexpr):
        """(local position, held by this rank) of token ``j`` of a padded sequence."""
        if split:
            c = j // chunk
            mirror = 2 * cp_size - 1 - cp_rank
            mine = (c == cp_rank) | (c == mirror)
            dest = start // cp_size + tl.where(c == mirror, chunk, 0) + (j - c * chunk)
        else:
            mine = j >= 0
            dest = start + j
        return dest, mine

    @triton.jit  # type: ignore[untyped-decorator, unused-ignore]
    def _pack_kernel(
        x_ptr,
        keep_ptr,
        rank_ptr,
        cu_ptr,
        cu_pad_ptr,
        out_ptr,
        seq_len,
        width,
        cp_size,
        cp_rank,
        BLOCK_C: tl.constexpr,
        BLOCK_W: tl.constexpr,
        SPLIT: tl.constexpr,
    ):
        cb = tl.program_id(0)
        i = tl.program_id(1).to(tl.int64)
        w = tl.program_id(2) * BLOCK_W + tl.arange(0, BLOCK_W)
        in_w = w < width
        start = tl.load(cu_pad_ptr + i).to(tl.int64)
        padded = tl.load(cu_pad_ptr + i + 1).to(tl.int64) - start
        n = (tl.load(cu_ptr + i + 1) - tl.load(cu_ptr + i)).to(tl.int64)
        chunk = tl.maximum(padded // (2 * cp_size), 1)
        if cb < tl.cdiv(seq_len, BLOCK_C):  # a block of row i's columns
            cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
            in_row = cols < seq_len
            flat = i * seq_len + cols
            valid = tl.load(keep_ptr + flat, mask=in_row, other=0) != 0
            j = tl.load(rank_ptr + flat, mask=in_row, other=1).to(tl.int64) - 1
            dest, mine = _place(j, start, chunk, cp_size, cp_rank, SPLIT)
            moved = (valid & mine)[:, None] & in_w[None, :]
            values = tl.load(x_ptr + flat[:, None] * width + w[None, :], mask=moved, other=0)
            tl.store(out_ptr + dest[:, None] * width + w[None, :], values, mask=moved)
        else:  # the programs past the columns write the sequence's padding
            j = n + (cb - tl.cdiv(seq_len, BLOCK_C)) * BLOCK_C + tl.arange(0, BLOCK_C)
            dest, mine = _place(j, start, chunk, cp_size, cp_rank, SPLIT)
            written = ((j < padded) & mine)[:, None] & in_w[None, :]
            zeros = tl.zeros([BLOCK_C, BLOCK_W], dtype=out_ptr.dtype.element_ty)
            tl.store(out_ptr + dest[:, None] * width + w[None, :], zeros, mask=written)

    @triton.jit  # type: ignore[untyped-decorator, unused-ignore]
    def _unpack_kernel(
        packed_ptr,
        keep_ptr,
        rank_ptr,
        cu_pad_ptr,
        out_ptr,
        seq_len,
        out_len,
        width,
        BLOCK_C: tl.constexpr,
        BLOCK_W: tl.constexpr,
    ):
        cb = tl.program_id(0)
        i = tl.program_id(1).to(tl.int64)
        w = tl.program_id(2) * BLOCK_W + tl.arange(0, BLOCK_W)
        in_w = w < width
        cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        in_src = cols < seq_len
        flat = i * seq_len + cols
        valid = tl.load(keep_ptr + flat, mask=in_src, other=0) != 0
        j = tl.load(rank_ptr + flat, mask=in_src, other=1).to(tl.int64) - 1
        src = tl.load(cu_pad_ptr + i).to(tl.int64) + j
        values = tl.load(
            packed_ptr + src[:, None] * width + w[None, :],
            mask=valid[:, None] & in_w[None, :],
            other=0,
        )
        target = (i * out_len + cols)[:, None] * width + w[None, :]
        tl.store(out_ptr + target, values, mask=(cols < out_len)[:, None] & in_w[None, :])


def token_ranks(keep: torch.Tensor) -> torch.Tensor:
    """Each position's count of valid tokens up to and including it, in its row (int32)."""
    return torch.cumsum(keep, dim=1, dtype=torch.int32)


def pack_rows(
    values: torch.Tensor,
    keep: torch.Tensor,
    ranks: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    n_local: int,
    most_padding: int,
    cp_size: int,
    cp_rank: int,
) -> torch.Tensor:
    """``values`` ``[batch, seq_len, *rest]`` packed: ``[n_local, *rest]``, zeros at padding.

    ``most_padding``: the most padding positions any sequence has (its programs' count).
    """
    batch, seq_len = keep.shape
    rest = tuple(values.shape[2:])
    words = as_words(values.reshape(batch * seq_len, *rest), INTEGER_WORDS)
    out = torch.empty((n_local, words.shape[1]), dtype=words.dtype, device=words.device)
    width = words.shape[1]
    block_c, block_w = _blocks(width)
    columns = triton.cdiv(seq_len, block_c) + triton.cdiv(most_padding, block_c)
    grid = (columns, batch, triton.cdiv(width, block_w))
    if n_local and width:
        _pack_kernel[grid](
            words,
            keep.view(torch.uint8),
            ranks,
            cu_seqlens,
            cu_seqlens_padded,
            out,
            seq_len,
            width,
            cp_size,
            cp_rank,
            BLOCK_C=block_c,
            BLOCK_W=block_w,
            SPLIT=cp_size > 1,
        )
    return out.view(torch.uint8).view(values.dtype).view(n_local, *rest)


def unpack_rows(
    packed: torch.Tensor,
    keep: torch.Tensor,
    ranks: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    out_len: int,
) -> torch.Tensor:
    """``packed`` ``[n, *rest]`` (no context parallelism) back to ``[batch, out_len, *rest]``."""
    batch, seq_len = keep.shape
    rest = tuple(packed.shape[1:])
    words = as_words(packed, INTEGER_WORDS)
    width = words.shape[1]
    out = torch.empty((batch * out_len, width), dtype=words.dtype, device=words.device)
    block_c, block_w = _blocks(width)
    grid = (triton.cdiv(out_len, block_c), batch, triton.cdiv(width, block_w))
    if out.numel():
        _unpack_kernel[grid](
            words,
            keep.view(torch.uint8),
            ranks,
            cu_seqlens_padded,
            out,
            seq_len,
            out_len,
            width,
            BLOCK_C=block_c,
            BLOCK_W=block_w,
        )
    return out.view(torch.uint8).view(packed.dtype).view(batch, out_len, *rest)
