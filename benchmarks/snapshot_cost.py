"""What reading the allocator's block layout costs, against the page a planned switch leaves.

A switch planned by need frees whole storages; torch's expandable segments return
free memory in whole 20 MiB pages only, so where moved and kept storages were
neighbours one page can stay part-used (the planned hand-back's 0.9994-0.999499 on an
H100, 2026-12-05: 20.12 MiB free among the kept optimizer state's blocks). Planning
to page bounds needs each block's segment and offset, which only the allocator's
snapshot (``torch.cuda.memory._snapshot``) gives. This measures, in one process
holding the bench's trainer state (``hybridmem bench --scale`` model, an AdamW step,
expandable segments), the snapshot's milliseconds against copying one 20 MiB page to
pinned host memory and against the plan's own walk of the storages
(``Offloader.resident``), each the median of ``--repeats``.

Run: ``python benchmarks/snapshot_cost.py [--gib 8] [--repeats 20] [--json FILE]``
(CUDA only).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MiB = 2**20
PAGE = 20 * MiB  # the large pool's expandable-segment page (kLargeBuffer)


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    """The median of ``repeats`` timed calls of ``fn``, in ms (the device synchronised)."""
    import torch

    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _measure(gib: float, repeats: int) -> dict[str, Any]:
    """In a spawned process: the bench's trainer state, then the three timings."""
    import torch

    from hybridmem import Offloader
    from hybridmem._torch.settings import snapshot
    from hybridmem.bench.plan import scale_plan
    from hybridmem.bench.run import _model

    torch.empty(1, device="cuda")
    p = scale_plan(torch.cuda.mem_get_info()[1], gib)
    model, model_name = _model(p)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    tokens = torch.randint(0, p.vocab, (1, 64), device="cuda")
    model(tokens).float().mean().backward()
    optimizer.step()
    del tokens
    torch.cuda.empty_cache()
    snap = snapshot()
    if snap is None:
        raise RuntimeError("this torch gives no allocator snapshot")
    segments = snap.get("segments", [])
    page = torch.empty(PAGE, dtype=torch.uint8, device="cuda")
    host = torch.empty(PAGE, dtype=torch.uint8, pin_memory=True)
    offloader = Offloader(optimizer)
    return {
        "model": model_name,
        "state_gib": gib,
        "segments": len(segments),
        "blocks": sum(len(s.get("blocks", [])) for s in segments),
        "storages": len(offloader.resident()),
        "snapshot_ms": median_ms(snapshot, repeats),
        "page_copy_ms": median_ms(lambda: host.copy_(page, non_blocking=True), repeats),
        "walk_ms": median_ms(offloader.resident, repeats),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=8.0, help="trainer state, GiB")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    args = parser.parse_args(argv)
    if args.gib <= 0 or args.repeats < 1:
        print("snapshot_cost: --gib must be > 0 and --repeats >= 1", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("snapshot_cost needs a CUDA device: it reads the allocator", file=sys.stderr)
        return 2
    # Spawned after this: the child's allocator starts with the bench's setting.
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        row = pool.apply(_measure, (args.gib, args.repeats))
    row["snapshot_over_page"] = row["snapshot_ms"] / row["page_copy_ms"]
    row["snapshot_over_walk"] = row["snapshot_ms"] / row["walk_ms"]
    print(
        f"{row['state_gib']:g} GiB ({row['model']}): {row['segments']} segments, "
        f"{row['blocks']} blocks, {row['storages']} optimizer storages\n"
        f"snapshot {row['snapshot_ms']:.2f} ms; one 20 MiB page to pinned host "
        f"{row['page_copy_ms']:.3f} ms; the plan's walk {row['walk_ms']:.3f} ms\n"
        f"snapshot / page copy {row['snapshot_over_page']:.1f}x, "
        f"snapshot / walk {row['snapshot_over_walk']:.1f}x"
    )
    if args.json:
        args.json.write_text(json.dumps(row, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
