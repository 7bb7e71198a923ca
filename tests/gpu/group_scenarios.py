"""Groups of a bucket handed out as views, on a real GPU: verl's drop-in end to end.

Usage: ``python -m tests.gpu.group_scenarios NAME``; the last line printed is a JSON
object of facts. The trainer (this process) sends with hybridmem's
``BucketedWeightSender``; the engine (a ``spawn`` process) receives with its
``BucketedWeightReceiver``, and its callback queues slow work on the device (a spin
kernel) before it copies each view: a sender that refilled a buffer before the
engine's queued copies out of it ran would corrupt what the engine keeps.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.multiprocessing as tmp

from tests.gpu.ipc_scenarios import _checksum, _init_cuda

MiB = 1 << 20
_ctx = tmp.get_context("spawn")
HANDLE = "ipc:///tmp/hybridmem-gpu-verl-views.sock"
SPIN_CYCLES = 20_000_000  # ~10 ms of device time per callback, queued before its copies


def _model(seed: int) -> dict[str, torch.Tensor]:
    """Tensors as a model's (bf16 matrices, an fp8-like int8[3] with its fp32 scale, one
    larger than the 32 MiB bucket, empty and 0-d ones), with values from ``seed``."""
    generator = torch.Generator(device="cuda").manual_seed(seed)

    def noise(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        values = torch.randn(shape, generator=generator, device="cuda")
        return (values * 100).to(dtype)

    tensors: dict[str, torch.Tensor] = {"embed": noise((40 * MiB // 2,), torch.bfloat16)}
    for layer in range(12):
        tensors[f"layers.{layer}.qkv"] = noise((1024, 3 * 1024 + layer), torch.bfloat16)
        tensors[f"layers.{layer}.fp8"] = noise((3,), torch.int8)
        tensors[f"layers.{layer}.scale"] = noise((1,), torch.float32)
        tensors[f"layers.{layer}.norm"] = noise((1024,), torch.float32)
        tensors[f"layers.{layer}.empty"] = noise((0, 4), torch.float16)
    tensors["step"] = noise((), torch.float64)
    return tensors


def _in_bucket(tensor: torch.Tensor, buffers: list[torch.Tensor]) -> bool:
    """Whether ``tensor``'s bytes lie in one of the bucket's buffers (a view of it)."""
    start = tensor.data_ptr()
    return any(
        b.data_ptr() <= start and start + tensor.nbytes <= b.data_ptr() + b.nbytes for b in buffers
    )


def _spin() -> None:
    torch.cuda._sleep(SPIN_CYCLES)  # type: ignore[no-untyped-call]


def _receive_one(fail_at: int, out: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One sync into ``out``; the callback numbered ``fail_at`` raises after queuing reads."""
    from hybridmem.integrations.verl import link
    from hybridmem.integrations.verl.transfer import BucketedWeightReceiver

    calls: list[bool] = []
    viewed: list[bool] = []
    zero_copy: list[bool] = []  # the bucket is closed once the sync ends: read during it

    def load(weights: list[tuple[str, torch.Tensor]], last: bool) -> None:
        calls.append(last)
        receiver = link._receivers[HANDLE].receiver
        assert receiver is not None  # open during the sync
        zero_copy.append(receiver.zero_copy)
        buffers = receiver._buffers
        _spin()  # slow work queued first: the reads below wait for it on the device
        for name, tensor in weights:
            if tensor.numel():
                viewed.append(_in_bucket(tensor, buffers))
            out.setdefault(name, torch.empty_like(tensor)).copy_(tensor)
        if len(calls) == fail_at:
            raise ValueError("the engine's loader failed")  # its reads are still queued

    error = None
    try:
        device = torch.device("cuda", torch.cuda.current_device())
        BucketedWeightReceiver(HANDLE, device).receive_weights(load)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    torch.cuda.synchronize()
    return {
        "error": error,
        "calls": len(calls),
        "lasts": sum(calls),
        "views": sum(viewed),
        "copies": len(viewed) - sum(viewed),
        "zero_copy": all(zero_copy),
        "checksums": {name: _checksum(t) for name, t in out.items()},
    }


def _engine(control: Connection) -> None:
    """The engine: receives each sync into its own copy, reports checksums and facts."""
    _init_cuda()
    out: dict[str, torch.Tensor] = {}
    while True:
        command = control.recv()
        if command[0] == "stop":
            control.send(("bye",))
            return
        control.send(_receive_one(command[1], out))


def verl_views(syncs: int = 6, fail_sync: int = 2) -> dict[str, Any]:
    """Syncs through verl's drop-in: views, intact after a failed sync, every callback."""
    _init_cuda()
    from hybridmem._errors import SyncError
    from hybridmem.integrations.verl import link
    from hybridmem.integrations.verl.transfer import BucketedWeightSender

    control, child = _ctx.Pipe()
    engine = _ctx.Process(target=_engine, args=(child,))
    engine.start()
    child.close()
    rows: list[dict[str, Any]] = []
    try:
        for step in range(syncs):
            tensors = _model(seed=step)
            fail_at = 3 if step == fail_sync else 0
            # The last sync's weights are written on a stream of the trainer's own, behind
            # slow work, and sent from inside it: the copies must wait for that stream.
            own_stream = step == syncs - 1
            final = _model(seed=step + 100) if own_stream else tensors
            torch.cuda.synchronize()
            control.send(("sync", fail_at))
            sender = BucketedWeightSender(HANDLE, bucket_size_mb=32)
            sent_error = None
            stream = torch.cuda.current_stream()
            if own_stream:
                stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            try:
                with torch.cuda.stream(stream):
                    if own_stream:
                        _spin()
                        for name, tensor in tensors.items():
                            tensor.copy_(final[name])
                    asyncio.run(sender.async_send_weights(iter(tensors.items())))
            except SyncError as exc:
                sent_error = str(exc)
            answer = control.poll(120) and control.recv()
            if not answer:
                raise TimeoutError(f"the engine did not answer sync {step}")
            torch.cuda.synchronize()
            expected = {name: _checksum(t) for name, t in final.items()}
            rows.append(
                {
                    "step": step,
                    "own_stream": own_stream,
                    "failed_here": bool(fail_at),
                    "sender_error": sent_error,
                    "engine_error": answer["error"],
                    "calls": answer["calls"],
                    "lasts": answer["lasts"],
                    "views": answer["views"],
                    "copies": answer["copies"],
                    "zero_copy": answer["zero_copy"],
                    "intact": answer["checksums"] == expected,
                    "bad": sorted(n for n in expected if answer["checksums"].get(n) != expected[n])[
                        :5
                    ],
                }
            )
        control.send(("stop",))
        control.poll(60) and control.recv()
    finally:
        link.close_links()
        engine.join(timeout=60)
        if engine.is_alive():
            engine.kill()
    return {"rows": rows, "engine_exit": engine.exitcode, "tensors": len(_model(0))}


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {"verl_views": verl_views}

if __name__ == "__main__":
    print(json.dumps(SCENARIOS[sys.argv[1]](), default=str))
