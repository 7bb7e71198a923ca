"""verl's Megatron packing, replaced in two lines: same arguments, same outputs, no syncs.

verl 0.9.x packs with ``preprocess_packed_seqs`` and unpacks with
``postprocess_packed_seqs`` (``verl/models/mcore/util.py``). The two functions here
take the same arguments and return the same types and values, bit for bit, on every
context-parallel rank, with or without ``use_fp8_padding``::

    # from verl.models.mcore.util import preprocess_packed_seqs, postprocess_packed_seqs
    from hybridmem.packing.verl import preprocess_packed_seqs, postprocess_packed_seqs

What differs is the device-to-host syncs: verl's make one per sample in each
direction and several more besides; these make one in ``preprocess_packed_seqs``
(the lengths, read from the mask) and none with ``lengths=`` given on the host, and
none in ``postprocess_packed_seqs`` (the plan travels on the ``PackedSeqParams`` it
returned).

The parallel layout is read from ``megatron.core.parallel_state`` when Megatron is
installed (tensor-parallel size, context-parallel size, rank and group, as verl reads
them); keyword arguments (``tp_size=``, ``cp_size=``, ``cp_rank=``, ``cp_group=``)
override it, and without Megatron they are how it is given. Megatron stays optional:
this module imports it only when called, and returns its ``PackedSeqParams`` where it
is installed, else :class:`PackedSeqParams` here, with the same fields.

One difference on purpose: verl indexes rows with ``attention_mask[i]``, which is a
mask only when the mask is bool (an integer mask would pick positions 0 and 1); here
any nonzero entry is a valid token. verl passes bool masks.

Scope: the current process; ``postprocess_packed_seqs`` with ``cp_size > 1`` is a
collective over the context-parallel group, as verl's.
"""

from __future__ import annotations

import importlib
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hybridmem import _torch
from hybridmem._checks import check_bool, check_number
from hybridmem.packing._layout import fp8_alignment
from hybridmem.packing.core import PackPlan, pack, plan, unpack

__all__ = ["PackedSeqParams", "postprocess_packed_seqs", "preprocess_packed_seqs"]

_log = logging.getLogger("hybridmem")

#: The attribute of a ``PackedSeqParams`` that carries its plan to postprocessing.
_PLAN_ATTRIBUTE = "_hybridmem_plan"


@dataclass
class PackedSeqParams:
    """Megatron's ``PackedSeqParams`` fields, for machines without Megatron.

    Attributes:
        qkv_format: ``"thd"``.
        cu_seqlens_q, cu_seqlens_kv: ``int32`` ``[batch + 1]`` (verl: the padded offsets).
        cu_seqlens_q_padded, cu_seqlens_kv_padded: the padded offsets.
        max_seqlen_q, max_seqlen_kv: the longest padded sequence.
    """

    qkv_format: str | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_kv: torch.Tensor | None = None
    cu_seqlens_q_padded: torch.Tensor | None = None
    cu_seqlens_kv_padded: torch.Tensor | None = None
    max_seqlen_q: int | None = None
    max_seqlen_kv: int | None = None


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _params_class() -> Any:
    found = _import("megatron.core.packed_seq_params")
    return PackedSeqParams if found is None else found.PackedSeqParams


@dataclass(frozen=True)
class _Parallel:
    tp_size: int
    cp_size: int
    cp_rank: int
    cp_group: Any


def _parallel(tp_size: object, cp_size: object, cp_rank: object, cp_group: object) -> _Parallel:
    """The layout: the keyword arguments, then Megatron's parallel state, then an error."""
    given = {"tp_size": tp_size, "cp_size": cp_size, "cp_rank": cp_rank}
    missing = [name for name, value in given.items() if value is None]
    mpu = _import("megatron.core.parallel_state") if missing or cp_group is None else None
    read: dict[str, Any] = {}
    if mpu is not None:
        getters = {
            "tp_size": "get_tensor_model_parallel_world_size",
            "cp_size": "get_context_parallel_world_size",
            "cp_rank": "get_context_parallel_rank",
        }
        try:
            read = {name: getattr(mpu, getters[name])() for name in missing}
        except (AssertionError, RuntimeError, AttributeError, TypeError) as error:
            raise ValueError(
                f"Megatron's parallel state could not say {', '.join(missing)} ({error}); "
                "initialise it (megatron.core.parallel_state.initialize_model_parallel) or "
                "pass them as keyword arguments"
            ) from None
    elif "tp_size" in missing:
        raise ValueError(
            "Megatron is not installed, so the parallel layout must be given: pass tp_size= "
            "(and cp_size=, cp_rank=, cp_group= with context parallelism)"
        )
    elif "cp_rank" in missing and cp_size not in (None, 1):
        raise ValueError(
            f"Megatron is not installed, so with cp_size={cp_size} this rank's cp_rank= must "
            "be given too"
        )
    else:  # no Megatron: no context parallelism unless it was given
        read = {name: 1 if name == "cp_size" else 0 for name in missing}
    values = {**{k: v for k, v in given.items() if v is not None}, **read}
    tp = int(check_number("tp_size", values["tp_size"], integer=True, minimum=1))
    cp = int(check_number("cp_size", values["cp_size"], integer=True, minimum=1))
    rank = int(check_number("cp_rank", values["cp_rank"], integer=True))
    if not 0 <= rank < cp:
        raise ValueError(f"cp_rank must be in [0, cp_size) = [0, {cp}), got {rank}")
    group = cp_group
    if group is None and cp > 1 and mpu is not None:
        try:  # only post-processing needs it, and says so when it is missing
            group = mpu.get_context_parallel_group()
        except (AssertionError, RuntimeError, AttributeError):
            group = None
    return _Parallel(tp, cp, rank, group)


def preprocess_packed_seqs(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    pre_process: bool = True,
    use_fp8_padding: bool = False,
    *,
    lengths: Sequence[int] | torch.Tensor | None = None,
    tp_size: int | None = None,
    cp_size: int | None = None,
    cp_rank: int | None = None,
) -> tuple[torch.Tensor, Any]:
    """verl's ``preprocess_packed_seqs``: the packed input and its ``PackedSeqParams``.

    Each sequence is padded to a multiple of ``tp`` (``tp * cp * 2`` with context
    parallelism), or with ``use_fp8_padding`` to ``lcm(16, that)`` with the total a
    multiple of ``that * 128``; ``cu_seqlens_q/kv`` hold the padded offsets, as verl's.

    Args:
        input_ids: ``[batch, seq_len, *rest]``.
        attention_mask: ``[batch, seq_len]``, bool (as verl passes it) or 0/1.
        pre_process: False (a pipeline stage after the first): return ``input_ids``
            unchanged beside the params, as verl does; the plan is still made, for
            ``postprocess_packed_seqs``.
        use_fp8_padding: TransformerEngine's FP8 block alignment, as verl's.
        lengths: each row's valid-token count on the host: no sync at all. None:
            read from the mask (one sync).
        tp_size, cp_size, cp_rank: the parallel layout; None: Megatron's parallel
            state (required without Megatron: ``tp_size``; ``cp_size`` defaults to 1).

    Returns:
        ``(packed [1, total // cp, *rest], PackedSeqParams)``: Megatron's class when
        installed, else :class:`PackedSeqParams`.

    Raises:
        TypeError, ValueError: as :func:`hybridmem.packing.pack`; no layout given
            and none readable from Megatron.

    Example:
        >>> ids, params = preprocess_packed_seqs(input_ids, mask, tp_size=2)  # doctest: +SKIP
    """
    check_bool("pre_process", pre_process)
    check_bool("use_fp8_padding", use_fp8_padding)
    layout = _parallel(tp_size, cp_size, cp_rank, None)
    align = layout.tp_size * layout.cp_size * 2 if layout.cp_size > 1 else layout.tp_size
    total_align: int | None = None
    if use_fp8_padding:
        align, total_align = fp8_alignment(align)
    cp, rank = layout.cp_size, layout.cp_rank
    made: PackPlan
    if pre_process:
        packed = pack(
            input_ids,
            attention_mask,
            lengths=lengths,
            align=align,
            total_align=total_align,
            cp_size=cp,
            cp_rank=rank,
        )
        made, result = packed, packed.tensor
    else:
        made = plan(
            attention_mask,
            lengths=lengths,
            align=align,
            total_align=total_align,
            cp_size=cp,
            cp_rank=rank,
        )
        result = input_ids
    params = _params_class()(**made.seq_params())
    _attach(params, made)
    return result, params


def postprocess_packed_seqs(
    output: torch.Tensor,
    packed_seq_params: Any,
    attention_mask: torch.Tensor,
    batch_size: int,
    seq_len: int,
    post_process: bool = True,
    *,
    cp_size: int | None = None,
    cp_rank: int | None = None,
    cp_group: Any = None,
) -> torch.Tensor:
    """verl's ``postprocess_packed_seqs``: packed outputs back to ``[batch, seq_len, *rest]``.

    With ``cp_size > 1`` every rank's output is gathered through
    ``torch.distributed.all_gather`` over the context-parallel group, as verl does:
    this rank's own output keeps its gradient, the others' arrive detached.

    Args:
        output: ``[1, total // cp, *rest]``.
        packed_seq_params: what :func:`preprocess_packed_seqs` returned (no sync), or
            params made elsewhere with ``cu_seqlens_q_padded`` (one sync: their
            offsets and the mask's lengths are read, as verl reads them).
        attention_mask: the batch's ``[batch, seq_len]`` mask.
        batch_size, seq_len: the output's first two dimensions.
        post_process: False (not the last pipeline stage): return ``output`` as is.
        cp_size, cp_rank, cp_group: the context-parallel layout for params made
            elsewhere; None: the plan's, then Megatron's.

    Returns:
        ``[batch_size, seq_len, *rest]``, zeros where the mask is 0.

    Raises:
        TypeError, ValueError: params without ``cu_seqlens_q_padded``, a batch size,
            sequence length or mask that does not match the packing.

    Example:
        >>> logits = postprocess_packed_seqs(out, params, mask, 8, 4096)  # doctest: +SKIP
    """
    check_bool("post_process", post_process)
    if not post_process:
        return output
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        raise ValueError(
            f"attention_mask must be a [batch, seq_len] tensor, got {attention_mask!r}"
        )
    batch = int(check_number("batch_size", batch_size, integer=True, minimum=1))
    width = int(check_number("seq_len", seq_len, integer=True, minimum=1))
    if tuple(attention_mask.shape) != (batch, width):
        raise ValueError(
            f"attention_mask is {tuple(attention_mask.shape)} but batch_size, seq_len = "
            f"{batch}, {width}: pass the mask preprocess_packed_seqs packed"
        )
    made = _attached(packed_seq_params)
    if made is None or made.batch != batch or made.seq_len != width:
        made = _replan(packed_seq_params, attention_mask, cp_size, cp_rank, cp_group)
    if made.cp_size == 1:
        return unpack(output, made, seq_len=width)
    group = (
        cp_group
        if cp_group is not None
        else _parallel(1, made.cp_size, made.cp_rank, None).cp_group
    )
    if group is None:
        raise ValueError(
            f"this batch is split over cp_size={made.cp_size} ranks: pass cp_group= (no "
            "Megatron parallel state names the context-parallel group here)"
        )
    parts = _torch.dist_all_gather_tensors(output.detach(), group)
    parts[made.cp_rank] = output  # as verl: only this rank's part carries a gradient
    return unpack(parts, made, seq_len=width)


def _replan(
    params: Any, mask: torch.Tensor, cp_size: object, cp_rank: object, cp_group: object
) -> PackPlan:
    """A plan for params made elsewhere: their padded offsets and the mask's lengths (one sync)."""
    cu = getattr(params, "cu_seqlens_q_padded", None)
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() != mask.shape[0] + 1:
        raise TypeError(
            f"packed_seq_params must carry cu_seqlens_q_padded of {mask.shape[0] + 1} offsets "
            f"(what preprocess_packed_seqs returned), got {cu!r}"
        )
    _log.info("postprocess_packed_seqs: params made elsewhere; reading their layout (one sync)")
    keep = mask if mask.dtype == torch.bool else mask != 0
    both = torch.cat([keep.sum(1).to(torch.int64), cu.to(device=mask.device, dtype=torch.int64)])
    read: list[int] = both.tolist()
    batch = mask.shape[0]
    lengths, offsets = read[:batch], read[batch:]
    padded = [b - a for a, b in itertools.pairwise(offsets)]
    layout = _parallel(1, cp_size, cp_rank, cp_group)
    return plan(
        keep,
        lengths=lengths,
        padded=padded,
        align=2 * layout.cp_size if layout.cp_size > 1 else 1,
        cp_size=layout.cp_size,
        cp_rank=layout.cp_rank,
        check=False,
    )


def _attach(params: Any, made: PackPlan) -> None:
    try:
        setattr(params, _PLAN_ATTRIBUTE, made)
    except AttributeError:  # a class that takes no new attribute: postprocessing replans
        _log.info("postprocess_packed_seqs will replan: %s takes no plan", type(params))


def _attached(params: Any) -> PackPlan | None:
    made = getattr(params, _PLAN_ATTRIBUTE, None)
    if not isinstance(made, PackPlan):
        return None
    # params edited after preprocessing (new offsets) describe another layout
    if getattr(params, "cu_seqlens_q_padded", None) is not made.cu_seqlens_padded:
        return None
    return made
