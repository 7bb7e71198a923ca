"""GPU scenarios, each run in a fresh interpreter (allocator state is process-global).

Usage: ``python -m tests.gpu.scenarios NAME`` with the environment the scenario
needs; the last line printed is a JSON object of facts the GPU tests assert on.
"""

from __future__ import annotations

import gc
import json
import random
import sys
from collections.abc import Callable
from typing import Any

import torch

import hybridmem as hm
from hybridmem import _torch

MiB = 1 << 20


def _segment_is_expandable(tensor: torch.Tensor) -> bool | None:
    """Whether the segment holding ``tensor`` is expandable, from torch's snapshot."""
    ptr = tensor.untyped_storage().data_ptr()
    for seg in torch.cuda.memory._snapshot()["segments"]:
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return bool(seg.get("is_expandable", False))
    return None


def _alloc(mib: int) -> torch.Tensor:
    return torch.empty(mib * MiB, dtype=torch.uint8, device="cuda")


def segments() -> dict[str, Any]:
    """(a) Tensors land in expandable segments inside True, classic ones inside False."""
    _alloc(1)
    out: dict[str, Any] = {}
    with hm.expandable_segments(True):
        a = _alloc(64)
        out["on"] = _segment_is_expandable(a)
        with hm.expandable_segments(False):
            b = _alloc(64)
            out["nested_off"] = _segment_is_expandable(b)
        c = _alloc(64)
        out["back_on"] = _segment_is_expandable(c)
    d = _alloc(64)
    out["off"] = _segment_is_expandable(d)
    del a, b, c, d

    # The pitfall the release guards against: a cached classic block is reused
    # by a tensor allocated after switching expandable segments on.
    x = _alloc(256)
    del x
    with hm.expandable_segments(True, release_cache=False):
        y = _alloc(128)
        out["without_release"] = _segment_is_expandable(y)
        del y
    x = _alloc(256)
    del x
    with hm.expandable_segments(True):
        z = _alloc(128)
        out["with_release"] = _segment_is_expandable(z)
        del z

    @hm.expandable_segments(True)
    def decorated() -> bool | None:
        return _segment_is_expandable(_alloc(32))

    out["decorated"] = decorated()
    out["after_decorated"] = _segment_is_expandable(_alloc(32))
    return out


def settings() -> dict[str, Any]:
    """(b) The user's settings survive a toggle and its exit (snapshot's view)."""
    _alloc(1)
    out: dict[str, Any] = {"start": _torch.snapshot_allocator_settings()}
    with hm.expandable_segments(True):
        out["inside_true"] = _torch.snapshot_allocator_settings()
        with hm.expandable_segments(False):
            out["inside_false"] = _torch.snapshot_allocator_settings()
    out["after"] = _torch.snapshot_allocator_settings()
    # Negative control: what every hand-written toggle does.
    _torch.set_allocator_settings("expandable_segments:False")
    out["raw_setter"] = _torch.snapshot_allocator_settings()
    out["torch"] = torch.__version__
    return out


def _scattered(rng: random.Random) -> list[torch.Tensor]:
    """Pathological: ~24 GiB of random sizes freed out of order, every 16th kept."""
    live: list[torch.Tensor] = []
    kept: list[torch.Tensor] = []
    for step in range(3000):
        size = rng.choice([rng.randint(1, 64) * 1024, rng.randint(1, 96) * MiB // 4])
        live.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
        if sum(t.numel() for t in live) > (24 << 30):
            rng.shuffle(live)
            del live[: len(live) * 3 // 4]
        if step % 97 == 0:
            kept.append(torch.empty(rng.randint(1, 32) * MiB, dtype=torch.uint8, device="cuda"))
    kept.extend(live[::16])
    return kept


def _training_like(rng: random.Random) -> list[torch.Tensor]:
    """A training phase: live params and Adam state, activations of varying length.

    Parameters (~6 GiB in tensors of 1-64 MiB) stay live; Adam's two states are
    created during the first step, between that step's activations (as torch.optim
    does lazily); 40 steps of activations sized by a random sequence length are
    freed each step; gradients live from backward to zero_grad; a small loss
    tensor per step is kept.
    """
    params = [
        torch.empty(rng.randint(1, 64) * MiB, dtype=torch.uint8, device="cuda") for _ in range(190)
    ]
    states: list[torch.Tensor] = []
    losses: list[torch.Tensor] = []
    for step in range(40):
        seq = rng.randint(256, 8192)
        acts = [
            torch.empty(seq * rng.randint(1, 16) * 4096, dtype=torch.uint8, device="cuda")
            for _ in range(24)
        ]
        grads = []
        for p in params:
            grads.append(torch.empty_like(p))
            if step == 0:
                states.append(torch.empty_like(p))
                states.append(torch.empty_like(p))
            if len(grads) % 24 == 0 and acts:
                acts.pop()  # backward frees activations as it goes
        del acts
        losses.append(torch.empty(4, device="cuda"))
        del grads  # zero_grad(set_to_none=True)
    return params + states + losses


def release(workload: str, mode: str) -> dict[str, Any]:
    """(c) After a fragmenting workload, free >= 99% of total - live - context."""
    gc.disable()  # the cycle below must wait for release_cache's own pass
    _alloc(1)
    torch.cuda.synchronize()
    free0, total = torch.cuda.mem_get_info()
    context = total - free0 - torch.cuda.memory_reserved()  # CUDA context + other processes
    out: dict[str, Any] = {"workload": workload, "mode": mode, "total": total, "context": context}
    rng = random.Random(7)
    with hm.expandable_segments(mode == "expandable"):
        kept = _training_like(rng) if workload == "training" else _scattered(rng)

        class Cycle:
            pass

        node = Cycle()
        node.self = node  # type: ignore[attr-defined]
        node.tensor = _alloc(1024)  # type: ignore[attr-defined]
        del node
        torch.cuda.synchronize()
        out["before"] = hm.memory_info().as_dict()
        torch.cuda.empty_cache()  # what a plain empty_cache leaves behind
        plain_free = torch.cuda.mem_get_info()[0]
        report = hm.release_cache()
        live = torch.cuda.memory_allocated()
        free = torch.cuda.mem_get_info()[0]
        out["after"] = hm.memory_info().as_dict()
    out.update(
        live=live,
        free=free,
        kept=len(kept),
        ratio=free / (total - live - context),
        plain_ratio=plain_free / (total - live - context),
        report=str(report),
        gc_rounds=report.gc_rounds,
        returned=report.bytes_returned,
    )
    return out


def devices() -> dict[str, Any]:
    """(d) On device 1, releasing never creates a context on device 0."""
    torch.cuda.set_device(1)
    t = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    del t
    out: dict[str, Any] = {"count": torch.cuda.device_count()}
    has = _torch.has_context  # the seam: torch's stubs declare the call from 2.15 on
    out["ctx0_before"] = has(0)
    out["ctx1_before"] = has(1)
    report = hm.release_cache()
    out["released_devices"] = [d.device for d in report.devices]
    out["returned"] = report.bytes_returned
    out["info_device"] = hm.memory_info().device
    all_report = hm.release_cache("all")
    out["all_devices"] = [d.device for d in all_report.devices]
    with hm.expandable_segments(True):
        torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    out["ctx0_after"] = has(0)
    return out


# --------------------------------------------------------------------------- #
# Offload
# --------------------------------------------------------------------------- #


def _mlp(width: int = 2048, depth: int = 12) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers).cuda()


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach() for p in model.parameters()]
    out += list(model.buffers())
    out += [p.grad for p in model.parameters() if p.grad is not None]
    out += [v for st in opt.state.values() for v in st.values() if v.is_cuda]
    return out


def offload_cycles() -> dict[str, Any]:
    """Bitwise state after 10 cycles, identity, memory after offload, non-blocking reload."""
    torch.manual_seed(0)
    elsewhere = torch.randn(16 * MiB // 4, device="cuda")  # live memory not offloaded
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(64, 2048, device="cuda")
    model(x).square().mean().backward()
    opt.step()
    model(x).square().mean().backward()  # gradients present at offload
    reference = [t.detach().cpu().clone() for t in _state(model, opt)]
    ids = [id(p) for p in model.parameters()]
    torch.cuda.synchronize()
    state_bytes = sum(t.untyped_storage().nbytes() for t in _state(model, opt))
    live_elsewhere = torch.cuda.memory_allocated() - state_bytes
    off = hm.Offloader(model, opt)
    after_offload = []
    reports = []
    for _ in range(10):
        reports.append(off.offload())
        after_offload.append(
            {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved()}
        )
        reports.append(off.reload())
    equal = all(torch.equal(a, b.detach().cpu()) for a, b in zip(reference, _state(model, opt)))
    # a reload that does not block: the current stream is ordered after its copies
    with torch.no_grad():
        expected = model(x)
    off.offload()
    off.reload("parameters", non_blocking=True)
    off.reload("buffers", non_blocking=True)
    with torch.no_grad():
        got = model(x)
    non_blocking_equal = torch.equal(expected, got)
    off.reload()
    del elsewhere
    return {
        "state_bytes": state_bytes,
        "live_elsewhere": live_elsewhere,
        "after_offload": after_offload,
        "bitwise_equal": equal,
        "same_parameters": ids == [id(p) for p in model.parameters()],
        "pool_pinned": bool(off._host.chunks)
        and all(chunk.tensor.is_pinned() for chunk in off._host.chunks),
        "host_bytes": off.host_bytes,
        "offload_gbps": [r.gbps for r in reports[2::2]],
        "reload_gbps": [r.gbps for r in reports[3::2]],
        "non_blocking_equal": non_blocking_equal,
        "device": str(off.device),
    }


def _train(offload: bool) -> list[float]:
    torch.manual_seed(1)
    model = _mlp(width=512, depth=6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    off = hm.Offloader(model, opt) if offload else None
    data = torch.randn(20, 32, 512, device="cuda")
    losses = []
    for step in range(20):
        loss = model(data[step]).square().mean()
        loss.backward()
        opt.step()
        if off is not None:
            off.offload()  # parameters, gradients and Adam state leave the GPU
            off.reload()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def offload_training() -> dict[str, Any]:
    """A small model trained 20 steps with and without offload between steps."""
    torch.use_deterministic_algorithms(True)
    return {"plain": _train(False), "offloaded": _train(True)}


def offload_fsdp2() -> dict[str, Any]:
    """FSDP2 (world size 1): DTensor parameters offload their local shard."""
    import os

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = _mlp(width=1024, depth=4)
        fully_shard(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        x = torch.randn(16, 1024, device="cuda")
        model(x).sum().backward()
        opt.step()
        params: list[Any] = list(model.parameters())  # DTensors
        kinds = sorted({type(p).__name__ for p in params})
        reference = [p.to_local().detach().cpu().clone() for p in params]
        off = hm.Offloader(model, opt)
        report = off.offload()
        freed = all(p.to_local().untyped_storage().nbytes() == 0 for p in params)
        off.reload()
        equal = all(torch.equal(a, p.to_local().detach().cpu()) for a, p in zip(reference, params))
        model(x).sum().backward()  # FSDP2 all-gathers from the reloaded shards
        opt.step()
        return {"kinds": kinds, "freed": freed, "equal": equal, "bytes": report.nbytes}
    finally:
        dist.destroy_process_group()


def offload_faults() -> dict[str, Any]:
    """Issue #11: an unfreeable target, a reload out of memory, sparse state, on the GPU."""
    from torch.utils.dlpack import from_dlpack

    out: dict[str, Any] = {}
    torch.manual_seed(0)
    # (1) a parameter imported through DLPack: its storage cannot be freed by torch
    model = _mlp(width=1024, depth=4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, 1024, device="cuda")).sum().backward()
    opt.step()
    owner = torch.randn(1 << 20, device="cuda")
    model.register_parameter(
        "imported", torch.nn.Parameter(from_dlpack(owner.__dlpack__()), requires_grad=False)
    )
    reference = [t.detach().clone() for t in _state(model, opt)]
    off = hm.Offloader(model, opt)
    try:
        off.offload()
        out["unfreeable"] = "offloaded"
    except ValueError as exc:
        out["unfreeable"] = str(exc)
    torch.cuda.synchronize()
    out["unfreeable_intact"] = all(
        torch.equal(a, b.detach()) for a, b in zip(reference, _state(model, opt))
    )
    with torch.no_grad():  # usable, no illegal memory access: nothing was freed
        out["forward_after_refusal"] = bool(
            torch.isfinite(model(torch.randn(8, 1024, device="cuda"))).all()
        )
    del model.imported

    # (2) a reload while the "engine" still holds the memory: retryable, identical
    off = hm.Offloader(model, opt)
    reference = [t.detach().cpu().clone() for t in _state(model, opt)]
    state_bytes = sum(t.untyped_storage().nbytes() for t in _state(model, opt))
    off.offload()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(free - state_bytes // 2, dtype=torch.uint8, device="cuda")
    try:
        off.reload()
        out["reload_oom"] = "reloaded"
    except hm.OffloadError as exc:
        out["reload_oom"] = str(exc)
        out["reload_oom_cause"] = type(exc.__cause__).__name__
        out["still_offloaded"] = sorted(off.offloaded_groups)
    del hog
    torch.cuda.empty_cache()
    off.reload()
    out["retry_equal"] = all(
        torch.equal(a, b.detach().cpu()) for a, b in zip(reference, _state(model, opt))
    )

    # (3) a sparse embedding gradient and SparseAdam's state
    emb = torch.nn.Embedding(100_000, 256, sparse=True).cuda()
    sparse_opt = torch.optim.SparseAdam(emb.parameters(), lr=1e-2)
    emb(torch.randint(0, 100_000, (4096,), device="cuda")).sum().backward()
    sparse_opt.step()  # type: ignore[no-untyped-call]
    emb(torch.randint(0, 100_000, (4096,), device="cuda")).sum().backward()
    grad = emb.weight.grad
    assert grad is not None
    dense = grad.to_dense().cpu()
    weight = emb.weight.detach().cpu().clone()
    sparse_off = hm.Offloader(emb, sparse_opt)
    report = sparse_off.offload()
    out["sparse_freed"] = grad._values().untyped_storage().nbytes() == 0
    sparse_off.reload()
    out["sparse_equal"] = bool(
        torch.equal(grad.to_dense().cpu(), dense) and torch.equal(emb.weight.detach().cpu(), weight)
    )
    sparse_opt.step()  # type: ignore[no-untyped-call]
    out["sparse_bytes"] = report.nbytes
    return out


def compact() -> dict[str, Any]:
    """A model built in classic segments: the cache its weights keep, before and after compact.

    The bench's shape: 24 blocks whose MLP weights are 10.7 MiB (1024 x 2731 fp32),
    each in a classic segment of its own rounded up to 12 MiB, trained one step with
    AdamW, its optimizer state offloaded as the switch does.
    """
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(24):
        blocks += [
            torch.nn.Linear(1024, 2731, bias=False),
            torch.nn.GELU(),
            torch.nn.Linear(2731, 1024, bias=False),
            torch.nn.LayerNorm(1024),
        ]
    model = torch.nn.Sequential(*blocks).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(8, 1024, device="cuda")
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    off = hm.Offloader(opt)
    off.offload()
    hm.release_cache()
    torch.cuda.synchronize()
    cached_before = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    params = list(model.parameters())
    with torch.no_grad():
        expected = model(x)
    copies = [p.detach().cpu().clone() for p in params]
    large = [p for p in params if p.nbytes > MiB]
    kinds_before = {_segment_is_expandable(p) for p in large}
    report = hm.compact(model)
    kinds_after = {_segment_is_expandable(p) for p in large}
    bits_equal = all(torch.equal(c, p.detach().cpu()) for c, p in zip(copies, params))
    hm.release_cache()
    torch.cuda.synchronize()
    cached_after = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    with torch.no_grad():
        got = model(x)
    again = hm.compact(model)  # nothing left in classic segments
    off.reload()
    model(x).square().mean().backward()
    opt.step()  # the optimizer's state is keyed by the same Parameter objects
    stepped = all(torch.isfinite(p).all().item() for p in params)
    return {
        "cached_before": cached_before,
        "cached_after": cached_after,
        "moved": report.moved,
        "moved_bytes": report.nbytes,
        "seconds": report.seconds,
        "report": str(report),
        "kinds_before": sorted(str(k) for k in kinds_before),
        "kinds_after": sorted(str(k) for k in kinds_after),
        "same_parameters": params == list(model.parameters()),
        "bits_equal": bits_equal,
        "stuck": report.stuck,
        "large_count": len(large),
        "forward_equal": bool(torch.equal(expected, got)),
        "again_moved": again.moved,
        "again_kept": again.kept,
        "stepped": bool(stepped),
        "param_count": len(params),
    }


def _outside_allocators() -> int:
    """Device memory in use that this process's allocator does not count (its context)."""
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


def side_streams() -> dict[str, Any]:
    """Issue #25: hybridmem's side streams cost no stream pool; copies on them are ordered."""
    torch.zeros(1, device="cuda")
    a = torch.randn(1024, 1024, device="cuda")
    (a @ a).sum().item()  # the context's usual first growth, before the baseline
    before = _outside_allocators()
    state = [torch.randn(64 * MiB // 4, device="cuda") for _ in range(4)]
    expected = [t.clone() for t in state]
    off = hm.Offloader(state)
    for _ in range(3):
        off.offload()
        off.reload()
    streams = [_torch.new_stream(torch.device("cuda", 0)) for _ in range(3)]
    # one copy through each, ordered after the current stream and back
    copies = []
    for stream, t in zip(streams, state, strict=False):
        _torch.wait_stream(stream, _torch.current_stream(t.device))
        with _torch.stream_scope(stream):
            copies.append(t * 1)
        _torch.wait_stream(_torch.current_stream(t.device), stream)
    ours = _outside_allocators() - before
    equal = all(torch.equal(a, b) for a, b in zip(state, expected, strict=True))
    copied = all(torch.equal(c, t) for c, t in zip(copies, state, strict=False))
    kinds = sorted({type(s).__name__ for s in streams} | {type(off._stream).__name__})
    handles = {s.cuda_stream for s in streams}
    for stream in streams:
        _torch.release_stream(stream)
    # Released streams serve the next owners: no new one is made.
    again = [_torch.new_stream(torch.device("cuda", 0)) for _ in range(3)]
    reused = {s.cuda_stream for s in again} == handles
    off.close()  # its stream too goes back
    start_pool = _outside_allocators()
    torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch's pool, for comparison
    pool = _outside_allocators() - start_pool
    return {
        "ours": ours,
        "pool": pool,
        "equal": equal,
        "copied": copied,
        "kinds": kinds,
        "reused": reused,
    }


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    "compact": compact,
    "segments": segments,
    "settings": settings,
    "release_training_expandable": lambda: release("training", "expandable"),
    "release_training_classic": lambda: release("training", "classic"),
    "release_scattered_expandable": lambda: release("scattered", "expandable"),
    "devices": devices,
    "offload_cycles": offload_cycles,
    "offload_training": offload_training,
    "offload_fsdp2": offload_fsdp2,
    "offload_faults": offload_faults,
    "side_streams": side_streams,
}

if __name__ == "__main__":
    name = sys.argv[1]
    print(json.dumps(SCENARIOS[name](), default=str))
