"""Can an offload return its device memory while its copies still run, at no cost to them?

Issue #25, item 3. In the switch to rollout at 32 GiB the ``release`` stage (the
driver unmapping and releasing what the offload freed, about 2.8 ms per GiB in
expandable segments) took 46-50 ms after a 315 ms offload. This script measures, in
one process and ``--repeats`` times each, an offload of ``--gib`` of tensors
allocated in expandable segments into a pinned host buffer, on a side stream:

- ``copy``: the copies alone (the ceiling: nothing is freed);
- ``then``: the copies, then every tensor freed and the cache emptied (what the
  switch does now: ``offload``, then ``release``);
- ``chunkN``: an event after every N MiB of copies; the host waits for each event,
  frees the tensors copied before it and empties the cache, while the later copies
  run (progressive release);
- ``M+sync_after`` / ``M+sync_during``: method M with a device-to-device copy of
  ``--sync-gib`` (the weight sync's stand-in) on a third stream, queued after M
  returned the memory / as soon as the offload's copies are queued. Against ``sync``,
  that copy alone: does a weight sync run at its rate after a large release, and
  does it overlap an offload?

Each total is printed against ``copy`` measured in the same run, with the device
free memory at the end (every method must return the same). The data is checked
bit for bit once per method.

The host buffer (``--pool``) is torch's pinned memory (``torch``: ``cudaHostAlloc``
rounded up to a power of two), the Offloader's pool (``offloader``: huge pages
registered portable and mapped), huge pages registered portable only
(``huge-unmapped``), 4 KiB pages registered portable and mapped (``small-mapped``),
or an exact ``cuMemHostAlloc`` (``hostalloc``, portable and mapped). On the H200
``chunk512`` cost 1.004-1.006x with every one of them. The same release in the
Offloader did not pay in the switch (decision 83) for another reason: the switch
had reloaded the state into classic segments, whose ``cudaFree`` waits for the
whole device (decision 84).

Run on a GPU: ``python benchmarks/release_during_offload.py [--gib 16] [--mib 64]
[--chunks 512,1024,2048] [--sync-gib 1.5] [--repeats 5] [--pool torch] [--json F]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MiB = 1 << 20
GiB = 1 << 30
POOLS = ("torch", "offloader", "huge-unmapped", "small-mapped", "hostalloc")


def host_buffer(pool: str, nbytes: int) -> Any:
    """A uint8 CPU tensor of ``nbytes`` pinned the way ``pool`` says (kept for the run)."""
    import ctypes

    import torch

    from hybridmem import _torch
    from hybridmem._platform import cuda_driver
    from hybridmem._platform.host_memory import huge_page_region

    if pool == "torch":
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    if pool == "hostalloc":  # exact size; CU_MEMHOSTALLOC_PORTABLE | DEVICEMAP
        pointer = ctypes.c_void_p()
        alloc = cuda_driver.function("cuMemHostAlloc")
        cuda_driver.check(
            "cuMemHostAlloc", alloc(ctypes.byref(pointer), ctypes.c_size_t(nbytes), 3)
        )
        assert pointer.value is not None
        array = (ctypes.c_uint8 * nbytes).from_address(pointer.value)
        return torch.frombuffer(array, dtype=torch.uint8)
    region = huge_page_region(nbytes) if pool != "small-mapped" else None
    buffer = (
        torch.frombuffer(region, dtype=torch.uint8)
        if region is not None
        else torch.empty(nbytes, dtype=torch.uint8)
    )
    if not _torch.pin_host_tensor(buffer, mapped=pool != "huge-unmapped"):
        raise RuntimeError(f"could not pin the {pool} buffer")
    return buffer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=16.0, help="bytes offloaded (GiB)")
    parser.add_argument("--mib", type=int, default=64, help="size of each tensor (MiB)")
    parser.add_argument("--chunks", default="512,1024,2048", help="progressive chunk sizes (MiB)")
    parser.add_argument("--sync-gib", type=float, default=1.5, help="device copy (GiB)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pool", choices=POOLS, default="torch", help="the host buffer")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.gib <= 0 or args.mib <= 0 or args.repeats < 1:
        parser.error("--gib, --mib and --repeats must be positive")
    # The switch's trainer state lives in expandable segments: set before CUDA starts.
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    chunks = [int(c) for c in args.chunks.split(",") if c]
    count = max(1, int(args.gib * GiB) // (args.mib * MiB))
    numel = args.mib * MiB
    cuda: Any = torch.cuda  # its Stream and Event are untyped
    torch.empty(1, device="cuda")  # a current context, for the hostalloc pool
    host = host_buffer(args.pool, count * numel)
    side, third = cuda.Stream(), cuda.Stream()
    sync_numel = int(args.sync_gib * GiB) // 4
    sync_src = torch.ones(sync_numel, dtype=torch.float32, device="cuda")
    sync_dst = torch.empty_like(sync_src)

    def device_copy() -> None:
        third.wait_stream(torch.cuda.current_stream())
        with cuda.stream(third):
            sync_dst.copy_(sync_src)

    def make() -> list[Any]:
        tensors = [torch.empty(numel, dtype=torch.uint8, device="cuda") for _ in range(count)]
        for i, t in enumerate(tensors):
            t.fill_(i % 251)
        torch.cuda.synchronize()
        return tensors

    def run(method: str, tensors: list[Any]) -> float:
        base, _, extra = method.partition("+")
        if base == "sync":  # the device copy alone
            start = time.perf_counter()
            device_copy()
            third.synchronize()
            return time.perf_counter() - start
        chunk = int(base[5:]) * MiB if base.startswith("chunk") else 0
        start = time.perf_counter()
        side.wait_stream(torch.cuda.current_stream())
        marks: list[tuple[int, Any]] = []
        done = 0
        with cuda.stream(side):
            for i, t in enumerate(tensors):
                host[i * numel : (i + 1) * numel].copy_(t, non_blocking=True)
                done += numel
                if chunk and (done >= chunk or i == count - 1):
                    event = cuda.Event()
                    event.record(side)
                    marks.append((i + 1, event))
                    done = 0
        if extra == "sync_during":
            device_copy()
        if base == "copy":
            side.synchronize()
        elif base == "then":
            side.synchronize()
            tensors.clear()
            torch.cuda.empty_cache()
        else:
            freed = 0
            for upto, event in marks:
                event.synchronize()
                for j in range(freed, upto):
                    tensors[j] = None  # its copy has landed: free it now
                freed = upto
                torch.cuda.empty_cache()
            tensors.clear()
        if extra == "sync_after":
            device_copy()
        third.synchronize()
        return time.perf_counter() - start

    methods = ["copy", "then"] + [f"chunk{c}" for c in chunks]
    middle = f"chunk{chunks[len(chunks) // 2]}" if chunks else "then"
    methods += ["sync", "then+sync_after", "then+sync_during", f"{middle}+sync_during"]
    times: dict[str, list[float]] = {m: [] for m in methods}
    ends: dict[str, int] = {}
    for rep in range(args.repeats):
        for method in methods:
            tensors = make()
            times[method].append(run(method, tensors))
            if rep == 0 and method != "sync":  # every byte landed in the host buffer
                view = host.view(count, numel)
                want = (torch.arange(count, dtype=torch.int64) % 251).to(torch.uint8)
                if not bool((view[:, :: 1 << 16] == want[:, None]).all()):
                    print(f"{method}: data differs", file=sys.stderr)
                    return 1
            del tensors
            torch.cuda.empty_cache()
            ends[method] = torch.cuda.mem_get_info()[0]
    ceiling = statistics.median(times["copy"])
    nbytes = count * numel
    print(
        f"{nbytes / GiB:.1f} GiB in {count} tensors of {args.mib} MiB into the {args.pool} "
        f"pool; {args.repeats} runs each"
    )
    print(f"{'method':<12}{'median ms':>10}{'min ms':>9}{'/ copy':>8}{'GB/s':>8}{'free GiB':>10}")
    rows: list[dict[str, Any]] = []
    for method in methods:
        median = statistics.median(times[method])
        row = {
            "method": method,
            "median_s": median,
            "min_s": min(times[method]),
            "over_copy": median / ceiling,
            "gbps": nbytes / median / 1e9,
            "runs_s": times[method],
            "free_after": ends[method],
        }
        rows.append(row)
        print(
            f"{method:<12}{median * 1e3:>10.1f}{min(times[method]) * 1e3:>9.1f}"
            f"{median / ceiling:>8.3f}{nbytes / median / 1e9:>8.1f}{ends[method] / GiB:>10.2f}"
        )
    if args.json:
        result = {"gib": nbytes / GiB, "pool": args.pool, "rows": rows}
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
