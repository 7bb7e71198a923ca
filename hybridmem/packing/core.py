"""Sequence packing (the THD layout) without device-to-host syncs.

A padded batch ``[batch, seq_len, *rest]`` and its mask become one sequence of valid
tokens ``[1, total, *rest]``: row ``i``'s tokens, in order, from ``cu_seqlens_padded[i]``,
each sequence zero-padded to a multiple of ``align`` (with ``total_align``, the last one
further, for FP8). With context parallelism each padded sequence is cut into
``2 * cp_size`` chunks and rank ``r`` holds chunks ``r`` and ``2 * cp_size - 1 - r``.
:func:`unpack` puts outputs back, zeros where the mask is 0. Any mask works.

No syncs: every shape follows from the valid lengths; given on the host (``lengths=``)
they leave nothing to ask the device, read from the mask they cost one. The torch path
uploads its layout in one copy and moves data in one gather (pack) or scatter (unpack);
unpack builds its indices at its first call and keeps them. Where Triton is installed,
CUDA tensors without gradients take one kernel each way (``_triton.py``).

Why this module is long: the plan and both directions share one private state (a
:class:`PackPlan`'s device indices, built lazily per rank and width); split, each half
would reach into the other's. Host planning and word views live beside it.

Scope: the input's device; thread-safe, except that a :class:`PackPlan` fills its
index caches on first use (share one between threads only under a lock). ``unpack``
with a ``group`` is a collective over that group.

Example:
    >>> packed = pack(input_ids, attention_mask, lengths=lengths, align=8)  # doctest: +SKIP
    >>> seq = PackedSeqParams(**packed.seq_params())                        # doctest: +SKIP
    >>> out = model(packed.tensor, packed_seq_params=seq)                   # doctest: +SKIP
    >>> logits = unpack(out, packed, seq_len=input_ids.shape[1])            # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch

from hybridmem import _torch
from hybridmem._checks import check_bool, check_number
from hybridmem.packing._layout import (
    check_input,
    check_mask,
    check_split,
    host_lengths,
    padded_given,
    rank_layout,
    starts,
    upload,
)
from hybridmem.packing._triton import pack_rows, token_ranks, unpack_rows, usable
from hybridmem.packing._words import as_words, differentiable, word_dtype

__all__ = ["CuSeqlens", "PackPlan", "PackedBatch", "pack", "plan", "unpack"]

#: What ``cu_seqlens_q/kv`` of :meth:`PackPlan.seq_params` hold.
CuSeqlens = Literal["padded", "valid"]
_CU_SEQLENS = ("padded", "valid")


@dataclass(eq=False)
class _RankIndex:
    """One context-parallel rank's device indices (built once per plan and rank)."""

    sources: torch.Tensor  # [n_local] the flat input row of each local position (in range)
    pads: torch.Tensor  # [n_pads] the local positions that are padding
    dump: torch.Tensor  # [n_pads] rows past the end of the output, for the padding
    targets: dict[int, torch.Tensor] = field(default_factory=dict)  # width -> flat output rows


@dataclass(eq=False)
class PackPlan:
    """Where every token of a padded batch goes in the packing, and back.

    Made by :func:`plan` (no data moved) or :func:`pack` (a :class:`PackedBatch`, the
    plan and the packed tensor). Pack more tensors of the same batch with
    :meth:`pack`; put outputs back with :func:`unpack`; both only move data.

    Attributes:
        cu_seqlens_padded: ``int32`` ``[batch + 1]`` on the mask's device: where each
            padded sequence starts in the unsplit packing.
        cu_seqlens: ``int32`` ``[batch + 1]``: the same without the padding.
        max_seqlen: the longest padded sequence (a Python int).
        lengths: the valid lengths, a host list of ints.
        padded: the padded lengths, a host list of ints.
        align: each sequence's padded length is a multiple of it.
        total_align: the total is a multiple of it (None: no total alignment).
        cp_size, cp_rank: the context-parallel split this rank's packing holds.
        batch, seq_len: the padded layout it came from.
    """

    cu_seqlens_padded: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    lengths: list[int]
    padded: list[int]
    align: int
    total_align: int | None
    cp_size: int
    cp_rank: int
    batch: int
    seq_len: int
    _n_valid: int = field(repr=False)
    _overshoot: int = field(repr=False)  # how far past the last token padding can index
    _keep: torch.Tensor = field(repr=False)  # [batch * seq_len] bool: the mask, flat
    # made on first use: the flat input row of each valid token, then 0s (torch path);
    # each position's valid tokens so far in its row (Triton path)
    _valid: torch.Tensor | None = field(default=None, repr=False)
    _token_ranks: torch.Tensor | None = field(default=None, repr=False)
    # device indices, kept so that pack again and unpack ask nothing of the device
    _ranks: dict[int, _RankIndex] = field(default_factory=dict, repr=False)
    _blanks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def total(self) -> int:
        """Positions in the unsplit packing (every rank's together)."""
        return sum(self.padded)

    def seq_params(self, *, cu_seqlens: CuSeqlens = "padded") -> dict[str, Any]:
        """The keyword arguments of Megatron's ``PackedSeqParams``, without importing Megatron.

        Args:
            cu_seqlens: what ``cu_seqlens_q/kv`` hold. ``"padded"`` (the default, as
                verl builds them): the padded offsets, equal to ``cu_seqlens_q/kv_padded``;
                every TransformerEngine attention backend takes them, and causal
                attention gives the valid tokens the same output. ``"valid"``: the
                offsets of the valid tokens alone, with the padded ones in
                ``_padded``; only backends that support padding between sequences
                take them (TransformerEngine's fused cuDNN backend, not its
                flash-attention one).

        Returns:
            ``qkv_format="thd"``, ``cu_seqlens_q/kv``, ``cu_seqlens_q/kv_padded`` and
            ``max_seqlen_q/kv`` (the longest padded sequence).

        Raises:
            ValueError: ``cu_seqlens`` is neither ``"padded"`` nor ``"valid"``.

        Example:
            >>> PackedSeqParams(**packed.seq_params())   # doctest: +SKIP
        """
        if cu_seqlens not in _CU_SEQLENS:
            raise ValueError(
                f"cu_seqlens must be 'padded' (verl's, every attention backend) or 'valid' "
                f"(backends with padding between sequences), got {cu_seqlens!r}"
            )
        cu = self.cu_seqlens_padded if cu_seqlens == "padded" else self.cu_seqlens
        return {
            "qkv_format": "thd",
            "cu_seqlens_q": cu,
            "cu_seqlens_kv": cu,
            "cu_seqlens_q_padded": self.cu_seqlens_padded,
            "cu_seqlens_kv_padded": self.cu_seqlens_padded,
            "max_seqlen_q": self.max_seqlen,
            "max_seqlen_kv": self.max_seqlen,
        }

    def pack(self, values: torch.Tensor) -> torch.Tensor:
        """Pack another tensor of the same batch (labels, position ids, a loss mask) by this plan.

        Only data moves: the indices are the plan's. No sync.

        Args:
            values: ``[batch, seq_len, *rest]`` on the plan's device.

        Returns:
            ``[1, total // cp_size, *rest]``: this rank's chunks, zeros at padding.

        Raises:
            TypeError, ValueError: not a tensor, or a shape or device that differs
                from the plan's batch.

        Example:
            >>> labels = packed.pack(label_ids)   # doctest: +SKIP
        """
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"values must be a tensor, got {type(values).__name__}")
        if values.dim() < 2 or tuple(values.shape[:2]) != (self.batch, self.seq_len):
            raise ValueError(
                f"values must be [batch, seq_len, *rest] = [{self.batch}, {self.seq_len}, ...] "
                f"like the planned batch, got shape {tuple(values.shape)}"
            )
        if values.device != self._keep.device:
            raise ValueError(f"values is on {values.device} but the plan on {self._keep.device}")
        return _move(self, values)


@dataclass(eq=False, kw_only=True)
class PackedBatch(PackPlan):
    """A packed batch: its :class:`PackPlan` and the packed tensor.

    Attributes:
        tensor: the packed values, ``[1, total // cp_size, *rest]`` (this rank's).
    """

    tensor: torch.Tensor


def _rank_index(plan: PackPlan, rank: int, table: torch.Tensor | None = None) -> _RankIndex:
    """Rank ``rank``'s indices; ``table`` is its host layout already on the device."""
    counts, offsets, pads = rank_layout(plan.lengths, plan.padded, plan.cp_size, rank)
    n_runs, n_pads = len(counts), len(pads)
    dump_at = plan.batch * plan.seq_len
    if table is None:
        layout = [*counts, *offsets, *pads, *range(dump_at, dump_at + n_pads)]
        _, table = upload([], layout, plan._keep.device)
    n_local = plan.total // plan.cp_size
    valid = _valid_of(plan)
    if valid.numel():
        slot = torch.repeat_interleave(
            table[n_runs : 2 * n_runs], table[:n_runs], output_size=n_local
        )
        slot += torch.arange(n_local, device=slot.device)
        sources = valid.index_select(0, slot)  # padding reads the 0s past the tokens
    else:
        sources = torch.zeros(n_local, dtype=torch.int64, device=table.device)
    pad_at = 2 * n_runs
    return _RankIndex(
        sources=sources,
        pads=table[pad_at : pad_at + n_pads],
        dump=table[pad_at + n_pads : pad_at + 2 * n_pads],
    )


def _valid_of(plan: PackPlan) -> torch.Tensor:
    """The flat input row of each valid token, then 0s as far as padding can index (no sync)."""
    if plan._valid is None:
        plan._valid = _torch.nonzero_static(plan._keep, plan._n_valid + plan._overshoot)
    return plan._valid


def _ranks_of(plan: PackPlan) -> torch.Tensor:
    """Each position's count of valid tokens so far in its row, ``[batch, seq_len]`` int32."""
    if plan._token_ranks is None:
        plan._token_ranks = token_ranks(plan._keep.view(plan.batch, plan.seq_len))
    return plan._token_ranks


def _move(plan: PackPlan, values: torch.Tensor) -> torch.Tensor:
    """``values`` packed by ``plan`` for its own rank: ``[1, n_local, *rest]``."""
    if usable(values, plan.batch):
        moved = pack_rows(
            values,
            plan._keep.view(plan.batch, plan.seq_len),
            _ranks_of(plan),
            plan.cu_seqlens,
            plan.cu_seqlens_padded,
            plan.total // plan.cp_size,
            plan._overshoot,
            plan.cp_size,
            plan.cp_rank,
        )
        return moved.unsqueeze(0)
    return _gather(values, _rank(plan, plan.cp_rank))


def _rank(plan: PackPlan, rank: int) -> _RankIndex:
    found = plan._ranks.get(rank)
    if found is None:
        found = plan._ranks[rank] = _rank_index(plan, rank)
    return found


def _gather(values: torch.Tensor, index: _RankIndex) -> torch.Tensor:
    """``values``' rows at ``index.sources``, zeros at the padding: ``[1, n_local, *rest]``."""
    batch, seq_len = values.shape[:2]
    rows = values.reshape(batch * seq_len, *values.shape[2:])
    if differentiable(values):
        out = rows.index_select(0, index.sources)
        out.index_fill_(0, index.pads, 0)
    else:
        moved = as_words(rows).index_select(0, index.sources)
        moved.index_fill_(0, index.pads, 0)
        out = moved.view(rows.dtype).view(moved.shape[0], *rows.shape[1:])
    return out.unsqueeze(0)


def _build(
    attention_mask: object,
    *,
    lengths: Sequence[int] | torch.Tensor | None,
    padded: Sequence[int] | None,
    align: object,
    total_align: object,
    cp_size: object,
    cp_rank: object,
    check: bool | None,
    values: torch.Tensor | None = None,
) -> PackPlan:
    """The plan and its own rank's indices (their layout uploaded with ``cu_seqlens``).

    With ``values``, a :class:`PackedBatch` holding them packed.
    """
    mask = check_mask(attention_mask)
    step, whole, size, rank = check_split(align, total_align, cp_size, cp_rank)
    batch, seq_len = mask.shape
    if check is not None:
        check_bool("check", check)
    keep = mask if mask.dtype == torch.bool else mask != 0
    if lengths is None:
        host = [int(n) for n in keep.sum(1).tolist()]  # the one sync: lengths decide every shape
    else:
        host = host_lengths(lengths, batch, seq_len)
        if check or (check is None and mask.device.type == "cpu"):
            counted: list[int] = keep.sum(1).tolist()
            wrong = [(i, n, h) for i, (n, h) in enumerate(zip(counted, host)) if n != h]
            if wrong:
                i, n, h = wrong[0]
                raise ValueError(
                    f"lengths disagree with the mask in {len(wrong)} row(s): row {i} has "
                    f"{n} valid tokens but lengths[{i}] = {h}"
                )
    if padded is None:
        sizes = [-(-n // step) * step for n in host]
    else:
        sizes = padded_given(padded, host, step, size)
    if whole is not None and sizes:
        sizes[-1] += -sum(sizes) % whole  # as verl: the last sequence takes the total's padding
    n_valid = sum(host)
    # Padding positions index up to max(padded - lengths) past the last valid token:
    # nonzero_static pads its answer with 0s that far, so no index needs a clamp.
    overshoot = max(p - n for p, n in zip(sizes, host))
    flat_keep = keep.reshape(-1)
    # The torch path's own-rank layout travels in the same upload as cu_seqlens; the
    # Triton path needs none.
    fast = values is not None and usable(values, batch)
    table_values: list[int] = []
    if not fast:
        counts, offsets, pads = rank_layout(host, sizes, size, rank)
        dump_at = batch * seq_len
        table_values = [*counts, *offsets, *pads, *range(dump_at, dump_at + len(pads))]
    cu, table = upload(starts([*host, 0]) + starts([*sizes, 0]), table_values, mask.device)
    cu_seqlens, cu_seqlens_padded = cu[: 2 * (batch + 1)].view(2, -1)
    fields: dict[str, Any] = {
        "cu_seqlens_padded": cu_seqlens_padded,
        "cu_seqlens": cu_seqlens,
        "max_seqlen": max(sizes),
        "lengths": host,
        "padded": sizes,
        "align": step,
        "total_align": whole,
        "cp_size": size,
        "cp_rank": rank,
        "batch": batch,
        "seq_len": seq_len,
        "_n_valid": n_valid,
        "_overshoot": overshoot,
        "_keep": flat_keep,
    }
    if values is None:
        return PackPlan(**fields)
    built = PackedBatch(**fields, tensor=values)
    if not fast:
        built._ranks[rank] = _rank_index(built, rank, table)
    built.tensor = _move(built, values)
    return built


def plan(
    attention_mask: torch.Tensor,
    *,
    lengths: Sequence[int] | torch.Tensor | None = None,
    padded: Sequence[int] | None = None,
    align: int = 1,
    total_align: int | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
    check: bool | None = None,
) -> PackPlan:
    """Plan a packing without moving data (a pipeline stage that only unpacks, say).

    Takes :func:`pack`'s arguments without ``input_ids``, and ``padded``: each
    sequence's padded length as a packing made elsewhere laid it out (verl's
    ``cu_seqlens_padded``), instead of ``align`` and ``total_align``'s.

    Returns:
        A :class:`PackPlan`: :meth:`PackPlan.pack` packs tensors, :func:`unpack`
        puts outputs back.

    Raises:
        TypeError, ValueError: as :func:`pack`; ``padded`` shorter than a row's
            valid tokens, or not a multiple of ``2 * cp_size``.

    Example:
        >>> import torch
        >>> mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
        >>> layout = plan(mask, lengths=[3, 5], align=4)
        >>> output = torch.arange(12).reshape(1, 12)  # what the model gave, packed
        >>> unpack(output, layout, seq_len=mask.shape[1]).tolist()
        [[0, 1, 2, 0, 0], [4, 5, 6, 7, 8]]
    """
    return _build(
        attention_mask,
        lengths=lengths,
        padded=padded,
        align=align,
        total_align=total_align,
        cp_size=cp_size,
        cp_rank=cp_rank,
        check=check,
    )


def pack(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    lengths: Sequence[int] | torch.Tensor | None = None,
    align: int = 1,
    total_align: int | None = None,
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
        total_align: pad the last sequence further so that the total is a multiple
            of this (a multiple of ``align``); :func:`~hybridmem.packing.fp8_alignment` gives verl's
            ``use_fp8_padding`` pair. None: no total alignment.
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
            ``2 * cp_size``, ``total_align`` not a multiple of ``align``,
            ``cp_rank`` outside ``[0, cp_size)``.

    Example:
        >>> import torch
        >>> mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
        >>> ids = torch.arange(10).reshape(2, 5)
        >>> packed = pack(ids, mask, lengths=[3, 5], align=4)
        >>> packed.tensor.shape, packed.cu_seqlens_padded.tolist()
        (torch.Size([1, 12]), [0, 4, 12])
    """
    mask = check_mask(attention_mask)
    values = check_input(input_ids, mask)
    built = _build(
        mask,
        lengths=lengths,
        padded=None,
        align=align,
        total_align=total_align,
        cp_size=cp_size,
        cp_rank=cp_rank,
        check=check,
        values=values,
    )
    return cast("PackedBatch", built)  # values given: the packing is in it


def _widened(flat: torch.Tensor, width: int, seq_len: int) -> torch.Tensor:
    """Flat indices into ``[batch, width]`` as the same (row, column) in ``[batch, seq_len]``."""
    if seq_len == width:
        return flat
    return flat + (flat // width) * (seq_len - width)


def _targets(packed: PackPlan, rank: int, seq_len: int) -> torch.Tensor:
    """The flat output row of each of rank ``rank``'s positions; padding goes past the end."""
    index = _rank(packed, rank)
    found = index.targets.get(seq_len)
    if found is None:
        found = _widened(index.sources, packed.seq_len, seq_len)
        if found is index.sources:  # the padding's targets are written below: not into sources
            found = found.clone()
        if seq_len == packed.seq_len:
            dump = index.dump  # uploaded with the layout
        else:
            dump = (
                torch.arange(index.pads.numel(), device=index.pads.device) + packed.batch * seq_len
            )
        found.index_copy_(0, index.pads, dump)
        index.targets[seq_len] = found
    return found


def _blank_rows(packed: PackPlan, seq_len: int) -> torch.Tensor:
    """The flat output rows no valid token lands on (they must be zeros)."""
    found = packed._blanks.get(seq_len)
    if found is None and seq_len == packed.seq_len:  # the mask's zeros (two kernels)
        found = _torch.nonzero_static(~packed._keep, packed._keep.numel() - packed._n_valid)
        packed._blanks[seq_len] = found
    if found is None:
        device = packed._keep.device
        hit = torch.zeros(packed.batch * seq_len, dtype=torch.bool, device=device)
        flat = _widened(_valid_of(packed)[: packed._n_valid], packed.seq_len, seq_len)
        hit.index_fill_(0, flat, True)
        found = _torch.nonzero_static(~hit, packed.batch * seq_len - flat.numel())
        packed._blanks[seq_len] = found
    return found


def unpack(
    output: torch.Tensor | Sequence[torch.Tensor],
    packed: PackPlan,
    *,
    seq_len: int,
    group: Any = None,
) -> torch.Tensor:
    """Put packed outputs back in the padded layout, zeros where the mask was 0; no syncs.

    Args:
        output: ``[1, total // cp_size, *rest]`` (``*rest`` may differ from the
            input's: logits, log-probs, hidden states); with ``cp_size > 1`` every
            rank's output in rank order (a list), or this rank's with ``group``.
        packed: what :func:`pack` or :func:`plan` returned.
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
    if not isinstance(packed, PackPlan):
        raise TypeError(
            f"packed must be what pack() returned (or plan()), got {type(packed).__name__}"
        )
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
    first = parts[0]
    rest = tuple(first.shape[2:])
    for r, part in enumerate(parts):
        if part.dim() < 2 or part.shape[0] != 1 or part.shape[1] != n_local:
            raise ValueError(
                f"output of rank {r} must be [1, {n_local}, *rest], got shape {tuple(part.shape)}"
            )
        if tuple(part.shape[2:]) != rest or part.dtype != first.dtype:
            raise ValueError("every rank's output must have the same trailing shape and dtype")
    if packed.cp_size == 1 and usable(first, packed.batch):  # one kernel
        return unpack_rows(
            first.reshape(n_local, *rest),
            packed._keep.view(packed.batch, packed.seq_len),
            _ranks_of(packed),
            packed.cu_seqlens_padded,
            width,
        )
    rows = packed.batch * width
    targets = [_targets(packed, r, width) for r in range(packed.cp_size)]
    n_pads = max(_rank(packed, r).pads.numel() for r in range(packed.cp_size))
    blanks = _blank_rows(packed, width)
    if differentiable(*parts):
        out = torch.empty((rows + n_pads, *rest), dtype=first.dtype, device=first.device)
        out.index_fill_(0, blanks, 0)
        for part, target in zip(parts, targets):
            out.index_copy_(0, target, part.reshape(n_local, *rest))
        return out[:rows].view(packed.batch, width, *rest)
    row_bytes = math.prod(rest) * first.element_size()
    word = word_dtype(row_bytes)
    # allocated in words: no reshape before the first kernel is queued
    wide = torch.empty((rows + n_pads, row_bytes // word.itemsize), dtype=word, device=first.device)
    wide.index_fill_(0, blanks, 0)
    for part, target in zip(parts, targets):
        source = as_words(part.reshape(n_local, *rest))
        if source.dtype == word:
            wide.index_copy_(0, target, source)
        else:  # a part at an odd offset moves as bytes
            wide.view(torch.uint8).index_copy_(0, target, source.view(torch.uint8))
    return wide[:rows].view(torch.uint8).view(first.dtype).view(packed.batch, width, *rest)
