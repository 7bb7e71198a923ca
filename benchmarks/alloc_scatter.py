"""A large allocation right after a free, and beside memory held in scattered pieces.

The bench's KV wake (the engine's own call: torch_memory_saver's resume, or plain
``cudaMalloc`` with the handmade engine) took 4-92 ms a cycle at 8 GiB / need 0.25 on
an H100 when the bench's training lasted milliseconds, and 3.5-6.6 ms when each cycle
trained 1 s longer (``hybridmem bench --train-s 1``). This asks the driver alone,
without hybridmem, what an allocation costs by the time since the last free and by
the layout of what is held beside it:

- a process keeps ``--held`` GiB on the device either as one block (``contiguous``)
  or as ``--chunk`` MiB pieces spread evenly over the whole device (``scattered``:
  the device filled with chunks, all but every k-th freed);
- it allocates the rest of the device (less ``--margin``) as ``--pieces`` tensors, as
  a KV cache is made (``first ms``), then ``--repeats`` times per gap in ``--gaps``:
  frees it, waits the gap, allocates it again (median ms per gap).

The caching allocator is off (``PYTORCH_NO_CUDA_MEMORY_CACHING=1``): each tensor is
one ``cudaMalloc`` and each free one ``cudaFree``. Each layout runs in its own spawned
process. Prints the scattered layout's ratio over the contiguous one per gap,
measured in the same run.

Run: ``python benchmarks/alloc_scatter.py [--held 8] [--chunk 20] [--pieces 8]
[--repeats 5] [--gaps 0 100 300 1000] [--json FILE]`` (CUDA only).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

MiB = 2**20
GiB = 2**30
LAYOUTS = ("contiguous", "scattered")


def kept_indices(count: int, keep: int) -> list[int]:
    """``keep`` indices of ``range(count)`` spread evenly (the first always kept).

    Args:
        count: how many chunks filled the device.
        keep: how many of them to keep (at most ``count``).

    Returns:
        Sorted distinct indices.

    Example:
        >>> kept_indices(10, 3)
        [0, 3, 6]
    """
    if not 0 <= keep <= count:
        raise ValueError(f"keep={keep} must be between 0 and count={count}")
    return sorted({i * count // keep for i in range(keep)}) if keep else []


def _measure(layout: str, args: dict[str, Any]) -> dict[str, Any]:
    """In a spawned process: hold the bytes as ``layout`` says, time the large allocation."""
    import torch

    torch.empty(1, device="cuda")  # the context, before anything is timed
    held_bytes = int(args["held"] * GiB)
    chunk = int(args["chunk"] * MiB)
    margin = int(args["margin"] * GiB)
    if layout == "contiguous":
        held = [torch.empty(held_bytes, dtype=torch.uint8, device="cuda")]
    else:
        chunks = []
        while torch.cuda.mem_get_info()[0] > margin + chunk:
            chunks.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
        keep = set(kept_indices(len(chunks), min(len(chunks), held_bytes // chunk)))
        held = [c for i, c in enumerate(chunks) if i in keep]
        del chunks
    torch.cuda.synchronize()
    free = torch.cuda.mem_get_info()[0]
    each = (free - margin) // args["pieces"] // (2 * MiB) * (2 * MiB)

    live: list[Any] = []  # the large allocation's tensors while they exist

    def allocate() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        live.extend(
            torch.empty(each, dtype=torch.uint8, device="cuda") for _ in range(args["pieces"])
        )
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3

    first_ms = allocate()
    alloc_ms: dict[str, list[float]] = {}
    free_ms: list[float] = []
    for gap in args["gaps"]:
        for _ in range(args["repeats"]):
            started = time.perf_counter()
            live.clear()
            torch.cuda.synchronize()
            free_ms.append((time.perf_counter() - started) * 1e3)
            time.sleep(gap / 1e3)  # what runs between a free and the next allocation
            alloc_ms.setdefault(f"{gap:g}", []).append(allocate())
    return {
        "layout": layout,
        "held_gib": sum(t.nbytes for t in held) / GiB,
        "held_pieces": len(held),
        "allocated_gib": each * args["pieces"] / GiB,
        "first_alloc_ms": first_ms,
        "alloc_ms_after_gap": alloc_ms,
        "free_ms": free_ms,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--held", type=float, default=8.0, help="GiB the holder keeps")
    parser.add_argument("--chunk", type=float, default=20.0, help="MiB per scattered piece")
    parser.add_argument("--pieces", type=int, default=8, help="tensors the large allocation is")
    parser.add_argument("--repeats", type=int, default=5, help="allocations per gap")
    parser.add_argument(
        "--gaps",
        type=float,
        nargs="+",
        default=[0.0, 100.0, 300.0, 1000.0],
        metavar="MS",
        help="milliseconds between freeing the large allocation and making it again",
    )
    parser.add_argument("--margin", type=float, default=1.0, help="GiB left free")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    args = parser.parse_args(argv)
    if args.held <= 0 or args.chunk <= 0 or args.pieces < 1 or args.repeats < 1:
        parser.error("--held and --chunk must be > 0, --pieces and --repeats >= 1")
    if any(gap < 0 for gap in args.gaps):
        parser.error(f"--gaps are milliseconds >= 0, got {args.gaps}")

    import torch

    if not torch.cuda.is_available():
        print("alloc_scatter needs a CUDA device: it times cudaMalloc", file=sys.stderr)
        return 2
    os.environ["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"  # the children's allocator
    context = multiprocessing.get_context("spawn")
    settings = vars(args) | {"json": None}
    rows = []
    with context.Pool(1, maxtasksperchild=1) as pool:
        for layout in LAYOUTS:
            rows.append(pool.apply(_measure, (layout, settings)))
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    gaps = [f"{gap:g}" for gap in args.gaps]
    print(
        "layout      held GiB  pieces  allocated GiB  first ms  "
        + "  ".join(f"after {g} ms" for g in gaps)
        + "  free ms  (allocation ms: median of the repeats)"
    )
    for row in rows:
        after = row["alloc_ms_after_gap"]
        print(
            f"{row['layout']:<11} {row['held_gib']:8.2f} {row['held_pieces']:7d} "
            f"{row['allocated_gib']:14.2f} {row['first_alloc_ms']:9.2f}  "
            + "  ".join(f"{statistics.median(after[g]):{len(g) + 9}.2f}" for g in gaps)
            + f"  {statistics.median(row['free_ms']):7.2f}"
        )
    ratio = {
        g: statistics.median(rows[1]["alloc_ms_after_gap"][g])
        / statistics.median(rows[0]["alloc_ms_after_gap"][g])
        for g in gaps
    }
    print(
        "scattered over contiguous, allocation: "
        + ", ".join(f"{ratio[g]:.2f}x after {g} ms" for g in gaps)
    )
    if args.json:
        args.json.write_text(json.dumps({"settings": settings, "rows": rows, "ratio": ratio}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
