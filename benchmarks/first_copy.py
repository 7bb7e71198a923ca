"""The first copy into host memory just pinned, against the copies after it and after a pause.

A level-1 sleep's backup copies the weights into host memory pinned at load; its first
sleep is the first copy into those pages. This script asks whether a first copy pays
for first use, and whether a pause (a rollout between two sleeps) costs the next copy
anything. In each fresh process (``--repeat`` of them, one size each), after one small
copy that starts the process's DMA, for each way in turn:

- ``places``: host memory pinned as hybridmem's sleep pool pins it
  (:class:`~hybridmem.memory.host_pool.HostPool`: huge pages, ``cudaHostRegister``);
- ``torch``: ``torch.empty(pin_memory=True)`` (torch's caching host allocator);
- ``places-warmed``: as ``places``, with one untimed copy right after pinning (a warm-up
  at load), then the pause, then the timed copies.

the device's ``--gib`` (in 256 MiB tensors, as the level-1 benchmark's weights) is
copied into it ``--copies`` times, then once more after ``--pause-s`` of idling. Each
copy is queued whole (``non_blocking``) and timed to its synchronisation. Printed per
way: the first copy, the median of the others, the copy after the pause, each as a
share of the best copy of all ways in that process (1.0: the best rate seen).

Run on a GPU: ``python benchmarks/first_copy.py [--gib 1 4] [--repeat 3] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MiB, GiB = 1 << 20, 1 << 30
WAYS = ("places", "torch", "places-warmed")


def one(gib: int, copies: int, pause_s: float) -> dict[str, Any]:
    """Measure the three ways at ``gib`` in this process; return its row."""
    import torch

    from hybridmem.memory.host_pool import HostPool

    parts = [
        torch.full((256 * MiB,), i % 251, dtype=torch.uint8, device="cuda") for i in range(gib * 4)
    ]
    start_dma = torch.empty(MiB, dtype=torch.uint8, pin_memory=True)
    start_dma.copy_(parts[0][:MiB])
    torch.cuda.synchronize()
    pools: list[HostPool] = []

    def pinned(way: str) -> torch.Tensor:
        if way == "torch":
            return torch.empty(gib * GiB, dtype=torch.uint8, pin_memory=True)
        pool = HostPool(pin_memory=True)
        pool.grow(gib * GiB, None)
        pools.append(pool)
        return pool.chunks[-1].tensor

    def copy(host: torch.Tensor) -> float:
        torch.cuda.synchronize()
        began = time.perf_counter()
        for i, part in enumerate(parts):
            host[i * 256 * MiB : (i + 1) * 256 * MiB].copy_(part, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - began

    row: dict[str, Any] = {"gib": gib}
    for way in WAYS:
        began = time.perf_counter()
        host = pinned(way)
        pin_s = time.perf_counter() - began
        warm_s = None
        if way == "places-warmed":
            warm_s = copy(host)
            time.sleep(pause_s)
        times = [copy(host) for _ in range(copies)]
        time.sleep(pause_s)
        after_pause = copy(host)
        intact = all(
            bool((host[i * 256 * MiB : (i + 1) * 256 * MiB : 64 * MiB] == i % 251).all())
            for i in range(len(parts))
        )
        row[way] = {
            "pin_s": pin_s,
            "warm_s": warm_s,
            "first_s": times[0],
            "others_s": statistics.median(times[1:]),
            "after_pause_s": after_pause,
            "intact": intact,
        }
        del host
    for pool in pools:
        pool.close()
    best = min(min(row[w]["first_s"], row[w]["others_s"], row[w]["after_pause_s"]) for w in WAYS)
    row["best_s"] = best
    for way in WAYS:
        for key in ("first", "others", "after_pause"):
            row[way][f"{key}_of_best"] = best / row[way][f"{key}_s"]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=int, nargs="+", default=[1, 4], help="sizes, GiB")
    parser.add_argument("--repeat", type=int, default=3, help="fresh processes per size")
    parser.add_argument("--copies", type=int, default=4, help="timed copies before the pause")
    parser.add_argument("--pause-s", type=float, default=1.0, help="idle before the last copy")
    parser.add_argument("--json", type=Path, help="write the rows here too")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the child, one size
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.one, args.copies, args.pause_s)))
        return 0
    if args.copies < 2:
        parser.error(f"--copies is at least 2 (a first copy and others), got {args.copies}")
    if args.repeat < 1:
        parser.error(f"--repeat is at least 1 (fresh processes per size), got {args.repeat}")
    bad = [g for g in args.gib if g < 1]
    if bad:
        parser.error(f"--gib sizes are whole GiB >= 1, got {bad[0]}")
    if args.pause_s < 0:
        parser.error(f"--pause-s is 0 or more seconds, got {args.pause_s}")
    import torch

    if not torch.cuda.is_available():
        print("first_copy needs a CUDA device: it copies device memory", file=sys.stderr)
        return 2
    rows = []
    for gib in args.gib:
        for _ in range(args.repeat):
            cmd = [sys.executable, __file__, "--one", str(gib), "--copies", str(args.copies)]
            cmd += ["--pause-s", str(args.pause_s)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
            if done.returncode != 0:
                print(f"{gib} GiB failed:\n{done.stderr[-3000:]}", file=sys.stderr)
                return 1
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print(f"{'GiB':>4} {'way':14} {'pin s':>7} {'first':>7} {'others':>7} {'paused':>7}"
          "  (shares of the best copy in that process)")  # fmt: skip
    for row in rows:
        for way in WAYS:
            r = row[way]
            print(
                f"{row['gib']:>4} {way:14} {r['pin_s']:7.3f} {r['first_of_best']:7.3f} "
                f"{r['others_of_best']:7.3f} {r['after_pause_of_best']:7.3f}"
                + ("" if r["intact"] else "  BYTES WRONG")
            )
        print(f"{'':>4} best copy {row['best_s'] * 1e3:.1f} ms "
              f"({row['gib'] * GiB / row['best_s'] / 1e9:.1f} GB/s)")  # fmt: skip
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}
    print(json.dumps(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
