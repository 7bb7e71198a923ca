"""Sequence packing (the THD layout) without device-to-host syncs.

A padded batch ``[batch, seq_len, *rest]`` with an attention mask becomes one
sequence of valid tokens ``[1, total, *rest]``: row ``i``'s valid tokens, in order,
start at ``cu_seqlens_padded[i]``, each sequence padded with zeros to a multiple of
``align``. With context parallelism each padded sequence is cut into ``2 * cp_size``
chunks and rank ``r`` holds chunks ``r`` and ``2 * cp_size - 1 - r`` (the
load-balanced causal split of Megatron and TransformerEngine). :func:`unpack` puts
outputs back in the padded layout, zeros where the mask is 0.

Why no syncs: every shape follows from the valid lengths. Given on the host
(``lengths=``), they leave nothing to ask the device: the layout is planned on the
host, a few small index vectors go to the device in one asynchronous copy from
pinned memory, and the data moves in one gather (pack) or one scatter (unpack).
Without them, :func:`pack` reads them from the mask (one sync) and keeps every
index it built on the :class:`PackedBatch`, so :func:`unpack` needs none. Hand-written
versions synchronise once per sample in each direction (verl 0.9.1's
``preprocess_packed_seqs``: three ``.tolist()`` calls, then ``input_ids[i, mask[i]]``
per sample).

Any mask works (right-, left- or arbitrarily padded): the valid tokens of a row are
packed in their order. This module uses torch only (no allocator, no IPC); gradients
flow through both directions.

Scope: the device of the input; thread-safe, except that a :class:`PackedBatch`
keeps the index vectors it built (about 40 bytes per token on the device), so share
one between threads only under a lock. ``unpack`` with a ``group`` is a collective
over that group.

Example:
    >>> packed = pack(input_ids, attention_mask, lengths=lengths, align=8)  # doctest: +SKIP
    >>> out = model(packed.tensor, packed_seq_params=PackedSeqParams(**packed.seq_params()))
    >>> logits = unpack(out, packed, seq_len=input_ids.shape[1])            # doctest: +SKIP
"""

from __future__ import annotations

import array
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridmem import _torch
from hybridmem._checks import check_bool, check_number

__all__ = ["PackedBatch", "pack", "unpack"]


@dataclass
class PackedBatch:
    """A packed batch, and everything :func:`unpack` needs to undo it.

    Attributes:
        tensor: the packed values, ``[1, total // cp_size, *rest]`` (this rank's).
        cu_seqlens_padded: ``int32`` ``[batch + 1]`` on the input's device: where each
            padded sequence starts in the unsplit packing.
        cu_seqlens: ``int32`` ``[batch + 1]``: the same without the padding.
        max_seqlen: the longest padded sequence (a Python int).
        lengths: the valid lengths, a host list of ints.
        align: each sequence's padded length is a multiple of it.
        cp_size, cp_rank: the context-parallel split this rank's ``tensor`` holds.
        batch, seq_len: the padded layout it came from.
    """

    tensor: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    lengths: list[int]
    align: int
    cp_size: int
    cp_rank: int
    batch: int
    seq_len: int
    _valid: torch.Tensor = field(repr=False)  # [n_valid] flat input row of each valid token
    _keep: torch.Tensor = field(repr=False)  # [batch * seq_len] bool: the mask, flat
    _padded: list[int] = field(default_factory=list, repr=False)
    # device indices, kept so that unpack (and unpack again) asks nothing of the device
    _sources: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)
    _targets: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict, repr=False)
    _blanks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def total(self) -> int:
        """Positions in the unsplit packing (every rank's together)."""
        return sum(self._padded)

    def seq_params(self) -> dict[str, Any]:
        """The keyword arguments of Megatron's ``PackedSeqParams``, without importing Megatron.

        Returns:
            ``qkv_format="thd"``, ``cu_seqlens_q/kv`` (valid lengths),
            ``cu_seqlens_q/kv_padded`` and ``max_seqlen_q/kv`` (padded).

        Example:
            >>> PackedSeqParams(**packed.seq_params())   # doctest: +SKIP
        """
        return {
            "qkv_format": "thd",
            "cu_seqlens_q": self.cu_seqlens,
            "cu_seqlens_kv": self.cu_seqlens,
            "cu_seqlens_q_padded": self.cu_seqlens_padded,
            "cu_seqlens_kv_padded": self.cu_seqlens_padded,
            "max_seqlen_q": self.max_seqlen,
            "max_seqlen_kv": self.max_seqlen,
        }


def _host_lengths(lengths: object, batch: int, seq_len: int) -> list[int]:
    if isinstance(lengths, torch.Tensor):
        if lengths.device.type != "cpu":
            raise TypeError(
                f"lengths must be on the host (a list of ints or a CPU tensor), got a tensor "
                f"on {lengths.device}; pass lengths=None to read them from the mask (one sync)"
            )
        if lengths.dim() != 1 or lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
            raise TypeError(
                f"lengths must be a 1-D integer tensor, got {lengths.dtype} of shape "
                f"{tuple(lengths.shape)}"
            )
        values: list[object] = list(lengths.tolist())
    elif isinstance(lengths, Sequence) and not isinstance(lengths, str | bytes):
        values = list(lengths)
    else:
        raise TypeError(f"lengths must be a list of ints, a CPU tensor or None, got {lengths!r}")
    if len(values) != batch:
        raise ValueError(f"lengths has {len(values)} entries for a batch of {batch}")
    # The common case in one pass over C-level builtins (this runs on every batch).
    if all(type(v) is int for v in values) and min(values) >= 0 and max(values) <= seq_len:  # type: ignore[type-var, operator]
        return values  # type: ignore[return-value]
    return [
        int(check_number(f"lengths[{i}]", v, integer=True, minimum=0, maximum=seq_len))
        for i, v in enumerate(values)
    ]


def _check_inputs(
    input_ids: object, attention_mask: object, align: object, cp_size: object, cp_rank: object
) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a tensor, got {type(input_ids).__name__}")
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a tensor, got {type(attention_mask).__name__}")
    if attention_mask.dim() != 2:
        raise ValueError(
            f"attention_mask must be [batch, seq_len], got shape {tuple(attention_mask.shape)}"
        )
    if attention_mask.dtype.is_floating_point or attention_mask.is_complex():
        raise TypeError(
            f"attention_mask must be bool or an integer 0/1 mask, got {attention_mask.dtype}"
        )
    if input_ids.dim() < 2 or tuple(input_ids.shape[:2]) != tuple(attention_mask.shape):
        raise ValueError(
            f"input_ids must be [batch, seq_len, *rest] with the mask's [batch, seq_len] = "
            f"{tuple(attention_mask.shape)}, got shape {tuple(input_ids.shape)}"
        )
    if input_ids.device != attention_mask.device:
        raise ValueError(
            f"input_ids is on {input_ids.device} but attention_mask on {attention_mask.device}"
        )
    if attention_mask.shape[0] < 1:
        raise ValueError("the batch is empty: attention_mask has 0 rows")
    size = int(check_number("cp_size", cp_size, integer=True, minimum=1))
    rank = check_number("cp_rank", cp_rank, integer=True)
    if not 0 <= rank < size:
        raise ValueError(f"cp_rank must be in [0, cp_size) = [0, {size}), got {rank}")
    step = int(check_number("align", align, integer=True, minimum=1))
    if size > 1 and step % (2 * size):
        raise ValueError(
            f"with cp_size={size} each padded sequence is cut into {2 * size} chunks, so align "
            f"must be a multiple of {2 * size}, got {step}; pass tp * cp_size * 2"
        )
    return input_ids, attention_mask


def _layout(
    lengths: list[int], padded: list[int], cp_size: int, rank: int
) -> tuple[list[int], list[int], list[int]]:
    """Rank ``rank``'s part of the packing, planned on the host.

    Returns the runs of its local positions (each run's length, and the offset
    that turns a local position into the index of its token among the valid ones)
    and the local positions that are padding.
    """
    before = _starts(lengths)  # valid tokens of the earlier rows
    if cp_size == 1:  # one run a row, at its padded place (comprehensions: a hot path)
        local = _starts(padded)
        offsets = [b - s for b, s in zip(before, local)]
        pads = list(
            itertools.chain.from_iterable(
                range(s + n, s + p) for s, n, p in zip(local, lengths, padded) if p > n
            )
        )
        return list(padded), offsets, pads
    counts: list[int] = []
    offsets = []
    pads = []
    at = 0
    mirror = 2 * cp_size - 1 - rank
    for valid, size, seen in zip(lengths, padded, before):
        chunk = size // (2 * cp_size)
        for first in (rank * chunk, mirror * chunk):
            counts.append(chunk)
            offsets.append(seen + first - at)
            pads.extend(range(at + max(min(valid - first, chunk), 0), at + chunk))
            at += chunk
    return counts, offsets, pads


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """A host list as an int64 device tensor, copied asynchronously from pinned memory."""
    # array.array packs a list of ints in C: ten times faster than torch.tensor(list)
    host = torch.frombuffer(array.array("q", values), dtype=torch.int64) if values else None
    if host is None:
        return torch.empty(0, dtype=torch.int64, device=device)
    if device.type != "cuda":
        return host.to(device, copy=True)
    return host.pin_memory().to(device, non_blocking=True)


def _starts(counts: list[int]) -> list[int]:
    out, total = [], 0
    for count in counts:
        out.append(total)
        total += count
    return out


def _sources(
    packed_valid: torch.Tensor, table: torch.Tensor, n_runs: int, n_local: int
) -> torch.Tensor:
    """The flat input row of each local position (a valid token's, or 0 at padding)."""
    counts, offsets = table[:n_runs], table[n_runs : 2 * n_runs]
    slot = torch.repeat_interleave(offsets, counts, output_size=n_local)
    slot += torch.arange(n_local, device=slot.device)
    n_valid = packed_valid.numel()
    if not n_valid:
        return torch.zeros(n_local, dtype=torch.int64, device=slot.device)
    return packed_valid.index_select(0, slot.clamp_(0, n_valid - 1))


def _plan(packed: PackedBatch, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sources, padding positions) of rank ``rank``, made once per batch and rank."""
    found = packed._sources.get(rank)
    if found is None:
        counts, offsets, pads = _layout(packed.lengths, packed._padded, packed.cp_size, rank)
        table = _to_device(counts + offsets + pads, packed._valid.device)
        n_local = packed.total // packed.cp_size
        found = (_sources(packed._valid, table, len(counts), n_local), table[2 * len(counts) :])
        packed._sources[rank] = found
    return found


def _wide(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` ([n, *rest], contiguous) as [n, k] of the widest integer that tiles a row.

    Moving a bf16 row as 16-byte words instead of 2-byte elements is what makes
    ``index_copy_`` and ``index_fill_`` run at the copy rate (measured on an H200,
    0.5 M rows of 8 KiB: ``index_copy_`` 6.0 ms as bf16, 2.4 ms as int64, 2.1 ms as
    complex128; ``index_fill_`` of 0.56 M rows 5.9, 1.6 and 0.9 ms). The bits move
    unchanged (no arithmetic touches them), so any dtype works; an all-zero word is
    zero in every dtype.
    """
    flat = rows.reshape(rows.shape[0], math.prod(rows.shape[1:])).contiguous()
    row_bytes = flat.shape[1] * flat.element_size()
    for dtype in (torch.complex128, torch.int64, torch.int32, torch.int16):
        size = dtype.itemsize
        if row_bytes % size == 0 and flat.data_ptr() % size == 0 and flat.is_contiguous():
            return flat.view(torch.uint8).view(dtype)
    return flat.view(torch.uint8)


def _differentiable(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def pack(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    lengths: Sequence[int] | torch.Tensor | None = None,
    align: int = 1,
    cp_size: int = 1,
    cp_rank: int = 0,
    check: bool | None = None,
) -> PackedBatch:
    """Pack a padded batch into one sequence of valid tokens (THD), without syncs.

    Args:
        input_ids: ``[batch, seq_len, *rest]``: token ids, log-probs, hidden states.
        attention_mask: ``[batch, seq_len]``, bool or 0/1; any padding pattern.
        lengths: each row's valid-token count on the host (a list or a CPU tensor):
            no device-to-host sync at all. None: read from the mask (one sync).
        align: pad each sequence to a multiple of this (``tp``; ``tp * cp_size * 2``
            with context parallelism).
        cp_size, cp_rank: the context-parallel split; this rank's chunks are returned.
        check: compare ``lengths`` with the mask: True always (one sync on a GPU),
            False never, None (default) where it costs no sync (a CPU mask). Lengths
            that disagree with an unchecked device mask give a wrong packing, never an
            out-of-bounds access.

    Returns:
        A :class:`PackedBatch`; pass it to :func:`unpack`.

    Raises:
        TypeError: a tensor argument is not a tensor, a float mask, lengths on the
            device or not ints.
        ValueError: shapes that do not match, lengths out of ``[0, seq_len]`` or
            disagreeing with the mask, ``align < 1`` or not a multiple of
            ``2 * cp_size``, ``cp_rank`` outside ``[0, cp_size)``.

    Example:
        >>> packed = pack(ids, mask, lengths=[3, 5], align=4)   # doctest: +SKIP
        >>> packed.tensor.shape, packed.cu_seqlens_padded.tolist()
        (torch.Size([1, 12]), [0, 4, 12])
    """
    input_ids, attention_mask = _check_inputs(input_ids, attention_mask, align, cp_size, cp_rank)
    batch, seq_len = attention_mask.shape
    if check is not None:
        check_bool("check", check)
    keep = attention_mask if attention_mask.dtype == torch.bool else attention_mask != 0
    if lengths is None:
        # the one sync: the lengths decide every shape
        host = [int(n) for n in keep.sum(1).tolist()]
    else:
        host = _host_lengths(lengths, batch, seq_len)
        on_cpu = attention_mask.device.type == "cpu"
        if check or (check is None and on_cpu):
            counted: list[int] = keep.sum(1).tolist()
            wrong = [(i, n, h) for i, (n, h) in enumerate(zip(counted, host)) if n != h]
            if wrong:
                i, n, h = wrong[0]
                raise ValueError(
                    f"lengths disagree with the mask in {len(wrong)} row(s): row {i} has "
                    f"{n} valid tokens but lengths[{i}] = {h}"
                )
    step = int(align)
    padded = [-(-n // step) * step for n in host]
    valid = _torch.nonzero_static(keep.reshape(-1), sum(host))
    cu = _to_device(_starts([*host, 0]) + _starts([*padded, 0]), input_ids.device)
    cu_seqlens, cu_seqlens_padded = cu.to(torch.int32).view(2, -1)
    packed = PackedBatch(
        tensor=input_ids.new_empty(0),
        cu_seqlens_padded=cu_seqlens_padded,
        cu_seqlens=cu_seqlens,
        max_seqlen=max(padded),
        lengths=host,
        align=step,
        cp_size=int(cp_size),
        cp_rank=int(cp_rank),
        batch=batch,
        seq_len=seq_len,
        _valid=valid,
        _keep=keep.reshape(-1),
        _padded=padded,
    )
    sources, pads = _plan(packed, int(cp_rank))
    rows = input_ids.reshape(batch * seq_len, *input_ids.shape[2:])
    if _differentiable(input_ids):
        out = rows.index_select(0, sources)
        out.index_fill_(0, pads, 0)
    else:
        moved = _wide(rows).index_select(0, sources)
        moved.index_fill_(0, pads, 0)
        out = moved.view(rows.dtype).view(moved.shape[0], *rows.shape[1:])
    packed.tensor = out.unsqueeze(0)
    return packed


def _widened(flat: torch.Tensor, width: int, seq_len: int) -> torch.Tensor:
    """Flat indices into ``[batch, width]`` as the same (row, column) in ``[batch, seq_len]``."""
    if seq_len == width:
        return flat
    return flat + (flat // width) * (seq_len - width)


def _targets(packed: PackedBatch, rank: int, seq_len: int) -> torch.Tensor:
    """The flat output row of each of rank ``rank``'s positions; padding goes past the end."""
    found = packed._targets.get((rank, seq_len))
    if found is None:
        sources, pads = _plan(packed, rank)
        found = _widened(sources, packed.seq_len, seq_len)
        if found is sources:  # the padding's targets are written below: not into sources
            found = found.clone()
        dump = torch.arange(pads.numel(), device=pads.device) + packed.batch * seq_len
        found.index_copy_(0, pads, dump)
        packed._targets[(rank, seq_len)] = found
    return found


def _blank_rows(packed: PackedBatch, seq_len: int) -> torch.Tensor:
    """The flat output rows no valid token lands on (they must be zeros)."""
    found = packed._blanks.get(seq_len)
    if found is None and seq_len == packed.seq_len:  # the mask's zeros (two kernels)
        found = _torch.nonzero_static(~packed._keep, packed._keep.numel() - packed._valid.numel())
        packed._blanks[seq_len] = found
    if found is None:
        device = packed._valid.device
        hit = torch.zeros(packed.batch * seq_len, dtype=torch.bool, device=device)
        flat = _widened(packed._valid, packed.seq_len, seq_len)
        hit.index_fill_(0, flat, True)
        found = _torch.nonzero_static(~hit, packed.batch * seq_len - flat.numel())
        packed._blanks[seq_len] = found
    return found


def unpack(
    output: torch.Tensor | Sequence[torch.Tensor],
    packed: PackedBatch,
    *,
    seq_len: int,
    group: Any = None,
) -> torch.Tensor:
    """Put packed outputs back in the padded layout, zeros where the mask was 0; no syncs.

    Args:
        output: ``[1, total // cp_size, *rest]`` (``*rest`` may differ from the
            input's: logits, log-probs, hidden states); with ``cp_size > 1`` every
            rank's output in rank order (a list), or this rank's with ``group``.
        packed: what :func:`pack` returned.
        seq_len: the padded length to restore (at least the packed batch's).
        group: with ``cp_size > 1`` and one tensor: the context-parallel process
            group to gather every rank's output through (a collective).

    Returns:
        ``[batch, seq_len, *rest]``.

    Raises:
        TypeError, ValueError: a wrong shape, count or ``seq_len``.

    Example:
        >>> logits = unpack(model_out, packed, seq_len=4096)   # doctest: +SKIP
    """
    if not isinstance(packed, PackedBatch):
        raise TypeError(f"packed must be what pack() returned, got {type(packed).__name__}")
    width = int(check_number("seq_len", seq_len, integer=True, minimum=packed.seq_len))
    parts: list[torch.Tensor]
    if isinstance(output, torch.Tensor):
        if packed.cp_size > 1:
            if group is None:
                raise ValueError(
                    f"this batch is split over cp_size={packed.cp_size} ranks: pass every "
                    "rank's output (a list, in rank order), or group= to gather them"
                )
            parts = _torch.dist_all_gather_tensors(output, group)
        else:
            parts = [output]
    elif isinstance(output, Sequence) and all(isinstance(o, torch.Tensor) for o in output):
        parts = list(output)
    else:
        raise TypeError(f"output must be a tensor or a list of tensors, got {output!r}")
    if len(parts) != packed.cp_size:
        raise ValueError(f"expected {packed.cp_size} rank output(s), got {len(parts)}")
    n_local = packed.total // packed.cp_size
    rest = tuple(parts[0].shape[2:])
    for r, part in enumerate(parts):
        if part.dim() < 2 or part.shape[0] != 1 or part.shape[1] != n_local:
            raise ValueError(
                f"output of rank {r} must be [1, {n_local}, *rest], got shape {tuple(part.shape)}"
            )
        if tuple(part.shape[2:]) != rest or part.dtype != parts[0].dtype:
            raise ValueError("every rank's output must have the same trailing shape and dtype")
    rows = packed.batch * width
    n_pads = max(len(_plan(packed, r)[1]) for r in range(packed.cp_size))
    out = torch.empty((rows + n_pads, *rest), dtype=parts[0].dtype, device=parts[0].device)
    blanks = _blank_rows(packed, width)
    if _differentiable(*parts):
        out.index_fill_(0, blanks, 0)
        for r, part in enumerate(parts):
            out.index_copy_(0, _targets(packed, r, width), part.reshape(n_local, *rest))
    else:
        wide = _wide(out)
        wide.index_fill_(0, blanks, 0)
        for r, part in enumerate(parts):
            wide.index_copy_(0, _targets(packed, r, width), _wide(part.reshape(n_local, *rest)))
    return out[:rows].view(packed.batch, width, *rest)
