"""The one seam between hybridmem and torch.

Every private or version-dependent torch call lives here, guarded, with the torch
version it applies to. Other modules call these functions through the module
(``_torch.empty_cache()``), so CPU tests can monkeypatch them; real behaviour is
checked by the GPU tests.

Nothing here initialises CUDA: functions that need a CUDA context say so and are
only called by hybridmem once :func:`cuda_initialized` is true.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Callable
from typing import Any, cast

import torch

from hybridmem._errors import AllocatorSettingsError

__all__ = [
    "api_report",
    "cuda_available",
    "cuda_built",
    "cuda_initialized",
    "cuda_version",
    "current_device",
    "current_stream",
    "device_count",
    "empty_cache",
    "has_context",
    "initialized_devices",
    "ipc_collect",
    "is_device_tensor",
    "last_allocator_settings",
    "local_tensor",
    "mem_get_info",
    "memory_stats",
    "new_stream",
    "pin_host_tensor",
    "reads_generic_alloc_conf",
    "runtime_allocator_backend",
    "set_allocator_settings",
    "settings_setter_name",
    "snapshot",
    "snapshot_allocator_settings",
    "stream_scope",
    "synchronize",
    "synchronize_stream",
    "torch_version",
    "torch_version_string",
    "unpin_host_tensor",
    "wait_stream",
]


def _parse_version(text: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", text)
    if match is None:  # pragma: no cover - torch always has a numeric version
        return (0, 0)
    return (int(match.group(1)), int(match.group(2)))


_TORCH_VERSION = _parse_version(torch.__version__)


def torch_version() -> tuple[int, int]:
    """Return torch's ``(major, minor)`` version, e.g. ``(2, 11)``."""
    return _TORCH_VERSION


def torch_version_string() -> str:
    """Return ``torch.__version__`` as a plain string, e.g. ``"2.11.0+cu130"``."""
    return str(torch.__version__)


# --------------------------------------------------------------------------- #
# Allocator settings
# --------------------------------------------------------------------------- #

# torch 2.10+ moved the setter to the accelerator-generic binding; the old
# ``torch.cuda.memory._set_allocator_settings`` still exists there but emits a
# FutureWarning. torch <= 2.9 only has the old one.
_NEW_SETTER = "_accelerator_setAllocatorSettings"
# torch 2.12+ only: returns the *last string set* (env or setter), not the
# effective configuration.
_GETTER = "_accelerator_getAllocatorSettings"


def _new_setter() -> Callable[[str], None] | None:
    fn = getattr(torch._C, _NEW_SETTER, None)
    return cast(Callable[[str], None], fn) if callable(fn) else None


def _old_setter() -> Callable[[str], None] | None:
    # torch 2.1 - 2.9: a Python wrapper over ``torch._C._cuda_cudaCachingAllocator_
    # set_allocator_settings``, which CPU-only builds of those versions lack.
    fn = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if not callable(fn):
        return None
    if _TORCH_VERSION < (2, 10) and not hasattr(
        torch._C, "_cuda_cudaCachingAllocator_set_allocator_settings"
    ):
        return None
    return cast(Callable[[str], None], fn)


def settings_setter_name() -> str | None:
    """Return the dotted name of the allocator-settings setter torch offers, or None."""
    if _new_setter() is not None:
        return "torch._C." + _NEW_SETTER
    if _old_setter() is not None:
        return "torch.cuda.memory._set_allocator_settings"
    return None


def set_allocator_settings(settings: str) -> bool:
    """Apply an allocator settings string through torch's setter.

    Works before CUDA is initialised (torch parses the string into its config
    singleton; the allocator reads it when it creates segments).

    Args:
        settings: a ``key:value,...`` string in torch's grammar.

    Returns:
        True if a setter existed and accepted the string, False if this torch
        build has no setter.

    Raises:
        AllocatorSettingsError: torch rejected the string (``ValueError`` on
            torch 2.10+, ``RuntimeError`` before; both are mapped here).
    """
    new = _new_setter()
    try:
        if new is not None:
            new(settings)
            return True
        old = _old_setter()
        if old is None:
            return False
        # On 2.10+ this path is never taken (the new setter exists); the filter
        # only guards odd builds so that torch's FutureWarning never reaches users.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            old(settings)
        return True
    except (ValueError, RuntimeError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise AllocatorSettingsError(
            f"torch rejected the allocator settings {settings!r}: {reason}"
        ) from exc


def last_allocator_settings() -> str | None:
    """Return the last settings string torch parsed (torch 2.12+), else None.

    This is the env string at start-up or the last string given to the setter,
    not the effective configuration; hybridmem uses it to notice settings changed
    behind its back.
    """
    if _GETTER_FN is None:
        return None
    value = _GETTER_FN()
    return value if isinstance(value, str) else None


# Bound once: it is called on every scope entry and exit (hot path).
_GETTER_FN: Callable[[], object] | None = getattr(torch._C, _GETTER, None)
if not callable(_GETTER_FN):
    _GETTER_FN = None


def snapshot() -> dict[str, Any] | None:
    """Return ``torch.cuda.memory._snapshot()`` when CUDA is initialised, else None.

    Costly (walks every segment): for diagnostics and tests, never a hot path.
    """
    if not cuda_initialized():
        return None
    fn = getattr(torch.cuda.memory, "_snapshot", None)
    if not callable(fn):
        return None
    result = fn()
    return result if isinstance(result, dict) else None


def snapshot_allocator_settings() -> dict[str, Any] | None:
    """Return the effective allocator settings torch reports in a snapshot.

    Available on torch builds whose snapshot carries ``allocator_settings``
    (2.5+), once CUDA is initialised; None otherwise.
    """
    snap = snapshot()
    if snap is None:
        return None
    settings = snap.get("allocator_settings")
    return dict(settings) if isinstance(settings, dict) else None


def reads_generic_alloc_conf() -> bool:
    """Return whether this torch reads ``PYTORCH_ALLOC_CONF`` for CUDA.

    torch 2.10+ reads ``PYTORCH_ALLOC_CONF`` first and ``PYTORCH_CUDA_ALLOC_CONF``
    as the deprecated fallback; 2.9.1 and older ignore the former for CUDA.
    """
    return _TORCH_VERSION >= (2, 10)


def runtime_allocator_backend() -> str | None:
    """Return the CUDA allocator backend torch is running (``native`` / ``cudaMallocAsync``).

    None on CPU-only builds. Does not create a CUDA context.
    """
    if not cuda_built():
        return None
    fn = getattr(torch._C, "_cuda_getAllocatorBackend", None)
    if not callable(fn):
        return None
    try:
        value = fn()
    except RuntimeError:
        return None
    return value if isinstance(value, str) else None


# --------------------------------------------------------------------------- #
# CUDA state (never creates a context)
# --------------------------------------------------------------------------- #


_CUDA_BUILT = torch.version.cuda is not None and hasattr(torch._C, "_cuda_getDeviceCount")
# torch ships these two without annotations; typed aliases keep mypy --strict honest.
_IS_INITIALIZED = cast(Callable[[], bool], torch.cuda.is_initialized)
_CUDART: Callable[[], Any] = torch.cuda.cudart
_CUDA_STREAM = cast(Callable[..., Any], torch.cuda.Stream)


def cuda_built() -> bool:
    """Return whether this torch build has CUDA support compiled in."""
    return _CUDA_BUILT


def cuda_version() -> str | None:
    """Return the CUDA version torch was built with, e.g. ``"13.0"``."""
    return torch.version.cuda


def cuda_available() -> bool:
    """Return ``torch.cuda.is_available()`` (queries the driver, no context)."""
    return cuda_built() and torch.cuda.is_available()


def device_count() -> int:
    """Return the number of visible CUDA devices (0 without CUDA)."""
    return torch.cuda.device_count() if cuda_built() else 0


def cuda_initialized() -> bool:
    """Return whether torch has initialised CUDA in this process."""
    return _CUDA_BUILT and _IS_INITIALIZED()


def current_device() -> int | None:
    """Return the current CUDA device index, or None when CUDA is not initialised."""
    if not cuda_initialized():
        return None
    return int(torch.cuda.current_device())


def has_context(index: int) -> bool:
    """Return whether device ``index`` has a primary CUDA context in this process.

    Uses ``torch._C._cuda_hasPrimaryContext`` (torch 1.x+), which asks the
    driver without creating one. Without it only the current device counts.
    """
    if not cuda_initialized():
        return False
    fn = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    if callable(fn):
        return bool(fn(index))
    return index == current_device()


def initialized_devices() -> list[int]:
    """Return the indices of devices with a CUDA context in this process."""
    if not cuda_initialized():
        return []
    return [i for i in range(device_count()) if has_context(i)]


def synchronize(index: int) -> None:
    """Wait for all work on device ``index`` (which must have a context)."""
    torch.cuda.synchronize(index)


def empty_cache() -> None:
    """Return cached free blocks to the driver (torch empties every device's cache)."""
    if cuda_initialized():
        torch.cuda.empty_cache()


def ipc_collect() -> None:
    """Release memory held for tensors shared over CUDA IPC that consumers dropped."""
    if cuda_initialized():
        cast(Callable[[], None], torch.cuda.ipc_collect)()


def memory_stats(index: int) -> dict[str, Any]:
    """Return the caching allocator's statistics for device ``index``."""
    if not cuda_initialized():
        return {}
    return dict(torch.cuda.memory_stats(index))


def mem_get_info(index: int) -> tuple[int, int]:
    """Return device-wide ``(free, total)`` bytes for a device that has a context."""
    free, total = torch.cuda.mem_get_info(index)
    return int(free), int(total)


# --------------------------------------------------------------------------- #
# Offload: streams, pinned host memory, sharded tensors
# --------------------------------------------------------------------------- #


def is_device_tensor(tensor: torch.Tensor) -> bool:
    """Return whether ``tensor`` lives in CUDA device memory (what offload moves)."""
    return bool(tensor.is_cuda)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Return the local shard of a DTensor (FSDP2, tensor parallel), else ``tensor``.

    ``DTensor.to_local()`` (torch 2.4+, public) shares the shard's storage, which is
    what offload frees and restores.
    """
    to_local = getattr(tensor, "to_local", None)
    if to_local is None or not callable(to_local):
        return tensor
    with torch.no_grad():
        local = to_local()
    return local if isinstance(local, torch.Tensor) else tensor


def new_stream(device: torch.device) -> Any:
    """Return a new CUDA stream on ``device`` (None for non-CUDA devices)."""
    return _CUDA_STREAM(device=device) if device.type == "cuda" else None


def current_stream(device: torch.device) -> Any:
    """Return the current stream of ``device`` (None for non-CUDA devices)."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def stream_scope(stream: Any) -> contextlib.AbstractContextManager[Any]:
    """Make ``stream`` current inside the block (a no-op for None)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def wait_stream(waiter: Any, waitee: Any) -> None:
    """Order ``waiter``'s later work after ``waitee``'s work queued so far."""
    if waiter is not None and waitee is not None:
        waiter.wait_stream(waitee)


def synchronize_stream(stream: Any) -> None:
    """Block the host until ``stream``'s queued work is done."""
    if stream is not None:
        stream.synchronize()


def pin_host_tensor(tensor: torch.Tensor) -> bool:
    """Page-lock a CPU tensor's memory in place with ``cudaHostRegister``.

    Unlike ``pin_memory=True`` (torch's caching host allocator rounds every
    allocation up to a power of two: 24 GiB would pin 32 GiB), registering an
    exact-size allocation pins exactly what is asked. Returns False when CUDA is
    absent or registration failed (the tensor stays pageable).
    """
    if not cuda_available():
        return False
    cudart = _CUDART()
    # flag 1 = cudaHostRegisterPortable: pinned for every CUDA context in the process
    status = int(cudart.cudaHostRegister(tensor.data_ptr(), tensor.nbytes, 1))
    return status == 0


def unpin_host_tensor(data_ptr: int) -> None:
    """Undo :func:`pin_host_tensor` (errors ignored: the process may be exiting)."""
    with contextlib.suppress(Exception):  # CUDA may already be torn down at exit
        _CUDART().cudaHostUnregister(data_ptr)


def api_report() -> dict[str, bool]:
    """Return which version-dependent torch APIs this build offers (for ``doctor``)."""
    return {
        "torch._C._accelerator_setAllocatorSettings": _new_setter() is not None,
        "torch.cuda.memory._set_allocator_settings": callable(
            getattr(torch.cuda.memory, "_set_allocator_settings", None)
        ),
        "torch._C._accelerator_getAllocatorSettings": callable(getattr(torch._C, _GETTER, None)),
        "torch.cuda.memory._snapshot": callable(getattr(torch.cuda.memory, "_snapshot", None)),
        "torch._C._cuda_hasPrimaryContext": callable(
            getattr(torch._C, "_cuda_hasPrimaryContext", None)
        ),
        "torch._C._cuda_getAllocatorBackend": callable(
            getattr(torch._C, "_cuda_getAllocatorBackend", None)
        ),
    }
