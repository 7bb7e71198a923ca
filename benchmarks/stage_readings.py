"""What one memory reading costs: a switch takes one at every stage boundary.

Issue #25, item 3 (decision 91): ``hybridmem bench --scale`` timed the switch to
rollout at 8 GiB 3-4 ms longer than the sum of its stages, and the stages themselves
hold readings too. A reading (:func:`hybridmem.memory_info`) is the caching
allocator's counters and ``cudaMemGetInfo``. This prints, in one process holding a
trainer-like cache (expandable segments, a few hundred tensors), the microseconds per
call of:

- ``torch.cuda.memory_stats``: the counters as torch flattens them (every pool, sorted;
  what the seam read before decision 91);
- ``_torch.memory_stats``: the seam now, from ``memory_stats_as_nested_dict``, all
  pools together;
- ``torch.cuda.mem_get_info``: the device's free memory;
- ``memory_info``: one whole reading as the switch takes it;

and the ratio of the old seam's reading to the new one, measured in the same run.

Run on a GPU: ``python benchmarks/stage_readings.py [--calls 2000]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    """Microseconds per call of ``fn``, the best of three runs of ``calls`` calls."""
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - started) / calls * 1e6)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch

    from hybridmem import _torch
    from hybridmem.observe.memory import memory_info

    if not torch.cuda.is_available():
        print("needs a GPU", file=sys.stderr)
        return 2
    # A trainer's cache: tensors of many sizes, some freed (cached, split blocks).
    held = [torch.empty(n << 16, dtype=torch.uint8, device="cuda") for n in range(1, 400)]
    del held[::3]
    torch.cuda.synchronize()
    rows = {
        "torch.cuda.memory_stats": lambda: torch.cuda.memory_stats(0),
        "_torch.memory_stats": lambda: _torch.memory_stats(0),
        "torch.cuda.mem_get_info": lambda: torch.cuda.mem_get_info(0),
        "memory_info": lambda: memory_info(0),
    }
    costs = {name: per_call_us(fn, args.calls) for name, fn in rows.items()}
    for name, us in costs.items():
        print(f"{name:<26} {us:8.1f} us per call")
    old = costs["torch.cuda.memory_stats"] + costs["torch.cuda.mem_get_info"]
    print(
        f"one reading: {costs['memory_info']:.1f} us, against {old:.1f} us with torch's "
        f"flat counters ({old / costs['memory_info']:.2f}x)"
    )
    # Same values: the seam's reading is torch's, without the pools' halves.
    flat = torch.cuda.memory_stats(0)
    ours = _torch.memory_stats(0)
    assert all(flat[key] == value for key, value in ours.items())
    return 0


if __name__ == "__main__":
    sys.exit(main())
