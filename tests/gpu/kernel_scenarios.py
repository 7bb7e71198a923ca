"""GPU scenario: the Offloader's reload by kernels (decision 80), in a spawned process.

Run by ``tests/gpu/test_offload_gpu.py``: ``python -m tests.gpu.kernel_scenarios NAME``
prints the facts as one JSON line.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.multiprocessing as tmp

import hybridmem as hm

MiB = 1 << 20
_ctx = tmp.get_context("spawn")


def _peer(conn: Connection, nbytes: int) -> None:
    """Another process: takes ``nbytes`` and writes them, frees them on each command."""
    torch.cuda.set_device(0)
    while conn.recv() == "take":
        held = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        held.fill_(1)
        torch.cuda.synchronize()
        del held
        torch.cuda.empty_cache()
        conn.send("freed")


def _state() -> dict[str, torch.Tensor]:
    """Tensors of odd byte lengths (a tail after the 8-byte words) and one large one."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    big = torch.randn(96 * MiB // 2, device="cuda", dtype=torch.bfloat16, generator=gen)
    return {
        "big_bf16": big,
        "odd_bf16": torch.randn(1_000_003, device="cuda", dtype=torch.bfloat16, generator=gen),
        "three_bytes": torch.randint(0, 127, (3,), device="cuda", dtype=torch.int8, generator=gen),
        "fp32": torch.randn(777, 13, device="cuda", generator=gen),
        "fp64_view": torch.randn(64, 64, device="cuda", dtype=torch.float64, generator=gen)[3:, 5:],
    }


def offload_by_kernel() -> dict[str, Any]:
    """Bit-exact reloads by kernel: blocking, non-blocking, after a peer's 40 GiB free."""
    torch.cuda.set_device(0)
    state = _state()
    reference = {k: v.cpu().clone() for k, v in state.items()}
    off = hm.Offloader(list(state.values()))
    exact: list[bool] = []
    rates: dict[str, list[float]] = {"kernel": [], "copy_engine": []}
    parent, child = _ctx.Pipe()
    peer = _ctx.Process(target=_peer, args=(child, 40 << 30))
    peer.start()
    try:
        for cycle in range(6):
            off.offload()
            way = "kernel" if cycle % 2 == 0 else "copy_engine"
            if cycle >= 2:  # the peer takes and frees, as an engine's sleep does
                parent.send("take")
                assert parent.recv() == "freed"
            report = off.reload(by=way)  # type: ignore[arg-type]
            rates[way].append(report.gbps)
            exact.append(all(torch.equal(state[k].cpu(), reference[k]) for k in state))
        # Non-blocking: work queued on the current stream afterwards sees the data.
        expected = sum(float(v.double().sum()) for v in state.values())
        off.offload()
        off.reload(non_blocking=True, by="kernel")
        got = sum(float(v.double().sum()) for v in state.values())
        (chunk,) = off._host.chunks  # a whole offload: one chunk
        view = chunk.device_view(torch.device("cuda", 0))
        pool_bytes = chunk.tensor.numel()
        view_matches = view is not None and torch.equal(view.cpu(), chunk.tensor)
        # The switch's early reload (decision 81): a head by copy engine, waited for,
        # then the tail queued by kernel while the peer frees, as an engine's sleep does.
        head_tail: list[bool] = []
        for _ in range(2):
            off.offload()
            off.reload(by="copy_engine", max_bytes=off.host_bytes // 2)
            head_left = bool(off.offloaded_groups)
            off.reload(non_blocking=True, by="kernel")
            parent.send("take")
            assert parent.recv() == "freed"
            torch.cuda.synchronize()
            head_tail.append(
                head_left
                and not off.offloaded_groups
                and all(torch.equal(state[k].cpu(), reference[k]) for k in state)
            )
    finally:
        parent.send("stop")
        peer.join(timeout=60)
    return {
        "exact": exact,
        "non_blocking_exact": got == expected
        and all(torch.equal(state[k].cpu(), reference[k]) for k in state),
        "has_view": view is not None,
        "view_is_the_pool": view_matches,
        "head_then_tail_exact": head_tail,
        "pool_bytes": pool_bytes,
        "reload_gbps": rates,
        "peer_exit": peer.exitcode,
    }


def reload_feed() -> dict[str, Any]:
    """Decision 94: a reload fed a chunk at a time, stopped early, through a peer's free."""
    import time

    torch.cuda.set_device(0)
    state = _state()
    gen = torch.Generator(device="cuda").manual_seed(1)
    for index in range(64):  # 4 GiB more in 64 MiB pieces: the feed has time to pace
        state[f"piece{index}"] = torch.randint(
            0, 255, (64 * MiB,), device="cuda", dtype=torch.uint8, generator=gen
        )
    reference = {k: v.cpu().clone() for k, v in state.items()}

    def exact() -> bool:
        return all(torch.equal(state[k].cpu(), reference[k]) for k in state)

    off = hm.Offloader(list(state.values()))
    parent, child = _ctx.Pipe()
    peer = _ctx.Process(target=_peer, args=(child, 40 << 30))
    peer.start()
    facts: dict[str, Any] = {}
    try:
        off.offload()
        total = sum(slot.nbytes for slot in off._slots)  # the pool pads each to 512 B
        started = time.perf_counter()
        off.reload(by="copy_engine")
        facts["plain_s"] = time.perf_counter() - started
        # Stopped at once: what the caller fed while allocating, and one window.
        off.offload()
        feed = off.start_reload()
        report = feed.stop()
        facts["stopped_fed"] = report.nbytes
        facts["stopped_left"] = off.reload_bytes() > 0 and bool(off.offloaded_groups)
        off.reload()
        facts["stopped_exact"] = exact()
        # Fed through a peer's free (as an engine's sleep), the rest by kernel.
        off.offload()
        feed = off.start_reload()
        parent.send("take")
        assert parent.recv() == "freed"
        fed = feed.fed_bytes
        report = feed.finish(by="kernel")
        facts["through_free_fed"] = fed
        facts["through_free_all"] = report.nbytes == total and not off.offloaded_groups
        facts["through_free_exact"] = exact()
        # Left to run: every byte by copy engine, at about the plain reload's rate.
        off.offload()
        started = time.perf_counter()
        feed = off.start_reload()
        while feed.fed_bytes < total and time.perf_counter() - started < 10:
            time.sleep(0.001)  # the thread feeds; the host only watches
        feed.finish(by="kernel")
        facts["fed_s"] = time.perf_counter() - started
        facts["fed_exact"] = exact()
        facts["total"] = total
    finally:
        parent.send("stop")
        peer.join(timeout=60)
    facts["peer_exit"] = peer.exitcode
    return facts


def growing_pool() -> dict[str, Any]:
    """Offloads of a growing part: the pool grows by pinned, mapped chunks; reloads exact.

    The tensors smallest first, so that each ``max_bytes`` takes a longer prefix of the
    places: one storage, then four, then everything while the first is still offloaded
    (the pool grows with state in it), then everything again (it fits).
    """
    torch.cuda.set_device(0)
    state = dict(reversed(list(_state().items())))
    reference = {k: v.cpu().clone() for k, v in state.items()}
    off = hm.Offloader(list(state.values()))
    chunks: list[int] = []
    host_bytes: list[int] = []
    exact: list[bool] = []

    def cycle(*parts: int | None, by: str) -> None:
        for part in parts:
            off.offload(max_bytes=part)
        chunks.append(len(off._host.chunks))
        host_bytes.append(off.host_bytes)
        off.reload(by=by)  # type: ignore[arg-type]
        exact.append(
            not off.offloaded_groups
            and all(torch.equal(state[k].cpu(), reference[k]) for k in state)
        )

    cycle(1, by="kernel")
    cycle(100_000, by="kernel")
    cycle(1, None, by="kernel")
    cycle(None, by="copy_engine")
    device = torch.device("cuda", 0)
    return {
        "chunks": chunks,
        "host_bytes": host_bytes,
        "exact": exact,
        "all_pinned": all(chunk.tensor.is_pinned() for chunk in off._host.chunks),
        "all_mapped": all(chunk.device_view(device) is not None for chunk in off._host.chunks),
    }


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    "offload_by_kernel": offload_by_kernel,
    "reload_feed": reload_feed,
    "growing_pool": growing_pool,
}

if __name__ == "__main__":
    print(json.dumps(SCENARIOS[sys.argv[1]](), default=str))
