"""Would a reload by kernels keep its rate as the engine frees, and would both ways at once beat it?

Issue #25, item 3. ``benchmarks/reload_rate.py`` found that a host-to-device copy by
the copy engines runs at about half the pinned rate for half a second after another
process frees a lot of device memory, where an elementwise kernel reading the pinned
buffer through its device mapping keeps 0.82-0.92 (decision 80). This script
measures, ``--repeats`` times each, a reload in three situations:

- ``steady``: no other process frees anything (what each way does on its own);
- ``after``: this process released its cache, the peer took and freed
  ``--peer-gib``; then the copy lands in memory allocated for it (timed with it).
  This is the reload after the engine's sleep.
- ``during``: the peer holds its memory; the memory is allocated, the copy queued,
  and the peer told to free at once; timed until the copy has landed. This is the
  reload queued before the engine's sleep (``HybridSwitch(reload_early=True)``).

each by every way: ``ce`` (one ``copy_``, a copy engine), ``kernel``
(``hybridmem._torch.copy_by_kernel``: 8-byte words read through the source's device
mapping, by the SMs), ``kernel2`` (two halves by kernel on two streams) and
``ceNN+kernel`` (the first NN% by copy engine and the rest by kernel, at once on two
streams: whether the bus carries both where the copy engine alone is slowed), from
every source: ``hostalloc`` (torch's pinned memory, ``cudaHostAlloc``) and ``pool``
(the Offloader's kind of pool: an anonymous mapping advised ``MADV_HUGEPAGE``,
pinned and mapped through the seam, ``pin_host_tensor(mapped=True)``;
``--small-pages`` adds one advised ``MADV_NOHUGEPAGE``). Each rate is printed against
the ceiling: a copy engine's pinned copy into memory mapped all along, measured first
in the same process. Every copy is checked bit for bit once.

Run on a GPU: ``python benchmarks/reload_by_kernel.py [--gib 3] [--peer-gib 60]
[--repeats 5] [--small-pages] [--json F]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hybridmem.bench.peers import MemoryPeer  # noqa: E402 (after the path)

GiB = 1 << 30


def _mapped_pool(nbytes: int, huge: bool) -> tuple[Any, mmap.mmap]:
    """An anonymous mapping advised huge pages or not, pinned and mapped as the Offloader's.

    Pinned through the seam the Offloader uses (``pin_host_tensor(mapped=True)``), so the
    kernel rows read exactly what a reload by kernels reads.
    """
    import torch

    from hybridmem import _torch

    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE" if huge else "MADV_NOHUGEPAGE", None)
    if advice is not None:
        with contextlib.suppress(OSError):
            region.madvise(advice)
    pool = torch.frombuffer(region, dtype=torch.uint8)
    pool.fill_(0)  # touch every page before pinning, as a filled pool is
    if not _torch.pin_host_tensor(pool, mapped=True):
        raise RuntimeError("pinning the pool (cudaHostRegister, mapped) failed")
    return pool, region


def _huge_kib() -> int:
    """This process's anonymous memory in transparent huge pages, KiB."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return -1


def _ways(source: Any, view: Any) -> dict[str, Callable[[Any], None]]:
    """How to copy ``source`` (a pinned host buffer) into a device tensor ``out``.

    ``view`` is ``source``'s device view (``hybridmem._torch.host_device_view``).
    """
    import torch

    from hybridmem import _torch

    streams = [torch.cuda.Stream() for _ in range(2)]  # type: ignore[no-untyped-call]

    def ce(out: Any) -> None:
        out.copy_(source, non_blocking=True)

    def kernel(out: Any) -> None:
        _torch.copy_by_kernel(out, view)

    def split(copy_engine_share: float, kernels: bool) -> Callable[[Any], None]:
        """The first share by one way, the rest by the other, both at once on two streams."""

        def run(out: Any) -> None:
            cut = int(out.numel() * copy_engine_share) // 8 * 8
            current = torch.cuda.current_stream()
            for stream in streams:
                stream.wait_stream(current)
            with torch.cuda.stream(streams[0]):
                if kernels:
                    _torch.copy_by_kernel(out[:cut], view[:cut])
                else:
                    out[:cut].copy_(source[:cut], non_blocking=True)
            with torch.cuda.stream(streams[1]):
                _torch.copy_by_kernel(out[cut:], view[cut:])
            for stream in streams:
                current.wait_stream(stream)

        return run

    return {
        "ce": ce,
        "kernel": kernel,
        "kernel2": split(0.5, kernels=True),
        "ce25+kernel": split(0.25, kernels=False),
        "ce40+kernel": split(0.40, kernels=False),
    }


def _timed(
    nbytes: int, way: Callable[[Any], None], peer: MemoryPeer, peer_bytes: int, situation: str
) -> tuple[float, Any]:
    """GB/s of one reload (allocation and copy) in ``situation``; returns it and the copy."""
    import torch

    import hybridmem as hm

    hm.release_cache()
    if situation == "after":
        peer.hold(peer_bytes)
        peer.free()
    elif situation == "during":
        peer.hold(peer_bytes)
    torch.cuda.synchronize()
    started = time.perf_counter()
    out = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    way(out)
    if situation == "during":
        peer.send("free")  # the engine's sleep, right after the reload was queued
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    if situation == "during":
        peer.expect("done")
    return nbytes / seconds / 1e9, out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=3.0, help="the state reloaded")
    parser.add_argument("--peer-gib", type=float, default=60.0, help="what the peer frees")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--small-pages", action="store_true", help="also a pool of 4 KiB pages (measured alike)"
    )
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()

    import torch

    import hybridmem as hm
    from hybridmem import _torch

    if not torch.cuda.is_available():
        print("reload_by_kernel.py needs a CUDA GPU", file=sys.stderr)
        return 2
    nbytes = int(args.gib * GiB) // 8 * 8
    peer_bytes = int(args.peer_gib * GiB)
    expected = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    hostalloc = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    hostalloc.copy_(expected)
    mapped = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    rates = []
    for _ in range(3):
        torch.cuda.synchronize()
        started = time.perf_counter()
        mapped.copy_(hostalloc, non_blocking=True)
        torch.cuda.synchronize()
        rates.append(nbytes / (time.perf_counter() - started) / 1e9)
    ceiling = max(rates)
    del mapped
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    facts: dict[str, Any] = {
        "gib": args.gib,
        "peer_gib": args.peer_gib,
        "ceiling_gbps": ceiling,
        "thp": thp.read_text().strip() if thp.exists() else "unknown",
        "huge_kib": {},
        "rows": {},
    }
    sources: dict[str, Any] = {"hostalloc": hostalloc}
    keep = []
    pages = (("pool-huge", True), ("pool-4k", False)) if args.small_pages else (("pool", True),)
    for name, huge in pages:
        before = _huge_kib()
        pool, region = _mapped_pool(nbytes, huge)
        facts["huge_kib"][name] = _huge_kib() - before
        pool.copy_(expected)
        sources[name] = pool
        keep.append(region)
    peer = MemoryPeer()  # every answer awaited with a bound
    try:
        with hm.expandable_segments(True):  # as the trainer state's memory is
            for source_name, source in sources.items():
                view = _torch.host_device_view(source, torch.device("cuda", 0))
                if view is None:
                    raise RuntimeError(f"{source_name}: no device view of the pinned memory")
                for way_name, way in _ways(source, view).items():
                    for situation in ("steady", "after", "during"):
                        key = f"{way_name} {source_name} {situation}"
                        found = []
                        for _ in range(args.repeats):
                            gbps, out = _timed(nbytes, way, peer, peer_bytes, situation)
                            found.append(gbps)
                        if not torch.equal(out.cpu(), expected):
                            raise RuntimeError(f"{key}: the copy did not land bit for bit")
                        del out
                        facts["rows"][key] = found
                        each = " ".join(f"{r:5.1f}" for r in found)
                        print(
                            f"{key:<30} {each}  median/ceiling "
                            f"{sorted(found)[len(found) // 2] / ceiling:.2f}",
                            flush=True,
                        )
                del view
    finally:
        peer.close()
        for source in sources.values():
            if source is not hostalloc:
                _torch.unpin_host_tensor(source.data_ptr())
    print(f"ceiling (copy engine, pinned, into mapped memory): {ceiling:.1f} GB/s")
    print(f"transparent huge pages: {facts['thp']}; pools' huge KiB: {facts['huge_kib']}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(facts, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
