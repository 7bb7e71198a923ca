"""Why a reload copies at half the offload's rate: the Offloader's reload, case by case.

Issue #25: in ``hybridmem bench``'s timeline a 2.95 GB reload took 110-119 ms (25-27
GB/s) where its offload took 55 ms (53 GB/s), and the pool copies host to device at
53-54 GB/s (``benchmarks/pinning.py``). Allocating in chunks while copying did not
help (docs/benchmarks.md), so allocation is not the cause. This script reloads the
same state in three situations, each six times (the first a warm-up), and prints each
reload's GB/s, the median of the counted ones and the worst against a plain
host-to-device copy from a pinned buffer into memory already mapped, measured in the
same process:

- ``cached``: offload without releasing the cache: the reload reuses memory torch
  still holds (mapped, this process's own);
- ``released``: offload, ``hm.release_cache()``: the reload maps memory this process
  gave back to the driver a moment before;
- ``after-peer``: offload and release, then another process (the engine's stand-in)
  takes most of the device, writes it and frees it: the reload maps memory another
  process just let go (the first run's guess: the driver clears that memory before
  handing it over; the cases below tell);
- ``after-peer+Nms``: the same, the reload starting N ms after the peer's free
  (``--waits``): work the driver does in the background after a free ends by then;
- ``mapped-after-peer``: no reload, the plain pinned copy into memory this process
  has kept mapped all along, right after the peer's free: whether the slowdown
  follows the memory the reload maps or slows every copy while it lasts;
- ``kernel`` and ``kernel-after-peer``: the same copy done by an elementwise kernel
  that reads the pinned buffer through its device mapping (unified addressing), so
  by the SMs and not by a copy engine: whether the slowdown is the copy engines'
  (measured on the H200, 2026-12-02: the kernel copies at 0.92 of the ceiling before
  and after the peer's free, where the copy engine falls to 0.50; docs/benchmarks.md);
- ``fresh-after-peer`` and ``kernel-fresh-after-peer``: a reload's situation without
  the Offloader, by each way: this process released its cache, the peer took and
  freed, and the copy lands in memory allocated for it (expandable segments; the
  allocation is timed with the copy). Whether a reload by kernels would keep the
  kernel's rate: measured on the H200, 2026-12-02 (``reload_rate_pool.json``): the
  copy engine 0.46, the kernel **0.82**;
- ``pool3-kernel-fresh-after-peer``: the same kernel reading a pool made as the
  Offloader's is (a huge-page mapping, ``cudaHostRegister``), registered with a device
  mapping asked for (flags 3, not the Offloader's 1); and what registering the pool
  costs in device memory with flags 1 and 3 (the Offloader's footprint, issue #25's
  item 2). Measured in the same run: 0.79 on the first copy, 0.59 on the next two;
  registering cost 4.0 MiB with either flag.

Run on a GPU: ``python benchmarks/reload_rate.py [--gib 3] [--peer-gib 60]
[--waits 100 500] [--json F]``.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hybridmem.bench.peers import MemoryPeer  # noqa: E402 (after the path)

GiB = 1 << 30


def _gbps(nbytes: int, copy: Callable[[], object]) -> float:
    """GB/s of one ``copy()`` of ``nbytes``, timed between two device synchronisations."""
    import torch

    torch.cuda.synchronize()
    started = time.perf_counter()
    copy()
    torch.cuda.synchronize()
    return nbytes / (time.perf_counter() - started) / 1e9


def _host_on_device(host: Any) -> Any:
    """The pinned buffer as a CUDA tensor: its device mapping, read by kernels over PCIe.

    Under unified addressing a pinned buffer's host pointer is also its device pointer;
    ``__cuda_array_interface__`` hands it to torch without a copy.
    """
    import torch

    mapping = types.SimpleNamespace(
        __cuda_array_interface__={
            "shape": (host.numel() // 8,),
            "typestr": "<i8",
            "data": (host.data_ptr(), False),
            "version": 2,
            "strides": None,
        }
    )
    return torch.as_tensor(mapping, device="cuda")


def _cudart() -> Any:
    """torch's CUDA runtime bindings (untyped in torch)."""
    import torch

    get: Any = torch.cuda.cudart
    return get()


def _registered_pool(host: Any, flags: int) -> tuple[Any, int]:
    """A copy of ``host`` in the Offloader's kind of pool, registered with ``flags``.

    The pool is made by the Offloader's :class:`~hybridmem.memory.host_pool.HostPool`
    (a huge-page mapping), left unpinned there and registered here with
    ``cudaHostRegister``: the Offloader registers with flags 1 (portable); a reload by
    kernels must read it through its device mapping, which flags 3 (portable and
    mapped) asks for. Returns the pool and the device memory its registration cost
    (free before minus after).
    """
    import torch

    from hybridmem.memory.host_pool import HostPool

    maker = HostPool(pin_memory=False)
    maker.grow(host.numel(), None)
    (chunk,) = maker.chunks
    pool = chunk.tensor
    pool.copy_(host)
    torch.cuda.synchronize()
    free = torch.cuda.mem_get_info()[0]
    status = int(_cudart().cudaHostRegister(pool.data_ptr(), pool.numel(), flags))
    if status != 0:
        raise RuntimeError(f"cudaHostRegister(flags={flags}) failed: {status}")
    torch.cuda.synchronize()
    return pool, free - torch.cuda.mem_get_info()[0]


def _kernel_into_new(source: Any, like: Any) -> Any:
    """The kernel copy of ``source`` (a device view) into new memory shaped as ``like``."""
    import torch

    return torch.bitwise_or(source, 0, out=torch.empty_like(like))


def _fresh_after_peer(
    name: str,
    copy: Callable[[], Any],
    host: Any,
    repeats: int,
    peer: MemoryPeer,
    peer_bytes: int,
) -> list[dict[str, Any]]:
    """``copy()`` (into memory it allocates) timed after a release and the peer's free.

    Raises:
        RuntimeError: the copy did not land bit for bit (or CUDA failed).
    """
    import torch

    import hybridmem as hm

    found = []
    for _ in range(repeats):
        hm.release_cache()
        peer.take(peer_bytes)
        found.append({"gbps": _gbps(host.numel(), copy)})
    if not torch.equal(copy().view(torch.uint8).cpu(), host):  # every byte copied
        raise RuntimeError(f"{name}: the copy did not land bit for bit")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=3.0, help="the state reloaded")
    parser.add_argument("--peer-gib", type=float, default=60.0, help="what the peer takes")
    parser.add_argument(
        "--repeats",
        type=int,
        default=6,
        help="runs per case, at least 6: the first a warm-up, the median of the rest "
        "reported with the worst beside",
    )
    parser.add_argument(
        "--waits", type=int, nargs="*", default=[100, 500], help="ms after the peer's free"
    )
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    if args.repeats < 6:
        parser.error(
            f"--repeats {args.repeats}: at least 6 (the first is a warm-up, the figure the "
            "median of the rest)"
        )

    import torch

    import hybridmem as hm

    if not torch.cuda.is_available():
        print("reload_rate.py needs a CUDA GPU", file=sys.stderr)
        return 2
    nbytes = int(args.gib * GiB)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    mapped = torch.empty(nbytes, dtype=torch.uint8, device="cuda")  # kept mapped all along

    def plain() -> object:  # a copy engine's pinned host-to-device copy
        return mapped.copy_(host, non_blocking=True)

    ceiling = max(_gbps(nbytes, plain) for _ in range(3))
    peer_bytes = int(args.peer_gib * GiB)
    # (case, release the cache, the peer takes and frees, ms after that)
    cases = [("cached", False, False, 0), ("released", True, False, 0)]
    cases += [("after-peer", True, True, 0)]
    cases += [(f"after-peer+{ms}ms", True, True, ms) for ms in args.waits]
    peer = MemoryPeer()  # the engine's stand-in: every answer awaited with a bound
    rows: dict[str, list[dict[str, Any]]] = {case[0]: [] for case in cases}
    registration_cost: dict[int, int] = {}  # cudaHostRegister flags -> device bytes
    try:
        with hm.expandable_segments(True):  # the trainer's phase: its state expandable
            state = torch.ones(nbytes // 4, dtype=torch.float32, device="cuda")
            off = hm.Offloader(state)
            off.offload()  # pins the pool once
            off.reload()
            for case, release, peer_frees, wait_ms in cases:
                for _ in range(args.repeats):
                    # offload() releases by default: "cached" must keep the memory
                    off.offload(release_cache=False)
                    if release:
                        hm.release_cache()
                    if peer_frees:
                        peer.take(peer_bytes)
                        time.sleep(wait_ms / 1000)  # a benchmark's wait, on purpose
                    free_before = torch.cuda.mem_get_info()[0]
                    report = off.reload()
                    rows[case].append(
                        {"gbps": report.gbps, "seconds": report.seconds, "free": free_before}
                    )
            assert bool((state == 1).all()), "the state came back changed"
            off.close()
        # No reload: copies into memory mapped all along, right after the peer's free.
        copies: dict[str, Callable[[], object]] = {"mapped": plain}
        try:  # the same copy by the SMs, reading the pinned buffer's device mapping
            on_device, words = _host_on_device(host), mapped.view(torch.int64)
        except (RuntimeError, TypeError, ValueError) as exc:
            print(f"kernel cases skipped: the pinned buffer has no device view ({exc})")
        else:
            copies["kernel"] = lambda: torch.bitwise_or(on_device, 0, out=words)
        for name, copy in copies.items():
            if name != "mapped":  # the plain copy's own rate is the ceiling
                rows[name] = [{"gbps": _gbps(nbytes, copy)} for _ in range(args.repeats)]
            rows[f"{name}-after-peer"] = []
            for _ in range(args.repeats):
                peer.take(peer_bytes)
                rows[f"{name}-after-peer"].append({"gbps": _gbps(nbytes, copy)})
        # A reload's situation without the Offloader: memory mapped for the copy (timed
        # with it), after this process released its cache and the peer freed.
        fresh: dict[str, Callable[[], Any]] = {
            "fresh": lambda: torch.empty_like(mapped).copy_(host, non_blocking=True)
        }
        if "kernel" in copies:
            fresh["kernel-fresh"] = functools.partial(_kernel_into_new, on_device, words)
        with hm.expandable_segments(True):  # as the reload's memory is
            for name, copy in fresh.items():
                rows[f"{name}-after-peer"] = _fresh_after_peer(
                    name, copy, host, args.repeats, peer, peer_bytes
                )
            # The Offloader's kind of pool: what registering it costs the device as it
            # is registered (flags 1, portable) and with a device mapping asked for (3,
            # portable and mapped), and the same kernel reading the mapped one.
            for flags in (1, 3):
                try:
                    pool, registration_cost[flags] = _registered_pool(host, flags)
                except RuntimeError as exc:
                    print(f"registering a pool with flags {flags} failed: {exc}")
                    continue
                if flags == 3 and "kernel" in copies:
                    try:
                        view = _host_on_device(pool)
                        rows["pool3-kernel-fresh-after-peer"] = _fresh_after_peer(
                            "pool3-kernel-fresh",
                            functools.partial(_kernel_into_new, view, words),
                            host,
                            args.repeats,
                            peer,
                            peer_bytes,
                        )
                    except (RuntimeError, TypeError, ValueError) as exc:
                        # A kernel fault leaves the context unusable: report, stop here.
                        print(f"pool3-kernel-fresh-after-peer failed: {exc}")
                        break
                _cudart().cudaHostUnregister(pool.data_ptr())
                del pool
    finally:
        peer.close()
    print(
        f"reload of {args.gib:g} GiB (expandable segments); pinned host-to-device into "
        f"mapped memory: {ceiling:.1f} GB/s"
    )
    print(f"{'case':<20} {'GB/s each (first: warm-up)':<40} {'median/ceil':>11} {'worst':>6}")
    for case, found in rows.items():
        rates = [r["gbps"] for r in found]
        counted = rates[1:] or rates  # the first run of a case is a warm-up
        each = " ".join(f"{r:5.1f}" for r in rates)
        print(
            f"{case:<20} {each:<40} {statistics.median(counted) / ceiling:11.2f} "
            f"{min(counted) / ceiling:6.2f}"
        )
    for flags, cost in registration_cost.items():
        print(
            f"registering the pool with flags {flags}: {cost / (1 << 20):.1f} MiB of device memory"
        )
    if args.json_path:
        Path(args.json_path).write_text(
            json.dumps(
                {
                    "gib": args.gib,
                    "ceiling_gbps": ceiling,
                    "cases": rows,
                    "registration_cost_bytes": registration_cost,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
