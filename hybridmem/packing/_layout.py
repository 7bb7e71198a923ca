"""The host's half of packing: argument checks and the layout of every token, planned in Python.

Every shape of a packing follows from the valid lengths, so everything here runs on
host ints and asks the device nothing; :func:`upload` sends the result in one copy.
"""

from __future__ import annotations

import array
import itertools
import math
from collections.abc import Sequence

import torch

from hybridmem._checks import check_number

__all__ = [
    "check_input",
    "check_mask",
    "check_split",
    "fp8_alignment",
    "host_lengths",
    "padded_given",
    "rank_layout",
    "starts",
    "upload",
]


def host_lengths(lengths: object, batch: int, seq_len: int) -> list[int]:
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


def check_mask(attention_mask: object) -> torch.Tensor:
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
    if attention_mask.shape[0] < 1:
        raise ValueError("the batch is empty: attention_mask has 0 rows")
    return attention_mask


def check_input(input_ids: object, attention_mask: torch.Tensor) -> torch.Tensor:
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a tensor, got {type(input_ids).__name__}")
    if input_ids.dim() < 2 or tuple(input_ids.shape[:2]) != tuple(attention_mask.shape):
        raise ValueError(
            f"input_ids must be [batch, seq_len, *rest] with the mask's [batch, seq_len] = "
            f"{tuple(attention_mask.shape)}, got shape {tuple(input_ids.shape)}"
        )
    if input_ids.device != attention_mask.device:
        raise ValueError(
            f"input_ids is on {input_ids.device} but attention_mask on {attention_mask.device}"
        )
    return input_ids


def check_split(
    align: object, total_align: object, cp_size: object, cp_rank: object
) -> tuple[int, int | None, int, int]:
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
    whole: int | None = None
    if total_align is not None:
        whole = int(check_number("total_align", total_align, integer=True, minimum=1))
        if whole % step:
            raise ValueError(
                f"total_align must be a multiple of align={step} (the last sequence takes the "
                f"extra padding), got {whole}; fp8_alignment(base_align) gives a matching pair"
            )
    return step, whole, size, int(rank)


def padded_given(padded: object, host: list[int], step: int, size: int) -> list[int]:
    if not isinstance(padded, Sequence) or isinstance(padded, str | bytes):
        raise TypeError(f"padded must be a list of ints, got {padded!r}")
    out = [
        int(check_number(f"padded[{i}]", p, integer=True, minimum=0)) for i, p in enumerate(padded)
    ]
    if len(out) != len(host):
        raise ValueError(f"padded has {len(out)} entries for a batch of {len(host)}")
    for i, (p, n) in enumerate(zip(out, host)):
        if p < n or (size > 1 and p % (2 * size)):
            need = f"a multiple of {2 * size} and " if size > 1 else ""
            raise ValueError(f"padded[{i}] = {p} must be {need}>= lengths[{i}] = {n}")
    return out


def rank_layout(
    lengths: list[int], padded: list[int], cp_size: int, rank: int
) -> tuple[list[int], list[int], list[int]]:
    """Rank ``rank``'s part of the packing, planned on the host.

    Returns the runs of its local positions (each run's length, and the offset
    that turns a local position into the index of its token among the valid ones)
    and the local positions that are padding. A padding position's index points
    past its row's tokens: at most ``max(padded - lengths)`` past the last one.
    """
    before = starts(lengths)  # valid tokens of the earlier rows
    if cp_size == 1:  # one run a row, at its padded place (comprehensions: a hot path)
        local = starts(padded)
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


def starts(counts: list[int]) -> list[int]:
    out, total = [], 0
    for count in counts:
        out.append(total)
        total += count
    return out


def upload(
    words32: list[int], words64: list[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Host ints as an int32 and an int64 device tensor, in one asynchronous copy.

    One copy, from pinned memory, instead of one per vector: each costs the host
    about 20 us on an H200's host, as much as moving a batch of 8 rows' indices.
    """
    if len(words32) % 2:  # the int64 part starts on an 8-byte boundary
        words32 = [*words32, 0]
    raw = bytearray(array.array("i", words32).tobytes() + array.array("q", words64).tobytes())
    host = torch.frombuffer(raw, dtype=torch.uint8)
    if device.type == "cuda":
        moved = host.pin_memory().to(device, non_blocking=True)
    else:
        moved = host.to(device, copy=True)
    split = 4 * len(words32)
    return moved[:split].view(torch.int32), moved[split:].view(torch.int64)


def fp8_alignment(align: int) -> tuple[int, int]:
    """The ``(align, total_align)`` pair of verl's ``use_fp8_padding`` for a base ``align``.

    TransformerEngine's FP8 block quantisation wants each sequence padded to a
    multiple of ``lcm(16, align)`` and the total to a multiple of ``align * 128``.

    Args:
        align: the alignment without FP8 (``tp``, or ``tp * cp_size * 2``).

    Returns:
        ``(lcm(16, align), align * 128)``, to pass as ``align=`` and ``total_align=``.

    Example:
        >>> fp8_alignment(2)
        (16, 256)
    """
    base = int(check_number("align", align, integer=True, minimum=1))
    return math.lcm(16, base), base * 128
