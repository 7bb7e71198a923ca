"""Resolve a user's ``device`` argument to CUDA device indices, never creating a context."""

from __future__ import annotations

from typing import Literal, TypeAlias

import torch

from hybridmem import _torch

__all__ = ["DeviceArg", "device_index", "resolve_devices"]

#: What ``device=`` accepts: None (the current device), an index, ``"cuda"``,
#: ``"cuda:N"``, a ``torch.device`` of type cuda, or ``"all"`` where allowed.
DeviceArg: TypeAlias = int | str | torch.device | None

_MAX_INDEX = 127  # torch's c10::DeviceIndex is an 8-bit integer
_ALLOWED = "None (the current device), an int index, 'cuda', 'cuda:N' or torch.device('cuda', N)"
_ONE = "one CUDA device: an int index, 'cuda:N' or torch.device('cuda', N)"


def _index_of(
    device: int | str | torch.device, *, allow_all: bool, without_cuda_ok: bool = False
) -> int | Literal["all"] | None:
    """Return the index named by ``device`` (None = current device) or ``"all"``.

    ``without_cuda_ok``: on a machine with no visible CUDA device, accept any index
    (for callers with an answer of their own there: a probe that reports "no CUDA", a
    bucket that falls back to host memory); elsewhere such an index is out of range.
    """
    if isinstance(device, bool):
        raise TypeError(f"device must be one CUDA device: {_ALLOWED}; got the bool {device!r}")
    if isinstance(device, int):
        index: int | None = device
    elif isinstance(device, str):
        if device == "all":
            if not allow_all:
                raise ValueError(
                    f"device='all' is not accepted here; pass {_ALLOWED}, or call once per device"
                )
            return "all"
        try:
            parsed = torch.device(device)
        except RuntimeError:
            extra = ", or 'all'" if allow_all else ""
            raise ValueError(f"device {device!r} is not a device; pass {_ALLOWED}{extra}") from None
        return _index_of(parsed, allow_all=allow_all, without_cuda_ok=without_cuda_ok)
    elif isinstance(device, torch.device):
        if device.type != "cuda":
            raise ValueError(
                f"device {device} is not a CUDA device; hybridmem manages CUDA memory. "
                f"Pass one CUDA device: {_ALLOWED}."
            )
        index = device.index
    else:
        raise TypeError(f"device must be {_ALLOWED}; got {device!r} ({type(device).__name__})")
    if index is not None:
        if index < 0:
            raise ValueError(f"device index must be >= 0, got {index}")
        if index > _MAX_INDEX:
            raise ValueError(
                f"device index {index} is out of range: torch numbers devices 0 to {_MAX_INDEX}"
            )
        count = _torch.device_count()
        if index >= count and not (count == 0 and without_cuda_ok):
            # Also without CUDA: a device that is named and not there is a mistake, not
            # a no-op; only device=None stays a harmless no-op on such a machine.
            if not _torch.cuda_built():
                where = "this torch is built without CUDA, so no CUDA device is visible"
            elif count == 0:
                where = "no CUDA device is visible (check CUDA_VISIBLE_DEVICES and the driver)"
            else:
                where = (
                    f"{count} CUDA device(s) are visible, indices 0 to {count - 1} "
                    "(check CUDA_VISIBLE_DEVICES)"
                )
            raise ValueError(f"device index {index} is out of range: {where}")
    return index


def resolve_devices(device: DeviceArg, *, allow_all: bool = False) -> list[int]:
    """Return the initialised CUDA devices that ``device`` names.

    Validates ``device`` on every machine (bad types and negative indices raise
    everywhere), then keeps only devices that already have a CUDA context in this
    process, so that nothing here ever creates one (a context costs hundreds of
    MiB on the device it lands on, and device 0 is the usual victim).

    Args:
        device: None for the current device, an index, ``"cuda[:N]"``, a
            ``torch.device``, or ``"all"`` (every initialised device) when
            ``allow_all`` is true.

    Returns:
        Sorted device indices with a context; empty when CUDA is not initialised.

    Raises:
        TypeError: ``device`` has the wrong type.
        ValueError: ``device`` is negative, out of range (also on a machine without
            CUDA, where only None and ``"all"`` name nothing harmlessly), not CUDA,
            or ``"all"`` where not allowed.
    """
    index = None if device is None else _index_of(device, allow_all=allow_all)
    if not _torch.cuda_initialized():
        return []
    if index == "all":
        return _torch.initialized_devices()
    if index is None:
        current = _torch.current_device()
        if current is None:
            return []
        index = current
    return [index] if _torch.has_context(index) else []


def device_index(device: DeviceArg, *, current: bool = True) -> int:
    """Return the one CUDA device index that ``device`` names, without creating a context.

    None, ``"cuda"`` and ``torch.device("cuda")`` mean the current device: torch's
    current device once CUDA is initialised, else 0 (the device a fresh process
    starts on). ``"all"`` is not accepted.

    Args:
        device: what the user passed.
        current: whether the current device may be meant; False where the caller
            has its own meaning for "no index" (an Offloader takes its targets'
            device), so that ``"cuda"`` is refused instead of guessed.

    Raises:
        TypeError: ``device`` has the wrong type.
        ValueError: ``device`` is negative, out of range, not CUDA, or names no
            index where ``current`` is False.

    Example:
        >>> device_index("cuda:1")   # doctest: +SKIP
        1
    """
    index = None if device is None else _index_of(device, allow_all=False, without_cuda_ok=True)
    if isinstance(index, int):
        return index
    if not current:
        raise ValueError(f"device must name {_ONE}; got {device!r}")
    now = _torch.current_device()
    return 0 if now is None else now
