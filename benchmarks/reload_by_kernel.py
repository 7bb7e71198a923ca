"""Would a reload by kernels keep its rate, from the Offloader's kind of pool, as the engine frees?

Issue #25, item 3. ``benchmarks/reload_rate.py`` found that a host-to-device copy by
the copy engines runs at about half the pinned rate for half a second after another
process frees a lot of device memory, where an elementwise kernel reading the pinned
buffer through its device mapping keeps 0.82-0.92. From a pool made as the
Offloader's (a huge-page mapping registered with ``cudaHostRegister``) that kernel
read 0.79 once and 0.59 twice: three samples, one kind of pool. This script measures,
``--repeats`` times each, the reload's two situations:

- ``after``: this process released its cache, the peer took and freed
  ``--peer-gib``; then the copy lands in memory allocated for it (timed with it).
  This is the reload after the engine's sleep.
- ``during``: the peer holds its memory; the memory is allocated, the copy queued,
  and the peer told to free at once; timed until the copy has landed. This is the
  reload queued before the engine's sleep (``HybridSwitch(reload_early=True)``).

each by every way: ``ce`` (one ``copy_``, a copy engine), ``ce4`` (four chunks on four
streams: more copy engines?) and ``kernel`` (``bitwise_or`` of 8-byte words read
through the source's device mapping: the SMs), from every source: ``hostalloc``
(torch's pinned memory, ``cudaHostAlloc``), ``pool-huge`` (the Offloader's pool: an
anonymous mapping advised ``MADV_HUGEPAGE``, registered with flags 3, portable and
mapped) and ``pool-4k`` (the same advised ``MADV_NOHUGEPAGE``). Each rate is printed
against the ceiling: a copy engine's pinned copy into memory mapped all along,
measured first in the same process. Every copy is checked bit for bit once.

Run on a GPU: ``python benchmarks/reload_by_kernel.py [--gib 3] [--peer-gib 60]
[--repeats 6] [--json F]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GiB = 1 << 30

# The engine's stand-in: holds and frees device memory on command (stdin).
PEER = """
import sys, torch
torch.zeros(1, device="cuda")
print("ready", flush=True)
held = None
for line in sys.stdin:
    if line.startswith("hold"):
        held = torch.empty(int(line.split()[1]), dtype=torch.uint8, device="cuda")
        held.fill_(1)
        torch.cuda.synchronize()
    elif line.startswith("free"):
        held = None
        torch.cuda.empty_cache()
    print("done", flush=True)
"""


class Peer:
    """The engine's stand-in process: ``hold(n)`` and ``free()``, each answered."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", PEER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        if self._answer() != "ready":
            raise RuntimeError("the peer process did not start")

    def _answer(self) -> str:
        assert self.process.stdout is not None
        return self.process.stdout.readline().strip()

    def send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def done(self) -> None:
        if self._answer() != "done":
            raise RuntimeError("the peer process did not answer")

    def hold(self, nbytes: int) -> None:
        self.send(f"hold {nbytes}")
        self.done()

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=60)


def _cudart() -> Any:
    import torch

    get: Any = torch.cuda.cudart
    return get()


def _device_view(host: Any) -> Any:
    """A CUDA int64 tensor over a pinned, mapped host buffer (unified addressing)."""
    import types

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


def _mapped_pool(nbytes: int, huge: bool) -> tuple[Any, mmap.mmap]:
    """An anonymous mapping advised huge pages or not, registered portable and mapped."""
    import torch

    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE" if huge else "MADV_NOHUGEPAGE", None)
    if advice is not None:
        with contextlib.suppress(OSError):
            region.madvise(advice)
    pool = torch.frombuffer(region, dtype=torch.uint8)
    pool.fill_(0)  # touch every page before pinning, as a filled pool is
    status = int(_cudart().cudaHostRegister(pool.data_ptr(), nbytes, 3))
    if status != 0:
        raise RuntimeError(f"cudaHostRegister(flags=3) failed: {status}")
    return pool, region


def _huge_kib() -> int:
    """This process's anonymous memory in transparent huge pages, KiB."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return -1


def _ways(source: Any, view: Any) -> dict[str, Callable[[Any], None]]:
    """How to copy ``source`` (a pinned host buffer) into a device tensor ``out``."""
    import torch

    def ce(out: Any) -> None:
        out.copy_(source, non_blocking=True)

    streams = [torch.cuda.Stream() for _ in range(4)]  # type: ignore[no-untyped-call]

    def ce4(out: Any) -> None:
        step = -(-source.numel() // len(streams))
        current = torch.cuda.current_stream()
        for index, stream in enumerate(streams):
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                part = slice(index * step, (index + 1) * step)
                out[part].copy_(source[part], non_blocking=True)
        for stream in streams:
            current.wait_stream(stream)

    def kernel(out: Any) -> None:
        torch.bitwise_or(view, 0, out=out.view(torch.int64))

    return {"ce": ce, "ce4": ce4, "kernel": kernel}


def _timed(
    nbytes: int, way: Callable[[Any], None], peer: Peer, peer_bytes: int, situation: str
) -> tuple[float, Any]:
    """GB/s of one reload (allocation and copy) in ``situation``; returns it and the copy."""
    import torch

    import hybridmem as hm

    hm.release_cache()
    if situation == "after":
        peer.hold(peer_bytes)
        peer.send("free")
        peer.done()
    else:
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
        peer.done()
    return nbytes / seconds / 1e9, out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=3.0, help="the state reloaded")
    parser.add_argument("--peer-gib", type=float, default=60.0, help="what the peer frees")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()

    import torch

    import hybridmem as hm

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
    for name, huge in (("pool-huge", True), ("pool-4k", False)):
        before = _huge_kib()
        pool, region = _mapped_pool(nbytes, huge)
        facts["huge_kib"][name] = _huge_kib() - before
        pool.copy_(expected)
        sources[name] = pool
        keep.append(region)
    peer = Peer()
    try:
        with hm.expandable_segments(True):  # as the trainer state's memory is
            for source_name, source in sources.items():
                view = _device_view(source)
                for way_name, way in _ways(source, view).items():
                    if way_name == "ce4" and source_name != "hostalloc":
                        continue
                    for situation in ("after", "during"):
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
                            f"{key:<28} {each}  median/ceiling "
                            f"{sorted(found)[len(found) // 2] / ceiling:.2f}",
                            flush=True,
                        )
    finally:
        peer.close()
        for source in sources.values():
            if source is not hostalloc:
                _cudart().cudaHostUnregister(source.data_ptr())
    print(f"ceiling (copy engine, pinned, into mapped memory): {ceiling:.1f} GB/s")
    print(f"transparent huge pages: {facts['thp']}; pools' huge KiB: {facts['huge_kib']}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(facts, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
