"""Offloader logic on the CPU: CPU tensors stand in for device tensors.

The seam decides what counts as a device tensor; here CPU tensors do, so the whole
data path (collection, planning, in-place free and restore, groups, errors) runs for
real. Streams are None on the CPU. The GPU tests check the same on an H200.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hybridmem as hm
from hybridmem import _torch
from tests.conftest import fail_resizes


def make_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 4)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(8, 16)).sum().backward()
    optimizer.step()
    model(torch.randn(8, 16)).sum().backward()  # leave gradients in place
    return model, optimizer


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [p.detach().clone() for p in model.parameters()]
    tensors += [b.clone() for b in model.buffers()]
    tensors += [p.grad.clone() for p in model.parameters() if p.grad is not None]
    tensors += [v.clone() for s in optimizer.state.values() for v in s.values()]
    return tensors


def offloaded_model(
    **kw: Any,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[torch.Tensor], hm.Offloader]:
    """:func:`make_model`, its :func:`snapshot`, and an Offloader (``kw``) that offloaded it."""
    model, optimizer = make_model()
    before = snapshot(model, optimizer)
    off = hm.Offloader(model, optimizer, **kw)
    off.offload()
    return model, optimizer, before, off


def assert_bitwise_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_cycles_keep_identity_and_bits(cpu_as_device: list[int]) -> None:
    model, optimizer = make_model()
    params = list(model.parameters())
    before = snapshot(model, optimizer)
    off = hm.Offloader(model, optimizer)
    for _ in range(10):
        report = off.offload()
        assert report.nbytes > 0
        assert all(p.untyped_storage().nbytes() == 0 for p in params)  # device storage freed
        assert all(p.grad is not None and p.grad.untyped_storage().nbytes() == 0 for p in params)
        off.reload()
    assert list(model.parameters()) == params  # the very same Parameter objects
    assert all(a is b for a, b in zip(optimizer.param_groups[0]["params"], params))
    assert_bitwise_equal(before, snapshot(model, optimizer))
    assert cpu_as_device == [cpu_as_device[0]]  # one pinned pool, allocated once, reused


def test_pool_is_sized_to_the_state(cpu_as_device: list[int]) -> None:
    model, optimizer = make_model()
    off = hm.Offloader(model, optimizer)
    assert off.host_bytes == 0
    report = off.offload()
    assert report.host_pool_bytes == off.host_bytes
    assert report.nbytes <= off.host_bytes <= 1.05 * report.nbytes + 512 * report.tensors
    assert report.groups == ("parameters", "buffers", "gradients", "optimizer")
    assert off.offloaded_groups == {"parameters", "buffers", "gradients", "optimizer"}
    off.reload()
    assert off.offloaded_groups == frozenset()


def test_reload_split_by_group(cpu_as_device: list[int]) -> None:
    model, optimizer = make_model()
    before = snapshot(model, optimizer)
    off = hm.Offloader(model, optimizer)
    off.offload()
    first = off.reload("parameters")
    assert first.groups == ("parameters",)
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if v.dim() > 0]
    assert all(v.untyped_storage().nbytes() == 0 for v in state)
    off.reload(["optimizer", "buffers"])
    off.reload()
    assert_bitwise_equal(before, snapshot(model, optimizer))


def test_partial_offload_and_repeat_is_harmless(cpu_as_device: list[int]) -> None:
    model, optimizer = make_model()
    off = hm.Offloader(model, optimizer)
    assert off.offload("optimizer").groups == ("optimizer",)
    assert off.offload("optimizer").nbytes == 0  # already offloaded
    assert off.offload().groups == ("parameters", "buffers", "gradients")
    assert off.reload().nbytes > 0
    assert off.reload().nbytes == 0  # nothing offloaded


def test_shared_storage_is_moved_once_and_stays_shared(cpu_as_device: list[int]) -> None:
    base = torch.arange(32, dtype=torch.float32)
    view = base[8:16]
    tied = torch.nn.Linear(4, 4)
    off = hm.Offloader({"base": base, "view": view}, [tied, tied.weight])
    report = off.offload()
    assert report.tensors == 3  # base+view share one; tied.weight is the module's
    off.reload()
    view.add_(1000)
    assert base[8] == 1008  # still a view of the same storage


def test_grads_drop(cpu_as_device: list[int]) -> None:
    model, optimizer = make_model()
    off = hm.Offloader(model, optimizer, grads="drop")
    report = off.offload()
    assert report.dropped_grad_bytes > 0
    assert "gradients" not in report.groups
    assert all(p.grad is None for p in model.parameters())
    off.reload()
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())


def test_host_limit_fails_before_pinning(cpu_as_device: list[int]) -> None:
    model, optimizer = make_model()
    off = hm.Offloader(model, optimizer, max_host_bytes=1024)
    for _ in range(2):  # refused again, not half-planned, on a retry
        with pytest.raises(ValueError, match="over max_host_bytes=1024"):
            off.offload()
    assert cpu_as_device == []
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())


def test_targets_that_change_shape_are_replanned(
    cpu_as_device: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="hybridmem")
    layer = torch.nn.Linear(8, 8)
    off = hm.Offloader(layer)
    off.offload()
    off.reload()
    with torch.no_grad():
        layer.weight.data = torch.randn(64, 64)  # now bigger
    expected = layer.weight.detach().clone()
    off.offload()
    off.reload()
    assert torch.equal(layer.weight, expected)
    assert len([n for n in cpu_as_device if n > 0]) == 2  # the pool grew once
    assert cpu_as_device.count(-1) == 1  # and the old one was unpinned
    assert any("re-planned" in r.getMessage() for r in caplog.records)


def test_reallocated_while_offloaded_is_refused(cpu_as_device: list[int]) -> None:
    layer = torch.nn.Linear(8, 8)
    off = hm.Offloader(layer)
    off.offload()
    layer.weight.untyped_storage().resize_(256)  # someone touched it
    with pytest.raises(RuntimeError, match=r"reallocated while offloaded.*refusing"):
        off.reload()


def test_close_and_garbage_collection_unpin_once(cpu_as_device: list[int]) -> None:
    layer = torch.nn.Linear(8, 8)
    off = hm.Offloader(layer)
    off.offload()
    with pytest.raises(RuntimeError, match="reload"):
        off.close()
    off.reload()
    off.close()
    off.close()
    assert off.host_bytes == 0
    assert cpu_as_device.count(-1) == 1
    # a closed Offloader pins a new pool on its next offload, for the same targets
    before = layer.weight.detach().clone()
    off.offload()
    assert off.host_bytes > 0
    off.reload()
    assert torch.equal(layer.weight, before)
    off.close()
    assert cpu_as_device.count(-1) == 2
    other = hm.Offloader(layer)
    other.offload()
    other.reload()
    del other
    gc.collect()
    assert cpu_as_device.count(-1) == 3


def test_the_pool_is_exactly_sized_huge_page_memory_pinned_once(
    cpu_as_device: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue #25: huge pages pin twice as fast; the size is exact, not a power of two."""
    import mmap

    from hybridmem._platform.host_memory import huge_page_region
    from hybridmem.memory import host_pool

    regions: list[mmap.mmap] = []

    def region(nbytes: int) -> mmap.mmap | None:
        made = offload_region(nbytes)
        assert made is not None
        regions.append(made)
        return made

    offload_region = huge_page_region
    monkeypatch.setattr(host_pool, "huge_page_region", region)
    model, optimizer = make_model()
    before = snapshot(model, optimizer)
    off = hm.Offloader(model, optimizer)
    for _ in range(3):
        off.offload()
        off.reload()
    assert len(regions) == 1  # one pool, reused
    assert cpu_as_device == [off.host_bytes] == [len(regions[0])]  # pinned once, all of it
    assert_bitwise_equal(before, snapshot(model, optimizer))
    off.close()
    assert cpu_as_device.count(-1) == 1  # unpinned before it is unmapped
    # where no anonymous mapping can be made, an ordinary allocation serves
    monkeypatch.setattr(host_pool, "huge_page_region", lambda nbytes: None)
    other = hm.Offloader(model, optimizer)
    other.offload()
    other.reload()
    assert_bitwise_equal(before, snapshot(model, optimizer))
    other.close()


def test_huge_page_region_is_a_writable_mapping_of_the_size_asked() -> None:
    from hybridmem._platform.host_memory import huge_page_region

    region = huge_page_region(3 << 20)
    if region is None:
        pytest.skip("no anonymous mappings on this platform")
    tensor = torch.frombuffer(region, dtype=torch.uint8)
    assert tensor.numel() == 3 << 20
    tensor.fill_(5)
    assert region[123] == 5
    del tensor


def test_mixed_devices_are_an_error(cpu_as_device: list[int]) -> None:
    off = hm.Offloader(torch.zeros(4), torch.zeros(4, device="meta"))
    with pytest.raises(ValueError, match=r"several devices.*Use one Offloader per device"):
        off.offload()


def test_targets_that_moved_device_are_an_error(cpu_as_device: list[int]) -> None:
    holder = {"w": torch.zeros(4)}
    off = hm.Offloader(holder)
    off.offload()
    off.reload()
    holder["w"] = torch.zeros(4, device="meta")  # the dict is the target: it now holds another
    with pytest.raises(ValueError, match=r"made for cpu, but targets\[0\]\['w'\] is on meta"):
        off.offload()


def test_offloaded_context_and_decorator(cpu_as_device: list[int]) -> None:
    model, optimizer = make_model()
    before = snapshot(model, optimizer)
    weight = next(model.parameters())

    with hm.offloaded(model, optimizer) as ctx:
        assert weight.untyped_storage().nbytes() == 0
        with ctx:  # nested: stays offloaded until the outermost exit
            pass
        assert weight.untyped_storage().nbytes() == 0
    assert weight.untyped_storage().nbytes() > 0

    with pytest.raises(KeyError), hm.offloaded(model):
        raise KeyError("rollout failed")
    assert weight.untyped_storage().nbytes() > 0  # reloaded on the error too

    scope = hm.offloaded(model, optimizer, groups="optimizer")

    @scope
    def rollout() -> bool:
        state = next(iter(optimizer.state.values()))["exp_avg"]
        return state.untyped_storage().nbytes() == 0 and weight.untyped_storage().nbytes() > 0

    @scope
    async def arollout() -> bool:
        await asyncio.sleep(0)
        return weight.untyped_storage().nbytes() > 0

    assert rollout()
    assert rollout()
    assert asyncio.run(arollout())
    assert scope.offloader.offloaded_groups == frozenset()
    assert_bitwise_equal(before, snapshot(model, optimizer))
    # the decorated calls shared one Offloader: each `hm.offloaded` above pinned once
    assert len([n for n in cpu_as_device if n > 0]) == 3


def test_existing_offloader_can_be_scoped(cpu_as_device: list[int]) -> None:
    off = hm.Offloader(torch.nn.Linear(4, 4))
    with hm.offloaded(off) as ctx:
        assert ctx.offloader is off
        assert off.offloaded_groups == {"parameters"}


def test_cpu_only_is_a_clear_noop(caplog: pytest.LogCaptureFixture) -> None:
    if _torch.cuda_available():
        pytest.skip("CPU-only behaviour")
    caplog.set_level(logging.INFO, logger="hybridmem")
    model, optimizer = make_model()
    off = hm.Offloader(model, optimizer)
    report = off.offload()
    assert report.nbytes == 0
    assert report.device == "none"
    assert off.host_bytes == 0
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())
    assert any("no target tensor is on a GPU" in r.getMessage() for r in caplog.records)
    assert off.reload().nbytes == 0


def test_kill_switch(cpu_as_device: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDMEM_DISABLE", "1")
    layer = torch.nn.Linear(4, 4)
    assert hm.Offloader(layer).offload().nbytes == 0
    assert layer.weight.untyped_storage().nbytes() > 0


def test_report_text(cpu_as_device: list[int]) -> None:
    report = hm.Offloader(torch.zeros(1 << 20)).offload()
    text = str(report)
    assert text.startswith("offload tensors on cpu: 4.00 MiB in 1 storages")
    assert report.gbps > 0


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: hm.Offloader(), ValueError, "at least one target"),
        (lambda: hm.Offloader([torch.zeros(1), "x"]), TypeError, r"targets\[0\]\[1\] is a str"),
        (lambda: hm.Offloader({"a": 3}), TypeError, r"targets\[0\]\['a'\] is a int"),
        (lambda: hm.Offloader(torch.zeros(1), grads="keep_some"), ValueError, "'keep' or 'drop'"),  # type: ignore[arg-type]
        (lambda: hm.Offloader(torch.zeros(1), max_host_bytes=0), ValueError, "positive int"),
        (lambda: hm.Offloader(torch.zeros(1), max_host_bytes=True), ValueError, "positive int"),
        (lambda: hm.Offloader(torch.zeros(1), pin_memory=1), TypeError, "pin_memory"),  # type: ignore[arg-type]
        (lambda: hm.Offloader(torch.zeros(1), device="cpu"), ValueError, "one CUDA device"),
        (lambda: hm.Offloader(torch.zeros(1), device="cuda"), ValueError, "one CUDA device"),
        (lambda: hm.Offloader(torch.zeros(1), device=True), TypeError, "CUDA device"),
        (lambda: hm.Offloader(torch.zeros(1)).offload("weights"), ValueError, "unknown group"),
        (lambda: hm.Offloader(torch.zeros(1)).offload(release_cache=1), TypeError, "release"),  # type: ignore[arg-type]
        (lambda: hm.Offloader(torch.zeros(1)).reload(non_blocking=None), TypeError, "non_blocking"),  # type: ignore[arg-type]
        (lambda: hm.offloaded(torch.zeros(1), groups=["parameters", "kv"]), ValueError, "unknown"),
    ],
)
def test_bad_input(make: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        make()  # type: ignore[operator]


# --------------------------------------------------------------------------- #
# Later offloads copy while walking the targets (when they match the plan)
# --------------------------------------------------------------------------- #


def count_full_copies(monkeypatch: pytest.MonkeyPatch, off: hm.Offloader) -> list[bool]:
    """Record each use of the plan-then-copy path (``_copy`` to the host)."""
    calls: list[bool] = []
    original = off._copy

    def spy(slots: object, *, to_host: bool, **kw: bool) -> object:
        if to_host:
            calls.append(True)
        return original(slots, to_host=to_host, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(off, "_copy", spy)
    return calls


def test_later_offloads_stream_their_copies(
    cpu_as_device: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = make_model()
    off = hm.Offloader(model, optimizer)
    full = count_full_copies(monkeypatch, off)
    for _cycle in range(4):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # new values every cycle: a stale pool would show
        expected = snapshot(model, optimizer)
        off.offload()
        off.reload()
        assert_bitwise_equal(expected, snapshot(model, optimizer))
        assert len(full) == 1  # planned and copied once; the rest streamed


def test_partial_offload_streams_only_the_wanted_groups(
    cpu_as_device: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = make_model()
    off = hm.Offloader(model, optimizer)
    off.offload()
    off.reload()
    full = count_full_copies(monkeypatch, off)
    expected = snapshot(model, optimizer)
    report = off.offload("optimizer")
    assert full == []
    assert report.groups == ("optimizer",)
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())  # untouched
    off.offload("parameters")  # something is offloaded now: the planned path
    assert full == [True]
    off.reload()
    assert_bitwise_equal(expected, snapshot(model, optimizer))


@pytest.mark.parametrize("change", ["replaced", "added", "resized", "grown_in_place"])
def test_changed_targets_stop_the_stream_and_replan(
    cpu_as_device: list[int], monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    model, optimizer = make_model()
    extra = {"w": torch.arange(64, dtype=torch.float32)}
    off = hm.Offloader(model, optimizer, extra)
    off.offload()
    off.reload()
    full = count_full_copies(monkeypatch, off)
    if change == "replaced":  # same size, another storage
        state = next(iter(optimizer.state.values()))
        state["exp_avg"] = state["exp_avg"].clone() + 5
    elif change == "added":
        extra["v"] = torch.full((32,), 7.0)
    elif change == "resized":
        extra["w"] = torch.arange(128, dtype=torch.float32)
    else:  # the same storage, larger
        extra["w"].untyped_storage().resize_(extra["w"].nbytes * 2)
    expected = snapshot(model, optimizer) + [t.clone() for t in extra.values()]
    off.offload()
    assert full == [True]  # fell back to planning and copying everything
    off.reload()
    assert_bitwise_equal(expected, snapshot(model, optimizer) + list(extra.values()))


# --------------------------------------------------------------------------- #
# Issue #11: transactional offload and reload, sparse state, injected faults
# --------------------------------------------------------------------------- #


def _frozen_tensor(values: torch.Tensor) -> torch.Tensor:
    """A tensor over memory this process does not own (as DLPack/CUDA IPC imports are)."""
    raw = bytearray(values.numpy().tobytes())
    return torch.frombuffer(raw, dtype=values.dtype).view(values.shape)


def test_a_target_whose_memory_cannot_be_freed_is_refused_before_anything_is_freed(
    cpu_as_device: list[int],
) -> None:
    model, optimizer = make_model()
    before = snapshot(model, optimizer)
    imported = torch.nn.Parameter(_frozen_tensor(torch.arange(8.0)), requires_grad=False)
    model.register_parameter("imported", imported)  # walked last: everything else first
    off = hm.Offloader(model, optimizer)
    with pytest.raises(ValueError, match=r"cannot free targets\[0\]\.imported.*nothing was"):
        off.offload()
    assert off.offloaded_groups == frozenset()
    model.imported = None  # type: ignore[assignment]
    assert_bitwise_equal(before, snapshot(model, optimizer))  # every other target intact


def test_a_free_that_fails_midway_puts_back_what_it_freed(
    cpu_as_device: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = make_model()
    before = snapshot(model, optimizer)
    off = hm.Offloader(model, optimizer)
    real = fail_resizes(monkeypatch, frees=(4,))
    with pytest.raises(hm.OffloadError, match="were put back from the host pool") as info:
        off.offload()
    assert info.value.offloaded == frozenset()
    assert off.offloaded_groups == frozenset()
    assert_bitwise_equal(before, snapshot(model, optimizer))
    monkeypatch.setattr(_torch, "resize_storage", real)
    off.offload()  # and the Offloader still works
    off.reload()
    assert_bitwise_equal(before, snapshot(model, optimizer))


def test_a_free_and_its_put_back_that_both_fail_leave_the_freed_retrievable(
    cpu_as_device: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The double fault: freeing fails midway, then reallocating what was freed
    # fails too. Those storages must count as offloaded, or reload() finds nothing
    # to bring back and close() unpins the only copy of their data.
    model, optimizer = make_model()
    before = snapshot(model, optimizer)
    off = hm.Offloader(model, optimizer)
    real = fail_resizes(monkeypatch, frees=(4,), allocations=(2,))
    with pytest.raises(hm.OffloadError, match=r"stay offloaded.*reload\(\) brings them") as info:
        off.offload()
    first_three = list(model.parameters())[:3]  # the walk's order: parameters first
    assert info.value.offloaded == {"parameters"} == off.offloaded_groups
    assert [p.untyped_storage().nbytes() == 0 for p in first_three] == [True, True, True]
    assert all(p.untyped_storage().nbytes() > 0 for p in list(model.parameters())[3:])
    with pytest.raises(RuntimeError, match="cannot close"):
        off.close()  # the pool holds their only copy
    monkeypatch.setattr(_torch, "resize_storage", real)
    assert off.reload_bytes() > 0
    report = off.reload()
    assert report.tensors == 3
    assert off.offloaded_groups == frozenset()
    assert_bitwise_equal(before, snapshot(model, optimizer))
    off.offload()  # and the Offloader works as before
    off.reload()
    assert_bitwise_equal(before, snapshot(model, optimizer))
    off.close()


def test_a_reload_that_runs_out_of_memory_is_retryable_with_identical_data(
    cpu_as_device: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = make_model()
    before = snapshot(model, optimizer)
    off = hm.Offloader(model, optimizer)
    off.offload()
    real = _torch.resize_storage
    budget = {"left": 3}  # the engine still holds the memory: the fourth allocation fails

    def tight(storage: torch.UntypedStorage, nbytes: int) -> None:
        if nbytes:
            if budget["left"] == 0:
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            budget["left"] -= 1
        real(storage, nbytes)

    monkeypatch.setattr(_torch, "resize_storage", tight)
    with pytest.raises(hm.OffloadError, match=r"nothing was reloaded.*again") as info:
        off.reload()
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
    assert info.value.offloaded == {"parameters", "buffers", "gradients", "optimizer"}
    params = list(model.parameters())
    assert all(p.untyped_storage().nbytes() == 0 for p in params)  # all still offloaded
    budget["left"] = 10_000  # the engine let go
    off.reload()
    assert_bitwise_equal(before, snapshot(model, optimizer))


def test_sparse_embedding_gradients_and_sparse_adam_state_round_trip(
    cpu_as_device: list[int],
) -> None:
    torch.manual_seed(0)
    emb = torch.nn.Embedding(50, 8, sparse=True)
    opt = torch.optim.SparseAdam(emb.parameters(), lr=0.1)
    emb(torch.tensor([1, 2, 3, 2])).sum().backward()
    opt.step()  # type: ignore[no-untyped-call]
    emb(torch.tensor([4, 4, 7])).sum().backward()  # an uncoalesced sparse gradient
    grad = emb.weight.grad
    assert grad is not None
    assert grad.layout == torch.sparse_coo
    dense_before = grad.to_dense().clone()
    weight_before = emb.weight.detach().clone()
    state_before = [
        v.clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    ]
    off = hm.Offloader(emb, opt)
    report = off.offload()
    assert report.tensors >= 4  # weight, the gradient's indices and values, Adam's state
    assert grad._values().untyped_storage().nbytes() == 0
    off.reload()
    assert emb.weight.grad is grad
    assert torch.equal(grad.to_dense(), dense_before)
    assert torch.equal(emb.weight.detach(), weight_before)
    state_after = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    assert_bitwise_equal(state_before, state_after)
    opt.step()  # type: ignore[no-untyped-call]  # and the optimizer carries on


def test_a_tensor_without_a_storage_is_refused_before_anything_is_freed(
    cpu_as_device: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = make_model()
    before = snapshot(model, optimizer)
    odd = torch.ones(4)
    real = _torch.dense_parts

    def parts(tensor: torch.Tensor) -> list[torch.Tensor]:
        if tensor is odd:
            raise TypeError("tensors with layout torch._mkldnn cannot be offloaded in place")
        return real(tensor)

    monkeypatch.setattr(_torch, "dense_parts", parts)
    off = hm.Offloader(model, optimizer, {"odd": odd})
    with pytest.raises(TypeError, match=r"cannot offload targets\[2\]\['odd'\].*nothing was"):
        off.offload()
    assert off.offloaded_groups == frozenset()
    assert_bitwise_equal(before, snapshot(model, optimizer))


# A failure may be injected at any step of an offload or a reload; afterwards the
# data is identical, or still retrievable: a reload without faults restores it bit
# for bit. No call blocks (there is nothing to wait for on the CPU).
_FAULT_POINTS = [
    "resize_storage",
    "synchronize_stream",
    "wait_stream",
    "copy",
    "copy_by_kernel",
    "empty_cache",
]


def fault_plans(
    actions: Sequence[str], points: Sequence[str]
) -> st.SearchStrategy[list[tuple[str, str, set[int]]]]:
    """Plans for :func:`run_fault_plan`: up to six actions, each with its seam point's faults."""
    return st.lists(
        st.tuples(
            st.sampled_from(list(actions)),
            st.sampled_from(list(points)),
            # one fault, or several in one call (a failure, then its clean-up failing)
            st.sets(st.integers(0, 12), min_size=1, max_size=3),
        ),
        min_size=1,
        max_size=6,
    )


@given(
    fault_plans(
        [
            "offload",
            "reload",
            "offload_params",
            "reload_optimizer",
            "reload_by_kernel",
            "reload_head_then_tail",  # the switch's early reload
        ],
        _FAULT_POINTS,
    )
)
@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_injected_faults_never_lose_data(
    cpu_as_device: list[int],
    monkeypatch: pytest.MonkeyPatch,
    plan: list[tuple[str, str, set[int]]],
) -> None:
    run_fault_plan(monkeypatch, plan)


def run_fault_plan(monkeypatch: pytest.MonkeyPatch, plan: list[tuple[str, str, set[int]]]) -> None:
    """Run ``plan`` (action, seam point, which calls fail) and check nothing is lost."""
    # A reload by kernel reads the pool's "device mapping": on the CPU, the pool.
    monkeypatch.setattr(_torch, "host_device_view", lambda host, device: host)
    model, optimizer = make_model()
    before = snapshot(model, optimizer)
    off = hm.Offloader(model, optimizer)
    for action, point, after in plan:
        faults = _Faults(point, after)
        with faults.installed(off):
            try:
                if action == "offload":
                    off.offload()
                elif action == "offload_params":
                    off.offload("parameters")
                elif action == "offload_in_flight":  # start_offload, then finish
                    off.start_offload().finish()
                elif action == "offload_cancelled":
                    off.start_offload().cancel()
                elif action == "reload":
                    off.reload()
                elif action == "reload_by_kernel":
                    off.reload(by="kernel")
                elif action == "reload_head_then_tail":
                    off.reload(by="copy_engine", max_bytes=max(1, off.host_bytes // 2))
                    off.reload(by="kernel", non_blocking=True)
                else:
                    off.reload("optimizer")
            except (hm.OffloadError, _Injected):
                pass
        _check_retrievable(off, model, optimizer, before)
    off.reload()
    assert_bitwise_equal(before, snapshot(model, optimizer))


class _Injected(RuntimeError):
    pass


class _Faults:
    """Make the calls numbered in ``after`` (from 0) of one seam function, or of a copy, fail."""

    def __init__(self, point: str, after: set[int]) -> None:
        self.point, self.after, self.calls = point, after, 0

    def _maybe_fail(self) -> None:
        self.calls += 1
        if self.calls - 1 in self.after:
            raise _Injected(f"injected fault in {self.point}")

    def installed(self, off: hm.Offloader) -> Any:
        import contextlib

        @contextlib.contextmanager
        def patch() -> Iterator[None]:
            if self.point == "copy":
                pool = off._host  # the pool's copies (hybridmem.memory.host_pool)
                real_copy = pool.copy_one

                def copy(slot: Any, device: Any, *, to_host: bool, by_kernel: bool = False) -> None:
                    self._maybe_fail()
                    real_copy(slot, device, to_host=to_host, by_kernel=by_kernel)

                pool.copy_one = copy  # type: ignore[method-assign]
                try:
                    yield
                finally:
                    del pool.copy_one
                return
            real = getattr(_torch, self.point)

            def wrapped(*args: Any, **kwargs: Any) -> Any:
                self._maybe_fail()
                return real(*args, **kwargs)

            setattr(_torch, self.point, wrapped)
            try:
                yield
            finally:
                setattr(_torch, self.point, real)

        return patch()


def _check_retrievable(
    off: hm.Offloader,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    before: list[torch.Tensor],
) -> None:
    """Every tensor is resident with its data, or freed and its group reported offloaded.

    A group is offloaded whole, except after a double fault (an offload failed and
    so did putting back what it freed): then only those storages are. After a
    triple fault (a reload failed and so did freeing again what it had allocated)
    a storage may stay allocated but unfilled: its group is reported offloaded and
    the next reload fills it.
    """
    offloaded = off.offloaded_groups
    unfilled = {slot.key for slot in off._slots if slot.refill}
    now: list[tuple[str, torch.Tensor]] = [("parameters", p.detach()) for p in model.parameters()]
    now += [("buffers", b) for b in model.buffers()]
    now += [("gradients", p.grad) for p in model.parameters() if p.grad is not None]
    now += [("optimizer", v) for s in optimizer.state.values() for v in s.values()]
    assert len(now) == len(before)
    for (group, tensor), old in zip(now, before):
        storage = tensor.untyped_storage()
        # freed (never read it: no memory), or allocated by a failed reload, unfilled
        if storage.nbytes() == 0 or _torch.storage_key(storage) in unfilled:
            assert group in offloaded
        else:
            assert torch.equal(tensor, old), group
    if not offloaded:
        assert_bitwise_equal(before, snapshot(model, optimizer))
