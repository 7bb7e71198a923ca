"""Offload and reload throughput against the pinned-copy ceiling and the common patterns.

For 1, 8 and 24 GiB of state (tensors of 1-256 MiB, as parameters and optimizer state
are), each method runs in a fresh process (so host peak memory is its own):

- ``hybridmem``: ``Offloader.offload()`` / ``reload()``, steady state (the pinned pool
  exists), plus the first offload, which allocates and pins the pool;
- ``to_cpu``: ``p.data = p.data.to("cpu")`` / ``.to("cuda")`` (pageable, blocking);
- ``to_cpu_nb``: the same with ``non_blocking=True`` and a synchronise, the usual
  hand-written offload;
- ``tms_pinned``, ``tms_mmap``: torch_memory_saver's CPU backup, what slime and AReaL
  offload their trainer with: the state allocated in a region with
  ``enable_cpu_backup=True`` (its ``pinned`` and ``mmap`` host backends), offloaded by
  ``pause()`` and reloaded by ``resume()``, in preload mode (``LD_PRELOAD``, as SGLang
  runs it); skipped where torch_memory_saver is not installed;
- the ceiling, in the hybridmem process: one contiguous copy of the same bytes between
  device memory and the same pinned pool, each direction.

Prints GB/s and the ratio to the ceiling (target: hybridmem >= 95% of it from 8 GiB),
hybridmem's speed over torch_memory_saver's (targets: >= 15x on offload, >= 5x on
reload), and host peak memory over the bytes offloaded (target: <= 1.05 for
hybridmem). Every method checks that the state came back bit for bit.

Run on a GPU: ``python benchmarks/offload.py [--sizes 1 8 24] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GiB = 1 << 30
MiB = 1 << 20

#: The longest one child (a size and a method, its cycles) may take (seconds).
CHILD_TIMEOUT_S = 1800.0

METHODS = ("hybridmem", "to_cpu", "to_cpu_nb", "tms_pinned", "tms_mmap")


def _rss(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _state(nbytes: int) -> list[Any]:
    import torch

    rng = random.Random(0)
    tensors = []
    left = nbytes
    while left > 0:
        size = min(left, rng.randint(1, 256) * MiB)
        tensors.append(torch.nn.Parameter(torch.empty(size // 4, device="cuda").uniform_()))
        left -= size
    torch.cuda.synchronize()
    return tensors


def _timed(fn: Any) -> float:
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _checksum(tensors: list[Any]) -> int:
    import torch

    total = 0
    for t in tensors:
        words = t.detach().reshape(-1).view(torch.int32)
        total += int(words.sum(dtype=torch.int64))
    return total


def child(size_gib: float, method: str, cycles: int) -> dict[str, Any]:

    import torch

    import hybridmem as hm

    nbytes = int(size_gib * GiB)
    torch.empty(1, device="cuda")  # initialise CUDA
    saver: Any = None
    if method.startswith("tms_"):
        from hybridmem.bench.engine_memory import memory_saver

        saver = memory_saver()
        backend = method.removeprefix("tms_")
        with saver.region(tag="trainer", enable_cpu_backup=True, cpu_backup_backend=backend):
            tensors = _state(nbytes)
    else:
        tensors = _state(nbytes)
    checksum = _checksum(tensors)
    rss_before = _rss("VmRSS")
    out: dict[str, Any] = {"size_gib": size_gib, "method": method, "bytes": nbytes}
    offload_s: list[float] = []
    reload_s: list[float] = []
    if method == "hybridmem":
        off = hm.Offloader(tensors)
        out["first_offload_s"] = _timed(lambda: off.offload(release_cache=False))
        off.reload()
        for _ in range(cycles):
            offload_s.append(_timed(lambda: off.offload(release_cache=False)))
            reload_s.append(_timed(off.reload))
        out["intact"] = _checksum(tensors) == checksum  # before the ceiling reuses the pool
        out["host_pool_bytes"] = off.host_bytes
        # the ceiling: one contiguous copy of the same bytes through the same pool
        off.offload()
        (chunk,) = off._host.chunks  # the Offloader's pool (memory/host_pool.py): one chunk
        pool = chunk.tensor[:nbytes]
        device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        out["ceiling_d2h_gbps"] = max(
            nbytes / _timed(lambda: pool.copy_(device, non_blocking=True)) / 1e9
            for _ in range(cycles)
        )
        out["ceiling_h2d_gbps"] = max(
            nbytes / _timed(lambda: device.copy_(pool, non_blocking=True)) / 1e9
            for _ in range(cycles)
        )
        del device
        off.reload()
    elif saver is not None:

        def pause() -> None:
            saver.pause("trainer")

        def resume() -> None:
            saver.resume("trainer")

        out["first_offload_s"] = _timed(pause)
        resume()
        for _ in range(cycles):
            offload_s.append(_timed(pause))
            reload_s.append(_timed(resume))
    else:
        non_blocking = method == "to_cpu_nb"

        def offload() -> None:
            for p in tensors:
                p.data = p.data.to("cpu", non_blocking=non_blocking)

        def reload() -> None:
            for p in tensors:
                p.data = p.data.to("cuda", non_blocking=non_blocking)

        out["first_offload_s"] = _timed(offload)
        reload()
        for _ in range(cycles):
            offload_s.append(_timed(offload))
            reload_s.append(_timed(reload))
    out["offload_gbps"] = nbytes / min(offload_s) / 1e9
    out["reload_gbps"] = nbytes / min(reload_s) / 1e9
    out["host_peak_bytes"] = _rss("VmHWM") - rss_before
    out.setdefault("intact", _checksum(tensors) == checksum)
    return out


def _child_env(method: str) -> dict[str, str] | None:
    """torch_memory_saver runs in preload mode: its library in LD_PRELOAD."""
    import os

    if not method.startswith("tms_"):
        return None
    from hybridmem.bench.engine_memory import preloaded

    return preloaded({k: v for k, v in os.environ.items() if k != "LD_PRELOAD"})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[1, 8, 24])
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", nargs=2, metavar=("SIZE_GIB", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(float(args.child[0]), args.child[1], args.cycles)))
        return 0

    from hybridmem.bench.engine_memory import available, preload_library

    methods = [
        m for m in METHODS if not m.startswith("tms_") or (available() and preload_library())
    ]
    if len(methods) < len(METHODS):
        print("torch_memory_saver is not installed: its rows are skipped", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    for size in args.sizes:
        for method in methods:
            result = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    str(size),
                    method,
                    "--cycles",
                    str(args.cycles),
                ],
                capture_output=True,
                text=True,
                check=False,
                env=_child_env(method),
                timeout=CHILD_TIMEOUT_S,  # a stuck child is an error, not a hang
            )
            if result.returncode != 0:
                print(f"{size} GiB {method}: failed\n{result.stderr[-2000:]}", file=sys.stderr)
                return 1
            rows.append(json.loads(result.stdout.strip().splitlines()[-1]))
            print(f"  done: {size:g} GiB {method}", file=sys.stderr, flush=True)

    print(
        f"{'size':>6} {'method':>10} {'offload GB/s':>13} {'reload GB/s':>12} "
        f"{'% ceiling (off/re)':>19} {'first offload s':>16} {'host peak/bytes':>16} "
        f"{'intact':>7}"
    )
    for size in args.sizes:
        group = [r for r in rows if r["size_gib"] == size]
        ceiling = next(r for r in group if r["method"] == "hybridmem")
        d2h, h2d = ceiling["ceiling_d2h_gbps"], ceiling["ceiling_h2d_gbps"]
        print(f"{size:>5g}G {'ceiling':>10} {d2h:>13.1f} {h2d:>12.1f}")
        for r in group:
            print(
                f"{size:>5g}G {r['method']:>10} "
                f"{r['offload_gbps']:>13.1f} {r['reload_gbps']:>12.1f} "
                f"{r['offload_gbps'] / d2h:>9.0%} / {r['reload_gbps'] / h2d:<7.0%} "
                f"{r['first_offload_s']:>16.2f} {r['host_peak_bytes'] / r['bytes']:>16.2f} "
                f"{r['intact']!s:>7}"
            )
        for r in group:
            if r["method"].startswith("tms_"):
                print(
                    f"{'':>7}hybridmem over {r['method']}: offload "
                    f"{ceiling['offload_gbps'] / r['offload_gbps']:.1f}x, reload "
                    f"{ceiling['reload_gbps'] / r['reload_gbps']:.1f}x"
                )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
