"""vLLM's level-1 sleep through its ``cumem`` backend and hybridmem's, against copies pinned once.

vLLM 0.33's own ``CuMemAllocator`` (its wheel's files: ``HYBRIDMEM_VLLM_FILES`` or
``--vllm-files``, see docs/backends/vllm.md) holds ``--gib`` of weights in 256 MiB
allocations (tag ``weights``) and a 1 GiB KV cache (tag ``kv_cache``). Five ways, each
``--cycles`` sleeps and wakes of the same allocations, in this order, in one process per
size (a pool's freed blocks would be backed up by the next size's sleeps), each through
a sleep-mode backend as vLLM 0.33's GPU worker calls it (``suspend(level)``, then
``resume(["weights"])`` and ``resume(["kv_cache"])`` as verl wakes):

- ``vllm``: vLLM's ``cumem`` backend at level 1 (``CuMemBackend`` from vLLM's
  ``sleep_mode_backend.py``): it copies into host memory allocated then with
  ``pin_memory=True`` (torch's caching host allocator: pinned at the first sleep,
  reused after, each block rounded up to a power of two).
- ``hybridmem``: hybridmem's backend at level 1 (``--sleep-mode-backend hybridmem``):
  host memory of exactly the weights' size pinned once by ``reserve_sleep_backup``
  (timed apart: at load), the copies queued together; its backup's own rate (the
  copies, from its ``SleepReport``) is printed too, against the ceiling (target 0.95).
- ``pool-backup``: :class:`~hybridmem.integrations.vllm.sleep_backup.PoolBackup`
  (copies, then vLLM's ``sleep(offload_tags=())``), for vLLM without backends.
- ``discard``: vLLM's ``cumem`` backend at level 2: a sleep with no copy.
- ``hybridmem-l2``: hybridmem's backend at level 2.

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
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MiB, GiB = 1 << 20, 1 << 30
WAYS = ("vllm", "hybridmem", "pool-backup", "discard", "hybridmem-l2")


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


def one_size(gib: int, files: str | None, count: int) -> dict[str, Any]:
    """Measure the five ways at one size in this process; return its row."""
    import torch

    from hybridmem.integrations.vllm.plugin import register
    from hybridmem.integrations.vllm.sleep_backup import PoolBackup
    from hybridmem.integrations.vllm.sleep_files import load_cumem, load_sleep_backends

    torch.zeros(1, device="cuda")
    alloc = load_cumem(files).CuMemAllocator.get_instance()
    factory = load_sleep_backends(files).SleepModeBackendFactory
    register()
    cumem_backend = factory.get_backend_class("cumem")()
    hm_backend = factory.get_backend_class("hybridmem")()
    with alloc.use_memory_pool(tag="weights"):
        parts = [
            torch.full((256 * MiB,), i % 251, dtype=torch.uint8, device="cuda")
            for i in range(gib * 4)
        ]
    with alloc.use_memory_pool(tag="kv_cache"):
        kv = torch.empty(GiB, dtype=torch.uint8, device="cuda")

    def intact() -> bool:
        return all(bool((p[:: 64 * MiB] == i % 251).all()) for i, p in enumerate(parts))

    def cycles(
        sleep: Callable[[], Any], wake: Callable[[list[str]], Any], check: bool = True
    ) -> dict[str, Any]:
        sleeps, wakes, kv_wakes, kept = [], [], [], True
        for _ in range(count):
            sleeps.append(_timed(sleep))
            wakes.append(_timed(lambda: wake(["weights"])))
            kept = kept and (intact() if check else True)
            kv_wakes.append(_timed(lambda: wake(["kv_cache"])))
        return {
            "sleep_first_s": sleeps[0],
            "sleep_steady_s": statistics.median(sleeps[1:]),
            "wake_s": statistics.median(wakes),
            "wake_kv_s": statistics.median(kv_wakes),
            "intact": kept if check else None,
        }

    before = _pinned_by_torch() or 0
    vllm = cycles(lambda: cumem_backend.suspend(1), cumem_backend.resume)
    after = _pinned_by_torch()
    vllm["host_pinned_gib"] = None if after is None else (after - before) / GiB
    from hybridmem.integrations.vllm.sleep_backend import pool_sleep, reserve_sleep_backup

    reserve_s = _timed(lambda: reserve_sleep_backup(None, level=1))
    copies: list[float] = []  # each sleep's backup: its copies, queued then synchronised

    def hm_sleep() -> None:
        hm_backend.suspend(1)
        copies.append(hm_backend.last.copy_seconds)

    ours = cycles(hm_sleep, hm_backend.resume)
    ours.update(copy_first_s=copies[0], copy_steady_s=statistics.median(copies[1:]))
    ours.update(reserve_s=reserve_s, host_pinned_gib=pool_sleep().host_bytes / GiB)
    backup = PoolBackup(alloc)
    backup_reserve_s = _timed(backup.reserve)
    kept_by_backup = cycles(backup.sleep, backup.wake_up)
    kept_by_backup.update(reserve_s=backup_reserve_s, host_pinned_gib=backup.host_bytes / GiB)
    discard = cycles(lambda: cumem_backend.suspend(2), cumem_backend.resume, check=False)
    discard["host_pinned_gib"] = 0.0
    ours_l2 = cycles(lambda: hm_backend.suspend(2), hm_backend.resume, check=False)
    ours_l2["host_pinned_gib"] = 0.0
    host = torch.empty(gib * GiB, dtype=torch.uint8, pin_memory=True)
    flat = [host[i * 256 * MiB : (i + 1) * 256 * MiB] for i in range(len(parts))]

    def copy(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        for dst, src in zip(dsts, srcs, strict=True):
            dst.copy_(src, non_blocking=True)

    down = min(_timed(lambda: copy(flat, parts)) for _ in range(3))
    up = min(_timed(lambda: copy(parts, flat)) for _ in range(3))
    del kv
    row: dict[str, Any] = {"gib": gib, "pinned_down_s": down, "pinned_up_s": up}
    ours["backup_first_of_pinned"] = down / ours["copy_first_s"]
    ours["backup_steady_of_pinned"] = down / ours["copy_steady_s"]
    for name, way in zip(WAYS, (vllm, ours, kept_by_backup, discard, ours_l2), strict=True):
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
    parser.add_argument("--cycles", type=int, default=5, help="sleeps per way (at least 3)")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the child, one size
    args = parser.parse_args()
    files = args.vllm_files or os.environ.get("HYBRIDMEM_VLLM_FILES")
    if args.one is not None:
        print(json.dumps(one_size(args.one, files, args.cycles)))
        return 0
    if args.cycles < 3:
        parser.error(f"--cycles is at least 3 (a first sleep and a median), got {args.cycles}")
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
            [
                sys.executable,
                __file__,
                "--one",
                str(gib),
                "--vllm-files",
                files,
                "--cycles",
                str(args.cycles),
            ],
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
    heads: tuple[str, ...] = ("first s", "steady s", "wake s", "kv wake s", "first")
    heads += ("steady", "wake", "pinned GiB", "intact")
    print(f"{'GiB':>4} {'way':12} " + " ".join(f"{h:>10}" for h in heads))
    for row in rows:
        print(f"{row['gib']:>4} {'pinned':12} {row['pinned_down_s']:10.3f} {'':>10} "
              f"{row['pinned_up_s']:10.3f}  (the ceiling: pinned once, copies only)")  # fmt: skip
        for name in WAYS:
            way = row[name]
            print(
                f"{row['gib']:>4} {name:12} {way['sleep_first_s']:10.3f} "
                f"{way['sleep_steady_s']:10.3f} {way['wake_s']:10.3f} {way['wake_kv_s']:10.4f} "
                f"{way['first_of_pinned']:10.3f} {way['steady_of_pinned']:10.3f} "
                f"{way['wake_of_pinned']:10.3f} {_gib(way['host_pinned_gib']):>10} "
                f"{way['intact']!s:>10}"
                + (f"  (reserve {way['reserve_s']:.3f} s)" if "reserve_s" in way else "")
            )
            if "backup_first_of_pinned" in way:
                first, after = way["backup_first_of_pinned"], way["backup_steady_of_pinned"]
                print(f"{'':>4} {'':12} its backup (the copies) at {first:.3f} of the pinned "
                      f"rate in the first sleep, {after:.3f} after (target >= 0.95)")  # fmt: skip
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}
    print(json.dumps(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
