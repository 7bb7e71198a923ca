"""Overhead of hybridmem's allocator toggles and cache release.

Prints microseconds per enter+exit of ``expandable_segments`` when nothing
changes and with a real toggle, and milliseconds of ``release_cache`` when there
is nothing to free, each beside a baseline measured in the same run (torch's raw
setter, a bare ``with`` of a trivial context manager, ``torch.cuda.empty_cache``
and one ``gc.collect()``). Targets (issue 2): <= 5 us with no change, <= 20 us for
a real toggle (plus the cache release it triggers), <= 1 ms for a release with
nothing to free and no garbage to collect.

Run: ``python benchmarks/overhead.py [--json FILE]`` (CPU or GPU).
"""

from __future__ import annotations

import argparse
import gc
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


def per_call_us(fn: Callable[[], object], *, number: int, repeat: int = 7) -> float:
    """Best of ``repeat`` runs of the mean time per call, in microseconds.

    The minimum, as ``timeit`` advises: other load on the machine only adds time.
    """
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - start) / number * 1e6)
    return min(samples)


class _Trivial:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    parser.add_argument("--number", type=int, default=20000)
    args = parser.parse_args()
    n = args.number
    on_gpu = _torch.cuda_available()
    if on_gpu:
        torch.empty(1, device="cuda")  # initialise CUDA: releases then act for real
        torch.cuda.synchronize()

    trivial = _Trivial()

    def bare_with() -> None:
        with trivial:
            pass

    off = hm.expandable_segments(False)

    def no_change() -> None:
        with off:
            pass

    toggle_only = hm.expandable_segments(True, release_cache=False)

    def toggle() -> None:
        with toggle_only:
            pass

    toggle_release = hm.expandable_segments(True)

    def toggle_with_release() -> None:
        with toggle_release:
            pass

    def raw_toggle() -> None:
        # looked up at each call, as every writer does: a reference bound before the
        # first scope would keep torch 2.10 - 2.11's write watch from starting
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
        if setter is not None:
            setter = getattr(setter, "__wrapped__", setter)
            setter("expandable_segments:True")
            setter("expandable_segments:False")

    figures: dict[str, Any] = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "bare_with_us": per_call_us(bare_with, number=n),
        "no_change_us": per_call_us(no_change, number=n),
        "toggle_us": per_call_us(toggle, number=n),
        "toggle_with_release_us": per_call_us(toggle_with_release, number=max(n // 20, 100)),
    }
    # nothing to free and no garbage: a release right after another one
    hm.release_cache()
    figures["release_no_gc_ms"] = (
        per_call_us(lambda: hm.release_cache(collect_garbage=False), number=200) / 1e3
    )
    # with garbage collection: one full gc.collect() pass dominates (shown beside it)
    figures["release_default_ms"] = per_call_us(hm.release_cache, number=3, repeat=3) / 1e3
    figures["gc_collect_ms"] = per_call_us(gc.collect, number=3, repeat=3) / 1e3
    figures["empty_cache_us"] = per_call_us(torch.cuda.empty_cache, number=200) if on_gpu else 0.0
    # last: hybridmem notices this change behind its back (and logs it once)
    figures["raw_setter_toggle_us"] = per_call_us(raw_toggle, number=n)

    targets = [
        ("no change (enter+exit)", figures["no_change_us"], 5.0, "us"),
        ("real toggle, no release", figures["toggle_us"], 20.0, "us"),
        ("release_cache, nothing to free, no gc", figures["release_no_gc_ms"], 1.0, "ms"),
    ]
    print(f"torch {figures['torch']} on {figures['device']}")
    print(f"{'measure':46} {'value':>10} {'target':>8}  ratio")
    for name, value, target, unit in targets:
        print(f"{name:46} {value:8.2f}{unit} {target:6.1f}{unit}  {value / target:5.2f}x of target")
    yardstick = figures["bare_with_us"]
    print(
        f"no change = {figures['no_change_us'] / yardstick:.0f}x, toggle = "
        f"{figures['toggle_us'] / yardstick:.0f}x a bare `with` (the machine-speed yardstick)"
    )
    print("baselines (same run):")
    print(f"  bare `with` of a trivial context manager   {yardstick:8.2f}us")
    print(f"  torch raw setter, on + off                 {figures['raw_setter_toggle_us']:8.2f}us")
    with_release = figures["toggle_with_release_us"]
    print(f"  toggle including its cache release         {with_release:8.2f}us")
    print(f"  torch.cuda.empty_cache()                   {figures['empty_cache_us']:8.2f}us")
    print(f"  one gc.collect()                           {figures['gc_collect_ms']:8.2f}ms")
    print(f"  release_cache() default (one gc pass)      {figures['release_default_ms']:8.2f}ms")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
