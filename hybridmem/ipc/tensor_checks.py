"""What a WeightBucket ships: the checks every tensor passes before anything is sent.

A bad tensor is refused here,
naming it, before a byte is sent (and before a control-plane call is made, through
:meth:`~hybridmem.ipc.bucket.WeightBucket.check`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from hybridmem import _torch
from hybridmem.ipc._wire import byte_offset, flat_words, word_unit

__all__ = ["Checked", "NamedTensors", "check_tensor", "validate"]

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]

#: (tensor class, dtype) pairs whose tensors were read as words once: all of them can.
_BYTE_VIEWABLE: set[tuple[type, torch.dtype]] = set()


class Checked(list[tuple[str, torch.Tensor]]):
    """What :meth:`WeightBucket.check` returned: pairs that passed every check."""


def validate(named: NamedTensors, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs, each checked (``Checked``: once already, taken as is)."""
    if isinstance(named, Checked):  # check()'s result: every tensor checked already
        return named
    if isinstance(named, torch.Tensor):
        raise TypeError("send() takes named tensors (a dict or (name, tensor) pairs)")
    pairs = list(named.items()) if isinstance(named, Mapping) else list(named)
    seen: set[str] = set()
    items: list[tuple[str, torch.Tensor]] = []
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise TypeError(f"expected (name, tensor) pairs, got {pair!r}")
        name, tensor = pair
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {name!r}")
        if name in seen:
            raise ValueError(f"tensor name {name!r} appears twice; names must be unique")
        seen.add(name)
        items.append((name, check_tensor(name, tensor, device)))
    return items


def _canonical_strides(tensor: torch.Tensor) -> torch.Tensor:
    """The same contiguous memory with row-major strides.

    ``is_contiguous()`` ignores the strides of an empty tensor and of dimensions of
    size 1, but reading the tensor as words needs the last stride to be 1: an empty or
    one-element slice ``t[::2]`` is contiguous with stride ``(2,)``.
    """
    strides = []
    step = 1
    for size in reversed(tensor.shape):
        strides.append(step)
        step *= max(size, 1)
    canonical = tuple(reversed(strides))
    if tensor.stride() == canonical:
        return tensor
    return tensor.as_strided(tensor.shape, canonical)


def check_tensor(name: str, tensor: object, device: torch.device) -> torch.Tensor:
    """Return ``tensor`` if a bucket on ``device`` can ship it, else raise naming it."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name!r} is a {type(tensor).__name__}, not a torch.Tensor")
    if callable(getattr(tensor, "to_local", None)):
        raise TypeError(
            f"{name!r} is a DTensor; send tensor.full_tensor() (or the local shard, "
            "tensor.to_local(), under a per-shard name)"
        )
    # Without CUDA the bucket is host memory on the CPU and ships CPU tensors (a
    # trainer and an engine without GPUs: vLLM on CPU, tests).
    on_cpu = device.type == "cpu" and tensor.device.type == "cpu"
    if not _torch.is_device_tensor(tensor) and not on_cpu:
        raise ValueError(
            f"{name!r} is on {tensor.device}; WeightBucket ships device tensors: move it "
            f"with .to('{device}') first"
        )
    if tensor.device != device and device.type == "cuda":
        raise ValueError(
            f"{name!r} is on {tensor.device} but this bucket is for {device}; "
            "use one bucket per device"
        )
    if tensor.layout != torch.strided:
        raise ValueError(f"{name!r} has layout {tensor.layout}; only dense tensors ship")
    if not tensor.is_contiguous():
        raise ValueError(f"{name!r} is not contiguous; pass tensor.contiguous() instead")
    tensor = _canonical_strides(tensor)
    if tensor.is_quantized:
        raise TypeError(
            f"{name!r} is a quantized tensor; send tensor.int_repr() and its scale and "
            "zero point as tensors of their own"
        )
    if tensor.is_conj() or tensor.is_neg():
        raise TypeError(
            f"{name!r} is a lazily conjugated or negated view; send tensor.resolve_conj() "
            "(or .resolve_neg()) instead"
        )
    # Any contiguous tensor ships, wherever it starts in its storage (a bf16 view at
    # an odd element of a flat parameter buffer moves as int16 words); this checks
    # here, before anything is sent, that it can be read as such words. Whether it
    # can depends on the tensor's class and dtype alone (the word width is chosen to
    # divide its size and offset), so each pair is tried once per process: the try
    # was half of a sync's checks.
    kind = (type(tensor), tensor.dtype)
    if kind not in _BYTE_VIEWABLE:
        try:
            flat_words(tensor, word_unit(tensor.nbytes, byte_offset(tensor))[1])
        except RuntimeError as exc:
            raise TypeError(f"{name!r} cannot be read as raw bytes ({exc}); send a copy") from None
        _BYTE_VIEWABLE.add(kind)
    return tensor
