"""GPU scenario: an offload frees and releases its storages as their copies land.

Run by ``tests/gpu/test_offload_gpu.py``: ``python -m tests.gpu.landing_scenarios NAME``
prints the facts as one JSON line.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import hybridmem as hm
from hybridmem import _torch
from hybridmem.memory.offload_free import LANDING_CHUNK_BYTES

MiB = 1 << 20
TENSOR = 48 * MiB
COUNT = 64  # 3 GiB: six landings of 512 MiB


def _expected(index: int) -> torch.Tensor:
    return torch.full((TENSOR // 4,), float(index) + 0.5, device="cuda")


def _exact(tensors: list[torch.Tensor]) -> bool:
    return all(torch.equal(t, _expected(i)) for i, t in enumerate(tensors))


def offload_lands_by_chunks() -> dict[str, Any]:
    """Chunked release on real CUDA: exact, everything returned, a fault puts back."""
    with hm.expandable_segments(True):
        tensors = [_expected(i) for i in range(COUNT)]
    torch.cuda.synchronize()
    releases: list[float] = []
    real_release = _torch.empty_cache

    def counting() -> None:
        releases.append(time.perf_counter())
        real_release()

    _torch.empty_cache = counting
    out: dict[str, Any] = {"chunk": LANDING_CHUNK_BYTES, "state": COUNT * TENSOR}
    reserved = torch.cuda.memory_reserved()
    off = hm.Offloader(tensors)
    for label in ("planned", "streamed"):  # the first offload plans; later ones stream
        releases.clear()
        free = torch.cuda.mem_get_info()[0]
        report = off.offload()
        out[f"{label}_releases"] = len(releases)
        out[f"{label}_returned"] = torch.cuda.mem_get_info()[0] - free
        out[f"{label}_reserved_drop"] = reserved - torch.cuda.memory_reserved()
        out[f"{label}_gbps"] = report.gbps
        off.reload()
        out[f"{label}_exact"] = _exact(tensors)
        reserved = torch.cuda.memory_reserved()
    # the third chunk's first free fails: the two chunks before it come back
    real_resize = _torch.resize_storage
    frees = [0]
    per_chunk = -(-LANDING_CHUNK_BYTES // TENSOR)

    def failing(storage: Any, nbytes: int) -> None:
        if nbytes == 0:
            frees[0] += 1
            if frees[0] == 2 * per_chunk + 1:
                raise RuntimeError("injected: the driver refused")
        real_resize(storage, nbytes)

    _torch.resize_storage = failing
    try:
        off.offload()
        out["fault"] = "offloaded"
    except hm.OffloadError as exc:
        out["fault"] = str(exc)
    _torch.resize_storage = real_resize
    out["fault_offloaded"] = sorted(off.offloaded_groups)
    out["fault_exact"] = _exact(tensors)
    off.offload()
    off.reload()
    out["after_fault_exact"] = _exact(tensors)
    # the same offload freed once every copy landed, then released (report only)
    start = time.perf_counter()
    off.offload(release_cache=False)
    real_release()
    out["then_release_s"] = time.perf_counter() - start
    off.reload()
    start = time.perf_counter()
    off.offload()
    out["as_landed_s"] = time.perf_counter() - start
    off.reload()
    # Decision 90: other device work beside the copies (as the weights and the KV
    # cache wake under them in the switch); the report times the copies alone.
    work = torch.randn(8192, 8192, device="cuda")
    flight = off.start_offload()
    started = time.perf_counter()
    for _ in range(10):  # ~0.2 s on an H200, the copies ~60 ms
        work = torch.tanh(work @ work)  # bounded values; the result is not the point
    torch.cuda.synchronize()
    out["beside_s"] = time.perf_counter() - started
    report = flight.finish()
    out["beside_seconds"] = report.seconds
    out["beside_copy_seconds"] = report.copy_seconds
    out["beside_gbps"], out["beside_copy_gbps"] = report.gbps, report.copy_gbps
    del work
    off.reload()
    out["final_exact"] = _exact(tensors)
    off.close()
    return out


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    "offload_lands_by_chunks": offload_lands_by_chunks,
}

if __name__ == "__main__":
    print(json.dumps(SCENARIOS[sys.argv[1]](), default=str))
