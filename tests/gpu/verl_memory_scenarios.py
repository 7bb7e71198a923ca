"""What verl's drop-in leaves on the device between syncs, beside verl's own pair, on a GPU.

Usage: ``python -m tests.gpu.verl_memory_scenarios NAME``; the last line printed is a
JSON object of facts. The trainer (this process) sends a model of about 1 GiB, the
engine (a ``spawn`` process) copies each received tensor into its own copy of it, as
vLLM's ``load_weights`` does. verl 0.9.1's own ``BucketedWeightSender`` and
``BucketedWeightReceiver`` run from its wheel (``HYBRIDMEM_VERL_WHEEL``) over real ZMQ
and CUDA IPC, their device helpers answered by CUDA (:func:`verl_transfer`); the
drop-in runs as verl's call sites run it. After each round of syncs the trainer reads
its own reserved memory, the engine's (in its answer, after its receiver returned), and
the device's free memory.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import types
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.multiprocessing as tmp

from tests.gpu.ipc_scenarios import _init_cuda

MiB = 1 << 20
_ctx = tmp.get_context("spawn")
HANDLE = "ipc:///tmp/hybridmem-gpu-verl-memory-{}.sock"
BUCKET_MB = 256  # verl's default is 512; the model is four buckets and more


def verl_transfer() -> types.ModuleType:
    """verl 0.9.1's bucketed transfer from its wheel, with CUDA as verl's device (real ZMQ)."""
    from tests import verl_transfer_oracle

    source = verl_transfer_oracle.transfer_source()
    if source is None:
        raise FileNotFoundError("set HYBRIDMEM_VERL_WHEEL to verl 0.9.1's wheel")
    device = types.ModuleType("verl.utils.device")
    device.get_device_id = torch.cuda.current_device  # type: ignore[attr-defined]
    device.get_device_name = lambda: "cuda"  # type: ignore[attr-defined]
    device.get_torch_device = lambda: torch.cuda  # type: ignore[attr-defined]
    device.is_support_ipc = lambda: True  # type: ignore[attr-defined]
    sys.modules["verl.utils.device"] = device
    # verl's sender imports its async-iterator helper when it sends: the oracle's own.
    sys.modules["verl.workers.rollout.utils"] = verl_transfer_oracle._rollout_utils()
    module = types.ModuleType("verl_bucketed_weight_transfer")
    module.__file__ = verl_transfer_oracle.TRANSFER
    exec(compile(source, verl_transfer_oracle.TRANSFER, "exec"), module.__dict__)
    return module


def _model() -> dict[str, torch.Tensor]:
    """About 1 GiB in bf16 matrices of a few sizes, and small fp32 norms."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(16):
        shape = (4096, 7168 + 256 * (layer % 3))
        tensors[f"layers.{layer}.mlp"] = torch.randn(shape, generator=generator, device="cuda").to(
            torch.bfloat16
        )
        tensors[f"layers.{layer}.norm"] = torch.randn(4096, generator=generator, device="cuda")
    return tensors


def _engine(control: Connection) -> None:
    """The engine: its own copy of the model; one sync per command, then its counters."""
    _init_cuda()
    from hybridmem.integrations.verl.transfer import BucketedWeightReceiver

    verl = verl_transfer()
    out = {name: torch.empty_like(t) for name, t in _model().items()}
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    device = torch.device("cuda", torch.cuda.current_device())

    def load(weights: list[tuple[str, torch.Tensor]], last: bool) -> None:
        for name, tensor in weights:
            out[name].copy_(tensor)

    while True:
        command = control.recv()
        if command[0] == "stop":
            return
        kind, handle = command
        receiver = verl.BucketedWeightReceiver if kind == "verl" else BucketedWeightReceiver
        receiver(handle, device).receive_weights(load)
        torch.cuda.synchronize()
        control.send((torch.cuda.memory_reserved(), torch.cuda.memory_allocated()))


def verl_holds(syncs: int = 10) -> dict[str, Any]:
    """Rounds of ``syncs`` syncs: verl's pair twice, the drop-in, verl's again, the kept bucket."""
    _init_cuda()
    from hybridmem.integrations.verl import link, settings
    from hybridmem.integrations.verl.transfer import BucketedWeightSender

    verl = verl_transfer()
    tensors = _model()
    torch.cuda.synchronize()
    control, child = _ctx.Pipe()
    engine = _ctx.Process(target=_engine, args=(child,))
    engine.start()
    child.close()
    senders: dict[str, Callable[[str], Any]] = {
        "verl": lambda h: verl.BucketedWeightSender(h, bucket_size_mb=BUCKET_MB),
        "drop-in": lambda h: BucketedWeightSender(h, bucket_size_mb=BUCKET_MB),
        "drop-in-kept": lambda h: BucketedWeightSender(
            h, bucket_size_mb=BUCKET_MB, keep_bucket=True
        ),
    }

    def sync(kind: str) -> tuple[int, int]:
        handle = HANDLE.format(kind)
        control.send(("verl" if kind == "verl" else "drop-in", handle))
        asyncio.run(senders[kind](handle).async_send_weights(iter(tensors.items())))
        if not control.poll(120):
            raise TimeoutError(f"the engine did not answer a {kind} sync")
        answer: tuple[int, int] = control.recv()
        return answer

    def reading(kind: str) -> dict[str, Any]:
        for _ in range(syncs):
            engine_reserved, engine_allocated = sync(kind)
        torch.cuda.synchronize()
        return {
            "kind": kind,
            "trainer_reserved": torch.cuda.memory_reserved(),
            "trainer_allocated": torch.cuda.memory_allocated(),
            "engine_reserved": engine_reserved,
            "engine_allocated": engine_allocated,
            "device_free": torch.cuda.mem_get_info()[0],
        }

    rows: list[dict[str, Any]] = []
    try:
        os.environ.pop("HYBRIDMEM_VERL_KEEP_BUCKET", None)
        for kind in ("verl", "drop-in"):  # each path's one-time set-up (contexts, kernels)
            sync(kind)
        # verl's pair twice before the drop-in (what its steady state leaves), once after
        # (the same device state the drop-in saw), then the kept bucket.
        for kind in ("verl", "verl", "drop-in", "verl", "drop-in-kept"):
            rows.append(reading(kind))
        control.send(("stop",))
    finally:
        link.close_links()
        engine.join(timeout=60)
        if engine.is_alive():
            engine.kill()
    return {
        "rows": rows,
        "engine_exit": engine.exitcode,
        "model_bytes": sum(t.nbytes for t in tensors.values()),
        "bucket_bytes": BUCKET_MB * MiB,
        "kept_buffers": settings.buffers(keep=True),
    }


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {"verl_holds": verl_holds}

if __name__ == "__main__":
    print(json.dumps(SCENARIOS[sys.argv[1]](), default=str))
