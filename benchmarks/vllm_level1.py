"""vLLM's level-1 sleep beside hybridmem's PoolBackup, against copies into host memory pinned once.

vLLM 0.33's own ``CuMemAllocator`` (its wheel's files: ``HYBRIDMEM_VLLM_FILES`` or
``--vllm-files``, see docs/backends/vllm.md) holds ``--gib`` of weights in 256 MiB
allocations (tag ``weights``) and a 1 GiB KV cache (tag ``kv_cache``). Three ways, each
four sleeps and wakes of the same allocations, in this order, in one process per size
(a pool's freed blocks would be backed up by the next size's sleeps):

- ``vllm``: vLLM's level 1, ``sleep(offload_tags=("weights",))``: it copies into host
  memory allocated then with ``pin_memory=True`` (torch's caching host allocator: pinned
  at the first sleep, reused after, each block rounded up to a power of two).
- ``hybridmem``: :class:`~hybridmem.integrations.vllm.sleep_backup.PoolBackup`: host
  memory of exactly the weights' size pinned once by ``reserve()`` (timed apart, at
  start-up), the copies, then vLLM's ``sleep(offload_tags=())``.
- ``discard``: vLLM's level 2, ``sleep(offload_tags=())``: what a sleep costs with no copy.

The ceiling: the same bytes copied into host memory pinned once, and back (best of
three). Reported per way: the first sleep, the steady sleep (median of the other three),
the wake of the weights (median), each as a share of the ceiling's time (1.0: at the
pinned rate), the host memory pinned for it, and whether the weights came back byte for
byte after every wake.

Run on a GPU: ``python benchmarks/vllm_level1.py [--gib 1 4 16] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MiB, GiB = 1 << 20, 1 << 30
WAYS = ("vllm", "hybridmem", "discard")


def _timed(fn: Callable[[], Any]) -> float:
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _pinned_by_torch() -> int | None:
    """What torch's caching host allocator holds pinned now (None: its stats say nothing).

    torch 2.11 (cu130) on an H100 reported 0 after vLLM's sleeps had pinned gigabytes:
    a 0 is taken for "not read", never for "nothing pinned".
    """
    import torch

    stats = getattr(torch.cuda, "host_memory_stats", None)
    read = 0 if stats is None else int(stats().get("reserved_bytes.current", 0))
    return read or None


def one_size(gib: int, files: str | None) -> dict[str, Any]:
    """Measure the three ways at one size in this process; return its row."""
    import torch

    from hybridmem.integrations.vllm.sleep_backup import PoolBackup
    from hybridmem.integrations.vllm.sleep_files import load_cumem

    torch.zeros(1, device="cuda")
    alloc = load_cumem(files).CuMemAllocator.get_instance()
    with alloc.use_memory_pool(tag="weights"):
        parts = [
            torch.full((256 * MiB,), i % 251, dtype=torch.uint8, device="cuda")
            for i in range(gib * 4)
        ]
    with alloc.use_memory_pool(tag="kv_cache"):
        kv = torch.empty(GiB, dtype=torch.uint8, device="cuda")

    def intact() -> bool:
        return all(bool((p[:: 64 * MiB] == i % 251).all()) for i, p in enumerate(parts))

    def cycles(sleep: Callable[[], Any], wake: Callable[[list[str]], Any]) -> dict[str, Any]:
        sleeps, wakes, kept = [], [], True
        for _ in range(4):
            sleeps.append(_timed(sleep))
            wakes.append(_timed(lambda: wake(["weights"])))
            kept = kept and intact()
            wake(["kv_cache"])
        return {
            "sleep_first_s": sleeps[0],
            "sleep_steady_s": sorted(sleeps[1:])[1],
            "wake_s": sorted(wakes)[1],
            "intact": kept,
        }

    before = _pinned_by_torch() or 0
    vllm = cycles(lambda: alloc.sleep(offload_tags=("weights",)), alloc.wake_up)
    after = _pinned_by_torch()
    vllm["host_pinned_gib"] = None if after is None else (after - before) / GiB
    backup = PoolBackup(alloc)
    reserve_s = _timed(backup.reserve)
    ours = cycles(backup.sleep, backup.wake_up)
    ours.update(reserve_s=reserve_s, host_pinned_gib=backup.host_bytes / GiB)
    discard = cycles(lambda: alloc.sleep(offload_tags=()), alloc.wake_up)
    discard["host_pinned_gib"] = 0.0
    host = torch.empty(gib * GiB, dtype=torch.uint8, pin_memory=True)
    flat = [host[i * 256 * MiB : (i + 1) * 256 * MiB] for i in range(len(parts))]

    def copy(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        for dst, src in zip(dsts, srcs, strict=True):
            dst.copy_(src, non_blocking=True)

    down = min(_timed(lambda: copy(flat, parts)) for _ in range(3))
    up = min(_timed(lambda: copy(parts, flat)) for _ in range(3))
    del kv
    row: dict[str, Any] = {"gib": gib, "pinned_down_s": down, "pinned_up_s": up}
    for name, way in zip(WAYS, (vllm, ours, discard), strict=True):
        way["first_of_pinned"] = down / way["sleep_first_s"]
        way["steady_of_pinned"] = down / way["sleep_steady_s"]
        way["wake_of_pinned"] = up / way["wake_s"]
        row[name] = way
    return row


def _gib(value: float | None) -> str:
    return "not read" if value is None else f"{value:.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=int, nargs="+", default=[1, 4, 16], help="weights, GiB")
    parser.add_argument("--vllm-files", help="vLLM's wheel or files (else HYBRIDMEM_VLLM_FILES)")
    parser.add_argument("--json", type=Path, help="write the rows here too")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the child, one size
    args = parser.parse_args()
    files = args.vllm_files or os.environ.get("HYBRIDMEM_VLLM_FILES")
    if args.one is not None:
        print(json.dumps(one_size(args.one, files)))
        return 0
    bad = [g for g in args.gib if g < 1]
    if bad:
        parser.error(f"--gib sizes are whole GiB >= 1, got {bad[0]}")
    if files is None:
        parser.error(
            "needs vLLM's allocator files: --vllm-files PATH or HYBRIDMEM_VLLM_FILES "
            "(pip download --no-deps vllm==0.33.0; docs/backends/vllm.md says how)"
        )
    import torch

    if not torch.cuda.is_available():
        print("vllm_level1 needs a CUDA device: it sleeps vLLM's pool", file=sys.stderr)
        return 2
    rows = []
    for gib in args.gib:
        done = subprocess.run(
            [sys.executable, __file__, "--one", str(gib), "--vllm-files", files],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if done.returncode != 0:
            print(f"{gib} GiB failed:\n{done.stderr[-3000:]}", file=sys.stderr)
            return 1
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    heads = ("first s", "steady s", "wake s", "first", "steady", "wake", "pinned GiB", "intact")
    print(f"{'GiB':>4} {'way':10} " + " ".join(f"{h:>10}" for h in heads))
    for row in rows:
        print(f"{row['gib']:>4} {'pinned':10} {row['pinned_down_s']:10.3f} {'':>10} "
              f"{row['pinned_up_s']:10.3f}  (the ceiling: pinned once, copies only)")  # fmt: skip
        for name in WAYS:
            way = row[name]
            print(
                f"{row['gib']:>4} {name:10} {way['sleep_first_s']:10.3f} "
                f"{way['sleep_steady_s']:10.3f} {way['wake_s']:10.3f} "
                f"{way['first_of_pinned']:10.3f} {way['steady_of_pinned']:10.3f} "
                f"{way['wake_of_pinned']:10.3f} {_gib(way['host_pinned_gib']):>10} "
                f"{way['intact']!s:>10}"
                + (f"  (reserve {way['reserve_s']:.3f} s)" if "reserve_s" in way else "")
            )
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}
    print(json.dumps(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
