"""SGLang's ``update_weights``, sending SGLang's ``flattened_bucket`` payload from one buffer.

SGLang 0.5.23's ``sglang.srt.weight_sync.utils.update_weights(engine, params_batch,
device_mesh_key, device_mesh, load_format)`` (what verl's SGLang rollout calls)
serializes one CUDA IPC handle per tensor. SGLang's server also takes
``load_format="flattened_bucket"``: one flat uint8 tensor and each tensor's
``(name, shape, dtype, start_idx, end_idx, numel)``, which it rebuilds with its own
``FlattenedTensorBucket.reconstruct_tensors`` and loads (per tensor: 11-13.5 s per sync
against about 3.0 s flattened, Qwen3-30B-A3B on 8 H200s, in the field).

:func:`update_weights` takes SGLang's signature and sends that payload, built here
rather than with SGLang's ``FlattenedTensorBucket``, which cannot carry what the
per-tensor path can:

- the tensors are copied into one buffer per process and device, made once (again
  only to grow) in classic segments, so CUDA IPC needs no ``pidfd_getfd`` and the
  consumer opens the same handle every sync;
- each tensor starts at a multiple of its element size (SGLang's packs without
  padding: an int8[3] followed by an fp32 cannot be rebuilt), and a strided view is
  copied as its values (SGLang's ``view(torch.uint8)`` of a flattened strided view
  fails);
- an empty batch goes SGLang's per-tensor way (its bucket refuses an empty one), and
  so does any ``load_format`` other than None or ``"flattened_bucket"``.

The buffer is reused only after the engine has answered the call that read it (the
call returns once the weights are loaded). SGLang's ``--custom-weight-loader`` is
not needed to avoid ``pidfd_getfd``: the buffer is in classic segments.

Scope: one call at a time per process and device (a lock).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from hybridmem._log import logger
from hybridmem.scopes.ipc_safe import ipc_safe

__all__ = ["FLATTENED", "flattened_payload", "release_buffers", "update_weights"]

#: SGLang's name for the payload this module sends.
FLATTENED = "flattened_bucket"

_buffers: dict[torch.device, torch.Tensor] = {}
_lock = threading.Lock()


def _align(offset: int, size: int) -> int:
    return (offset + size - 1) // size * size


def _buffer(device: torch.device, nbytes: int) -> torch.Tensor:
    """The persistent buffer for ``device``, grown (once more) when too small."""
    current = _buffers.get(device)
    if current is not None and current.numel() >= nbytes:
        return current
    _buffers.pop(device, None)
    del current
    with ipc_safe(fallback="auto"):  # classic segments: CUDA IPC without pidfd_getfd
        made = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
    _buffers[device] = made
    logger.info("sglang drop-in: a %d-byte flattened buffer on %s", made.numel(), device)
    return made


def flattened_payload(
    params_batch: list[tuple[str, torch.Tensor]], metadata_type: Any
) -> dict[str, Any]:
    """SGLang's ``flattened_bucket`` payload for ``params_batch``, out of the persistent buffer.

    Args:
        params_batch: ``(name, tensor)`` pairs, on one device.
        metadata_type: SGLang's ``FlattenedTensorMetadata`` (or any class taking
            ``name, shape, dtype, start_idx, end_idx, numel``).

    Returns:
        ``{"flattened_tensor": ..., "metadata": [...]}``, as SGLang's server reads it.
        The flat tensor is a view of the buffer: valid until the next call.

    Raises:
        TypeError: an item is not a ``(name, tensor)`` pair.
        ValueError: an empty batch, or tensors on several devices.
    """
    if not params_batch:
        raise ValueError("an empty batch has no flattened payload (SGLang refuses one)")
    layout = []
    offset = 0
    devices = set()
    for item in params_batch:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
            raise TypeError(f"params_batch holds (name, tensor) pairs, got {item!r}")
        name, tensor = item
        devices.add(tensor.device)
        offset = _align(offset, tensor.element_size())
        nbytes = tensor.numel() * tensor.element_size()
        layout.append((name, tensor, offset, nbytes))
        offset += nbytes
    if len(devices) != 1:
        raise ValueError(f"params_batch spans several devices ({sorted(map(str, devices))})")
    buffer = _buffer(devices.pop(), offset)
    metadata = []
    for name, tensor, start, nbytes in layout:
        view = buffer[start : start + nbytes].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor.detach())
        metadata.append(
            metadata_type(name, tensor.shape, tensor.dtype, start, start + nbytes, nbytes)
        )
    if buffer.is_cuda:
        torch.cuda.current_stream(buffer.device).synchronize()  # the engine reads after this
    return {"flattened_tensor": buffer[:offset], "metadata": metadata}


async def update_weights(
    engine: Any,
    params_batch: list[tuple[str, torch.Tensor]],
    device_mesh_key: str,
    device_mesh: Any,
    load_format: str | None = None,
) -> Any:
    """SGLang's ``update_weights``, sending a ``flattened_bucket`` payload (see the module).

    Args:
        engine, params_batch, device_mesh_key, device_mesh, load_format: as SGLang's
            (``sglang.srt.weight_sync.utils.update_weights``). A DTensor is gathered
            (``full_tensor()``) as SGLang's does.

    Returns:
        What ``engine.update_weights_from_tensor`` returns (on the mesh's first rank),
        else None, as SGLang's.

    Raises:
        ImportError: SGLang is not installed.
    """
    from sglang.srt.weight_sync import utils as sglang_sync

    if load_format not in (None, FLATTENED) or not params_batch:
        return await sglang_sync.update_weights(
            engine, params_batch, device_mesh_key, device_mesh, load_format
        )
    import torch.distributed as dist
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

    monkey_patch_torch_reductions()
    mesh = device_mesh[device_mesh_key]
    size, rank = mesh.mesh.size()[0], mesh.get_local_rank()
    full = [
        (name, sglang_sync._preprocess_tensor_for_update_weights(tensor.detach()))
        for name, tensor in params_batch
    ]
    with _lock:
        payload = flattened_payload(full, FlattenedTensorMetadata)
        serialized = MultiprocessingSerializer.serialize(payload)
        gathered: list[Any] | None = [None] * size if rank == 0 else None
        dist.gather_object(
            obj=serialized,
            object_gather_list=gathered,
            dst=mesh.mesh.tolist()[0],
            group=mesh.get_group(),
        )
        if rank != 0:
            dist.barrier(group=mesh.get_group())  # the buffer is reused once it was read
            return None
        request = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=gathered, load_format=FLATTENED
        )
        try:
            return await engine.update_weights_from_tensor(request)
        finally:
            dist.barrier(group=mesh.get_group())


def release_buffers() -> None:
    """Free this process's flattened buffers (the next call makes them again)."""
    with _lock:
        _buffers.clear()
