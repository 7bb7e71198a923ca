"""What one scope costs by the number of live blocks, beside torch's own setter.

The card's scopes sit on sharding-manager methods and weight-sync blocks that a
trainer enters several times a step, while it holds tens of thousands of live blocks
in the caching allocator (parameters, gradients, optimizer state, activations). Each
entry and exit reads the last settings string torch was given, to see a write made
outside hybridmem (vLLM's sleep-mode pool, verl's setter). How that read is made is
printed (``read``): torch 2.12+'s getter; on torch 2.10 - 2.11 the write watch, or the
allocator snapshot where the watch cannot start; none before 2.10.

For 100, 1,000, 10,000 and 50,000 live blocks (each a 2 KiB CUDA tensor; none on a CPU
build, which has no caching allocator), the microseconds per enter + exit of:

- ``hm.expandable_segments(False)`` where it is in force already (no change): target
  <= 5 us;
- ``hm.expandable_segments(True, release_cache=False)`` (a change and its way back,
  two writes): target <= 20 us;

beside, in the same run, torch's own setter called once with the same string (the
floor: one write) and, on CUDA, one allocator snapshot (what each read cost on torch
2.10 - 2.11 before the watch). Each figure is the best of 25 rounds' mean (other load
only adds time), the measures taken in turn within each round, with a bare ``with`` of a
trivial context manager as the yardstick of the machine's speed. The first scope after
CUDA starts, which starts the watch, is timed on its own.

Run: ``python benchmarks/scope_cost.py [--blocks 100 1000 10000 50000] [--json FILE]``
(CPU or GPU).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import hybridmem as hm
from hybridmem import _torch

NO_CHANGE_TARGET_US = 5.0
CHANGE_TARGET_US = 20.0


def per_call_us(
    measures: dict[str, tuple[Callable[[], object], int]], *, repeat: int = 25
) -> dict[str, float]:
    """Best of ``repeat`` rounds of each measure's mean time per call, in microseconds.

    The rounds take the measures in turn (a round of each, then the next round), so a
    drift in the machine's speed reaches every measure alike; one untimed round first.
    """
    best = dict.fromkeys(measures, float("inf"))
    for round_ in range(repeat + 1):
        for name, (fn, number) in measures.items():
            start = time.perf_counter()
            for _ in range(number):
                fn()
            if round_:
                best[name] = min(best[name], (time.perf_counter() - start) / number)
    return {name: value * 1e6 for name, value in best.items()}


def torch_setter() -> Callable[[str], object] | None:
    """torch's own setter here (the one hybridmem calls, under its watch if any), or None.

    Call it only once the first scope has run: a reference to torch's function held
    before the watch starts is what keeps the watch from starting (it would write
    unseen), and this benchmark would then time the snapshot reads it exists to avoid.
    """
    name = _torch.settings_setter_name()
    if name is None:
        return None
    owner = torch._C if name.startswith("torch._C.") else torch.cuda.memory
    fn: Callable[[str], object] = getattr(owner, name.rsplit(".", 1)[1])
    return getattr(fn, "__wrapped__", fn)  # torch's own, not the watch's note before it


class _Trivial:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def read_mode() -> str:
    """How this process reads the last settings string (see the module)."""
    if _torch.torch_version() < (2, 10):
        return "none (torch < 2.10 cannot say)"
    if _torch.settings_writes_watched():
        getter = _torch.torch_version() >= (2, 12)
        return "torch's getter" if getter else "write watch"
    if _torch.sees_settings_writes():
        return "allocator snapshot"
    return "none (CUDA not initialised)"


def measure(
    blocks: list[int], number: int, on_row: Callable[[dict[str, Any]], object] = print
) -> dict[str, Any]:
    on_gpu = _torch.cuda_available()
    off = hm.expandable_segments(False)
    on = hm.expandable_segments(True, release_cache=False)
    trivial = _Trivial()

    def no_change() -> None:
        with off:
            pass

    def change() -> None:
        with on:
            pass

    def bare() -> None:
        with trivial:
            pass

    first_us = None
    with hm.expandable_segments(False):  # the scopes below run where False is in force
        if on_gpu:
            torch.empty(1, device="cuda")
            start = time.perf_counter()
            no_change()  # the first read after CUDA starts: starts the watch
            first_us = (time.perf_counter() - start) * 1e6
        figures: dict[str, Any] = {
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if on_gpu else "cpu",
            "read": read_mode(),
            "first_scope_us": first_us,
            "rows": [],
        }
        if figures["read"] == "allocator snapshot":
            # each scope walks every live block twice: the usual count would run for hours
            number = min(number, 40)
        figures["number"] = number
        on_row(figures)
        held: list[torch.Tensor] = []
        for count in blocks:
            if on_gpu:
                while len(held) < count:
                    held.append(torch.empty(512, device="cuda"))  # 2 KiB: one block each
                live = int(_torch.memory_stats(0).get("active.all.current", 0))
            else:
                live = 0
            measures: dict[str, tuple[Callable[[], object], int]] = {
                "bare_with_us": (bare, number),
                "no_change_us": (no_change, number),
                "change_us": (change, number // 2),
            }
            setter = torch_setter()  # after the first scope: see torch_setter
            if setter is not None:
                measures["setter_us"] = (
                    functools.partial(setter, "expandable_segments:False"),
                    number,
                )
            if on_gpu:
                measures["snapshot_us"] = (torch.cuda.memory._snapshot, max(number // 4000, 2))
            row: dict[str, Any] = {"blocks": count, "live_blocks": live}
            row.update(dict.fromkeys(("setter_us", "snapshot_us")))
            row.update(per_call_us(measures))
            figures["rows"].append(row)
            on_row(row)
        del held
    return figures


def print_progress(item: dict[str, Any]) -> None:
    """Print the header (the run's figures) or one row, as soon as it is measured."""
    if "rows" in item:
        print(f"torch {item['torch']} on {item['device']}; read: {item['read']}")
        if item["first_scope_us"] is not None:
            first = item["first_scope_us"]
            print(f"first scope after CUDA starts (starts the read): {first:.0f} us")
        print(
            f"{'live blocks':>11} {'no change':>10} {'change':>9} {'setter':>8} "
            f"{'snapshot':>10} {'bare with':>10}   no change / setter, change / setter",
            flush=True,
        )
        return
    setter = item["setter_us"]
    snap = f"{item['snapshot_us']:9.1f}u" if item["snapshot_us"] is not None else f"{'-':>10}"
    ratios = (
        f"{item['no_change_us'] / setter:5.1f}x, {item['change_us'] / setter:5.1f}x"
        if setter
        else "-"
    )
    print(
        f"{item['blocks']:>11,} {item['no_change_us']:9.2f}u {item['change_us']:8.2f}u "
        f"{setter if setter is not None else float('nan'):7.2f}u {snap} "
        f"{item['bare_with_us']:9.2f}u   {ratios}",
        flush=True,
    )


def targets_met(figures: dict[str, Any]) -> bool:
    """Print whether every row meets both targets, and return it."""
    met = all(
        row["no_change_us"] <= NO_CHANGE_TARGET_US and row["change_us"] <= CHANGE_TARGET_US
        for row in figures["rows"]
    )
    print(
        f"targets: no change <= {NO_CHANGE_TARGET_US:.0f} us, change <= {CHANGE_TARGET_US:.0f} us "
        f"at every size: {'met' if met else 'NOT met'}"
    )
    return met


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[100, 1000, 10000, 50000])
    parser.add_argument("--number", type=int, default=5000, help="calls per round")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    args = parser.parse_args()
    if any(b < 0 for b in args.blocks) or args.number < 1:
        parser.error("--blocks takes counts >= 0 and --number a count >= 1")
    figures = measure(sorted(args.blocks), args.number, print_progress)
    figures["targets_met"] = targets_met(figures)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
