"""What pinning a host pool costs on the device, by method: the Offloader's choice, measured.

Issue #25: the Offloader's pool, pinned with ``cudaHostRegister``, grew the CUDA
context by +76 MiB of device memory per 3 GiB pinned, against +6 MiB for torch's
``cudaHostAlloc`` path. This script pins the same bytes each way, each in a fresh
process on an otherwise idle GPU, and prints per method: device memory outside the
allocator that pinning added (``total - free - reserved``, after minus before),
the host bytes it took (torch's caching host allocator rounds up to a power of
two), the seconds pinning took, and the D2H and H2D rates of one copy of a device tensor
of the same size into and out of it.

Methods:

- ``register``: ``torch.empty`` (malloc) + ``cudaHostRegister`` (the Offloader
  before #25);
- ``register-thp``: an anonymous ``mmap`` advised ``MADV_HUGEPAGE`` +
  ``cudaHostRegister`` (the Offloader since #25: ``hybridmem._platform.host_memory``);
- ``hostalloc``: ``cudaHostAlloc`` (the runtime's own pinned allocation, exact size);
- ``torch``: ``torch.empty(pin_memory=True)`` (torch's caching host allocator).

Run on a GPU: ``python benchmarks/pinning.py [--gib 3 12] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MiB = 1 << 20
GiB = 1 << 30
METHODS = ("register", "register-thp", "hostalloc", "torch")


def _outside() -> int:
    import torch

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return int(total - free - torch.cuda.memory_reserved())


def _host_alloc(nbytes: int) -> tuple[Any, Any]:
    """``cudaHostAlloc`` through the CUDA runtime torch loaded (ctypes): (tensor, freer)."""
    import ctypes

    import torch

    with open("/proc/self/maps") as maps:
        path = next(line.split()[-1] for line in maps if "libcudart.so" in line)
    cudart = ctypes.CDLL(path)
    cudart.cudaHostAlloc.argtypes = [
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.c_size_t,
        ctypes.c_uint,
    ]
    cudart.cudaFreeHost.argtypes = [ctypes.c_void_p]
    address = ctypes.c_void_p()
    assert cudart.cudaHostAlloc(ctypes.byref(address), nbytes, 1) == 0  # portable
    array = (ctypes.c_ubyte * nbytes).from_address(int(address.value or 0))
    return torch.frombuffer(array, dtype=torch.uint8), lambda: cudart.cudaFreeHost(address)


def _pin(method: str, nbytes: int) -> tuple[Any, int, Any]:
    """Return (host uint8 tensor of nbytes, host bytes taken, what keeps it alive)."""
    import torch

    from hybridmem import _torch
    from hybridmem._platform.host_memory import huge_page_region

    if method == "register":
        pool = torch.empty(nbytes, dtype=torch.uint8)
        assert _torch.pin_host_tensor(pool)
        return pool, nbytes, None
    if method == "register-thp":  # the Offloader's pool since #25
        region = huge_page_region(nbytes)
        pool = torch.frombuffer(region, dtype=torch.uint8)
        assert _torch.pin_host_tensor(pool)
        return pool, nbytes, region
    if method == "hostalloc":
        tensor, free = _host_alloc(nbytes)
        return tensor, nbytes, free
    pool = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    rounded = 1 << (nbytes - 1).bit_length()
    return pool, rounded, None


def _measure(method: str, nbytes: int, answers: Any) -> None:
    import torch

    torch.zeros(1, device="cuda")
    device_tensor = torch.randn(nbytes // 4, device="cuda").view(torch.uint8)
    before = _outside()
    started = time.perf_counter()
    pool, host_bytes, keep = _pin(method, nbytes)
    pinned_s = time.perf_counter() - started
    grew = _outside() - before
    rates = {}
    for direction in ("d2h", "h2d", "d2h", "h2d"):  # the second pair is timed
        dst, src = (pool, device_tensor) if direction == "d2h" else (device_tensor, pool)
        torch.cuda.synchronize()
        started = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        rates[direction] = nbytes / (time.perf_counter() - started) / 1e9
    answers.put(
        {
            "method": method,
            "gib": nbytes / GiB,
            "device_mib": grew / MiB,
            "device_mib_per_gib": grew / MiB / (nbytes / GiB),
            "host_gib": host_bytes / GiB,
            "pin_s": pinned_s,
            "d2h_gbps": rates["d2h"],
            "h2d_gbps": rates["h2d"],
        }
    )
    del pool, keep


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, nargs="+", default=[3.0, 12.0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    rows = []
    for gib in args.gib:
        for method in args.methods:
            answers = ctx.Queue()
            process = ctx.Process(target=_measure, args=(method, int(gib * GiB), answers))
            process.start()
            row = answers.get(timeout=300)
            process.join(60)  # gone, with its context, before the next one measures
            rows.append(row)
    print(
        f"{'method':<13} {'GiB':>5} {'device MiB':>11} {'MiB/GiB':>8} {'host GiB':>9} "
        f"{'pin s':>6} {'D2H GB/s':>9} {'H2D GB/s':>9}"
    )
    for r in rows:
        print(
            f"{r['method']:<13} {r['gib']:>5.1f} {r['device_mib']:>11.1f} "
            f"{r['device_mib_per_gib']:>8.2f} {r['host_gib']:>9.1f} {r['pin_s']:>6.2f} "
            f"{r['d2h_gbps']:>9.1f} {r['h2d_gbps']:>9.1f}"
        )
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
