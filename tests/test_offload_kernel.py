"""A reload done by kernels reading the pinned pool's device mapping (decision 80).

On the CPU, the "device mapping" of the pool is the pool itself (``cpu_mapping``):
the real :func:`hybridmem._torch.copy_by_kernel` runs on CPU tensors, so its word and
tail split is checked here; its rate and the mapping are the GPU tests' and the
benchmark's (``benchmarks/reload_by_kernel.py``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hybridmem as hm
from hybridmem import _torch
from hybridmem._platform import cuda_driver
from hybridmem._torch import mapped, tensors
from hybridmem.engine import switch_reload
from hybridmem.engine.reports import StageReport, SwitchReport
from hybridmem.engine.switch_reload import tail_bytes
from hybridmem.memory.offload_report import OffloadReport
from hybridmem.observe.memory import MemoryInfo
from tests.conftest import FakeTorch
from tests.test_offload import assert_bitwise_equal, make_model, offloaded_model, snapshot
from tests.test_switch import FakeOffloader, FakeVLLM


def test_a_reload_by_kernel_copies_every_storage_bit_for_bit(cpu_mapping: list[int]) -> None:
    model, optimizer = make_model()
    before = snapshot(model, optimizer)
    off = hm.Offloader(model, optimizer)
    for _ in range(3):
        off.offload()
        assert cpu_mapping == []  # offloads use the copy engines
        off.reload(by="kernel")
        assert len(cpu_mapping) == len(off._slots)  # every storage, by kernel
        assert_bitwise_equal(before, snapshot(model, optimizer))
        cpu_mapping.clear()
    off.offload()
    off.reload()  # the default stays the copy engines
    assert cpu_mapping == []
    assert_bitwise_equal(before, snapshot(model, optimizer))


def test_a_non_blocking_reload_by_kernel_and_groups(cpu_mapping: list[int]) -> None:
    model, optimizer, before, off = offloaded_model()
    off.reload("optimizer", by="kernel", non_blocking=True)
    assert off.offloaded_groups == {"parameters", "buffers", "gradients"}
    off.reload(by="kernel")
    assert not off.offloaded_groups
    assert_bitwise_equal(before, snapshot(model, optimizer))


def test_without_a_device_mapping_the_copy_engines_reload_and_say_so_once(
    cpu_as_device: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    # No CUDA here: the real host_device_view finds no mapping.
    model, optimizer = make_model()
    before = snapshot(model, optimizer)
    off = hm.Offloader(model, optimizer)
    with caplog.at_level(logging.INFO, logger="hybridmem"):
        for _ in range(2):
            off.offload()
            off.reload(by="kernel")
    said = [r.getMessage() for r in caplog.records if "no device mapping" in r.getMessage()]
    assert len(said) <= 1  # info_once: at most once per process
    assert_bitwise_equal(before, snapshot(model, optimizer))


def test_a_pageable_pool_is_never_read_by_kernels(
    cpu_mapping: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer, before, off = offloaded_model(pin_memory=False)
    off.reload(by="kernel")
    assert cpu_mapping == []  # a kernel cannot read pageable memory
    assert_bitwise_equal(before, snapshot(model, optimizer))


def test_the_device_view_never_outlives_its_pool(cpu_mapping: list[int]) -> None:
    layer = torch.nn.Linear(8, 8)
    off = hm.Offloader(layer)
    off.offload()
    off.reload(by="kernel")
    (chunk,) = off._host.chunks
    assert chunk.views  # looked for once, kept
    off.close()
    assert chunk.views == {}  # dropped before the pool is unpinned
    assert off._host.chunks == []
    off.offload()  # a new pool: its own view
    off.reload(by="kernel")
    (chunk,) = off._host.chunks
    view = next(iter(chunk.views.values()))
    assert view is chunk.tensor


@pytest.mark.parametrize("by", ["kernels", "engine", "", None, 1])
def test_a_bad_way_is_refused_before_anything_moves(cpu_as_device: list[int], by: Any) -> None:
    model, optimizer = make_model()
    off = hm.Offloader(model, optimizer)
    off.offload()
    with pytest.raises(ValueError, match=r"by must be one of 'copy_engine', 'kernel', got"):
        off.reload(by=by)
    assert off.offloaded_groups == {"parameters", "buffers", "gradients", "optimizer"}
    off.reload()


def test_a_kernel_copy_that_fails_reloads_nothing_and_a_retry_works(
    cpu_mapping: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer, before, off = offloaded_model()
    real = _torch.copy_by_kernel
    calls = {"n": 0}

    def failing(dst: torch.Tensor, src: torch.Tensor) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("CUDA error: an illegal memory access (injected)")
        real(dst, src)

    monkeypatch.setattr(_torch, "copy_by_kernel", failing)
    with pytest.raises(hm.OffloadError, match="nothing was reloaded"):
        off.reload(by="kernel")
    assert off.offloaded_groups == {"parameters", "buffers", "gradients", "optimizer"}
    off.reload(by="kernel")
    assert_bitwise_equal(before, snapshot(model, optimizer))


@given(
    size=st.integers(1, 300),
    dst_at=st.integers(0, 9),
    src_at=st.integers(0, 9),
)
@settings(max_examples=80, deadline=None)
def test_copy_by_kernel_copies_any_length_at_any_alignment(
    size: int, dst_at: int, src_at: int
) -> None:
    src_base = torch.randint(0, 256, (size + 16,), dtype=torch.uint8)
    dst_base = torch.zeros(size + 16, dtype=torch.uint8)
    src, dst = src_base[src_at : src_at + size], dst_base[dst_at : dst_at + size]
    mapped.copy_by_kernel(dst, src)
    assert torch.equal(dst, src)
    assert not dst_base[:dst_at].any()
    assert not dst_base[dst_at + size :].any()


@pytest.mark.parametrize(
    ("dst", "src"),
    [
        (torch.zeros(8, dtype=torch.uint8), torch.zeros(9, dtype=torch.uint8)),
        (torch.zeros(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.int8)),
    ],
)
def test_copy_by_kernel_refuses_mismatched_ends(dst: torch.Tensor, src: torch.Tensor) -> None:
    with pytest.raises(ValueError, match=r"copy_by_kernel: dst .* must match"):
        mapped.copy_by_kernel(dst, src)


def test_host_device_view_is_none_without_cuda_or_a_mapping(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    host = torch.zeros(64, dtype=torch.uint8)
    cuda = torch.device("cuda", 0)
    assert mapped.host_device_view(host, cuda) is None  # no CUDA here
    monkeypatch.setattr(mapped, "cuda_available", lambda: True)
    monkeypatch.setattr(cuda_driver, "host_device_pointer", lambda address: None)
    assert mapped.host_device_view(host, cuda) is None  # the driver refused
    assert mapped.host_device_view(host, torch.device("cpu")) is None
    assert mapped.host_device_view(host[::2], cuda) is None  # not contiguous
    made: list[tuple[int, int, int]] = []

    def memory(address: int, nbytes: int, device: int, on_free: Any) -> torch.Tensor:
        made.append((address, nbytes, device))
        return host

    monkeypatch.setattr(cuda_driver, "host_device_pointer", lambda address: address + 4096)
    monkeypatch.setattr(mapped, "tensor_from_memory", memory)
    assert mapped.host_device_view(host, torch.device("cuda", 3)) is host
    assert made == [(host.data_ptr() + 4096, 64, 3)]


def test_host_device_pointer_is_none_without_the_driver() -> None:
    if cuda_driver.libcuda() is not None:
        pytest.skip("this machine has a CUDA driver")
    assert cuda_driver.host_device_pointer(4096) is None


@pytest.mark.parametrize(("mapped_flag", "flags"), [(False, 1), (True, 3)])
def test_the_pool_is_registered_mapped(
    monkeypatch: pytest.MonkeyPatch, mapped_flag: bool, flags: int
) -> None:
    seen: list[int] = []

    class Cudart:
        @staticmethod
        def cudaHostRegister(address: int, nbytes: int, flag: int) -> int:
            seen.append(flag)
            return 0

    monkeypatch.setattr(tensors, "cuda_available", lambda: True)
    monkeypatch.setattr(tensors, "_CUDART", lambda: Cudart)
    assert tensors.pin_host_tensor(torch.zeros(8), mapped=mapped_flag)
    assert seen == [flags]


def test_the_offloaders_pool_asks_for_a_mapping(
    monkeypatch: pytest.MonkeyPatch, cpu_as_device: list[int]
) -> None:
    asked: list[bool] = []

    def pin(tensor: torch.Tensor, *, mapped: bool = False) -> bool:
        asked.append(mapped)
        return True

    monkeypatch.setattr(_torch, "pin_host_tensor", pin)
    off = hm.Offloader(torch.nn.Linear(4, 4))
    off.offload()
    off.reload()
    assert asked == [True]


# --------------------------------------------------------------------------- #
# The switch reloads by kernel unless told otherwise, on both of its paths
# --------------------------------------------------------------------------- #
POOL = 3 << 30  # the recording offloader's pool


def _switch(fake: FakeTorch, **kw: Any) -> tuple[hm.HybridSwitch, list[str], list[dict[str, Any]]]:
    log: list[str] = []
    calls: list[dict[str, Any]] = []  # each reload's keywords, as the switch passed them

    class Recording(FakeOffloader):
        host_bytes = POOL

        def reload(self, groups: Any = None, **kwargs: Any) -> Any:
            calls.append(kwargs)
            return super().reload(groups, **kwargs)

        def start_reload(self, groups: Any = None, **kwargs: Any) -> Any:
            calls.append({"feed": True, **kwargs})
            return super().start_reload(groups, **kwargs)

    switch = hm.HybridSwitch(
        hm.VLLMEngine(FakeVLLM(log, fake)),
        "vllm",
        Recording(log, need=1 << 30),
        barrier=None,
        confirm_timeout_s=0.0,
        **kw,
    )
    return switch, log, calls


@pytest.mark.parametrize("by", [None, "kernel", "copy_engine"])
def test_after_the_sleep_the_switch_reloads_the_way_it_is_told(
    fake_gpu: FakeTorch, by: str | None
) -> None:
    kw: dict[str, Any] = {"reload_early": False}
    if by is not None:
        kw["reload_by"] = by
    switch, log, calls = _switch(fake_gpu, **kw)
    with switch.rollout():
        pass
    assert calls == [{"by": by or "kernel"}]
    assert switch.reload_by == (by or "kernel")
    assert log[-2:] == ["sleep:1", "reload"]


@pytest.fixture
def quarter_tail(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """The tail is a quarter of the pool once a cycle was timed; each call's arguments."""
    asked: list[tuple[Any, ...]] = []

    def tail(reports: list[SwitchReport], host_bytes: int, offload_s: float | None = None) -> int:
        asked.append((len(reports), host_bytes))
        timed = any(r.direction == "to_trainer" for r in reports)  # a sleep was timed
        return host_bytes // 4 if timed else 0

    monkeypatch.setattr(switch_reload, "tail_bytes", tail)
    return asked


@pytest.mark.parametrize("by", ["kernel", "copy_engine"])
def test_an_early_reload_waits_for_a_head_and_queues_a_tail_for_the_sleep_by_copy_engine(
    fake_gpu: FakeTorch, quarter_tail: list[tuple[Any, ...]], by: str
) -> None:
    switch, log, calls = _switch(fake_gpu, reload_by=by)
    with switch.rollout():
        pass
    # no sleep timed yet: all of it first, waited for, then the sleep
    assert calls == [{"by": "copy_engine", "max_bytes": POOL}]
    assert log[-2:] == ["reload:head", "sleep:1"]
    calls.clear()
    with switch.rollout():
        pass
    # sized from the reports so far (cycle 1's two and cycle 2's to_rollout) and the pool
    assert quarter_tail == [(1, POOL), (3, POOL)]
    # the head by copy engine whatever reload_by says (decision 81), then the feed
    # (copy engine too), which the reload stage finishes the way it is told (decision 94)
    assert calls == [{"by": "copy_engine", "max_bytes": POOL - POOL // 4}, {"feed": True}]
    assert log[-4:] == ["reload:head", "reload:queued", "sleep:1", f"reload:finish:{by}"]
    stages = [s.name for s in switch.reports[-1].stages]
    assert stages[:2] == ["reload_early", "sleep"]  # the sleep's time is the engine's own


@pytest.mark.parametrize("copy_seconds", [0.25, None])
def test_the_tail_is_sized_by_the_copies_own_time_not_the_reports_wall_time(
    fake_gpu: FakeTorch, monkeypatch: pytest.MonkeyPatch, copy_seconds: float | None
) -> None:
    """Decision 90: the wall time ran on to a landing after the KV wake."""
    asked: list[float | None] = []

    def tail(reports: list[SwitchReport], host_bytes: int, offload_s: float | None = None) -> int:
        asked.append(offload_s)
        return 0

    real = OffloadReport.of

    def timed(*args: Any, **kwargs: Any) -> OffloadReport:
        return dataclasses.replace(real(*args, **kwargs), seconds=1.0, copy_seconds=copy_seconds)

    monkeypatch.setattr(switch_reload, "tail_bytes", tail)
    monkeypatch.setattr(OffloadReport, "of", timed)
    switch, _, _ = _switch(fake_gpu)
    for _ in range(2):
        with switch.rollout():
            pass
    assert asked == [copy_seconds or 1.0] * 2  # each to_trainer: the last offload's


def test_a_refused_tail_leaves_the_rest_for_after_the_sleep(
    fake_gpu: FakeTorch,
    quarter_tail: list[tuple[Any, ...]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="hybridmem")
    switch, log, _ = _switch(fake_gpu)
    offloader = switch.offloader
    assert isinstance(offloader, FakeOffloader)
    with switch.rollout():
        pass

    def refuse_feed(self: FakeOffloader, groups: Any = None, **kw: Any) -> Any:
        log.append("reload:refused")
        raise hm.OffloadError("reload feed could not allocate optimizer (OutOfMemoryError)")

    type(offloader).start_reload = refuse_feed  # type: ignore[method-assign]
    log.clear()
    with switch.rollout():
        pass
    # the head came back; the rest, refused before the sleep, came back after it
    assert log[-4:] == ["reload:head", "reload:refused", "sleep:1", "reload"]
    assert offloader.left == 0
    assert "early reload refused" in caplog.text


def _report(direction: str, **stages: float) -> SwitchReport:
    info = MemoryInfo(0, False)
    return SwitchReport(
        direction,  # type: ignore[arg-type]
        0,
        [StageReport(name, seconds, info, info, 0.0) for name, seconds in stages.items()],
    )


def test_the_tail_is_the_longest_recent_sleep_and_confirm_at_the_last_offloads_rate() -> None:
    out = _report("to_rollout", offload=0.5)
    back = _report("to_trainer", reload_early=9.0, sleep=0.04, confirm=0.02, release=0.3)
    window = 0.04 + 0.02  # not the head before it, nor the release (gc) after it
    share, stretch = switch_reload.TAIL_SHARE, switch_reload.TAIL_STRETCH
    assert tail_bytes([], 1 << 30) == 0
    assert tail_bytes([out], 1 << 30) == 0  # no sleep timed yet
    assert tail_bytes([out, back], 1 << 30) == int((1 << 30) / 0.5 * share * window * stretch)
    assert tail_bytes([out, back], 0) == 0
    newer = _report("to_rollout", offload=0.25)
    expected = int((1 << 30) / 0.25 * share * window * stretch)
    assert tail_bytes([out, back, newer], 1 << 30) == expected
    long = _report("to_trainer", sleep=60.0)
    assert tail_bytes([out, long], 1 << 30) == 1 << 30  # never more than the pool
    failed = _report("to_trainer")  # failed before its sleep stage: the others still count
    assert tail_bytes([out, back, failed], 1 << 30) == tail_bytes([out, back], 1 << 30)
    assert tail_bytes([out, failed], 1 << 30) == 0


def test_the_window_is_the_longest_of_the_last_three_cycles() -> None:
    out = _report("to_rollout", offload=1.0)
    sleeps = [0.09, 0.03, 0.05, 0.04]  # the oldest, 90 ms, is out of the window
    cycles = [_report("to_trainer", sleep=s, confirm=0.0) for s in sleeps]
    reports = [out, *cycles]
    assert switch_reload.TAIL_CYCLES == 3
    rate = (1 << 40) / 1.0
    expected = int(rate * switch_reload.TAIL_SHARE * 0.05 * switch_reload.TAIL_STRETCH)
    assert tail_bytes(reports, 1 << 40) == expected


def test_a_reload_up_to_max_bytes_brings_back_whole_storages_in_order(
    cpu_as_device: list[int],
) -> None:
    model, optimizer, before, off = offloaded_model()
    sizes = [slot.nbytes for slot in off._slots]
    report = off.reload(max_bytes=sizes[0] + sizes[1] + sizes[2] - 1)  # the third passes it
    assert report.tensors == 2
    assert report.nbytes == sizes[0] + sizes[1]
    assert [slot.offloaded for slot in off._slots] == [False, False] + [True] * (len(sizes) - 2)
    assert off.offloaded_groups
    assert off.reload(max_bytes=1).tensors == 1  # below one storage: that one, progress
    off.reload()  # the rest
    assert not off.offloaded_groups
    assert_bitwise_equal(before, snapshot(model, optimizer))


@pytest.mark.parametrize(
    ("limit", "error"), [(0, ValueError), (-1, ValueError), (1.5, TypeError), ("1", TypeError)]
)
def test_a_bad_max_bytes_is_refused_before_anything_moves(
    cpu_as_device: list[int], limit: Any, error: type[Exception]
) -> None:
    model, optimizer = make_model()
    off = hm.Offloader(model, optimizer)
    off.offload()
    with pytest.raises(error, match="max_bytes must be a positive int or None"):
        off.reload(max_bytes=limit)
    assert all(slot.offloaded for slot in off._slots)
    off.reload()


def test_the_storages_in_the_first_bytes_go_by_copy_engine(cpu_mapping: list[int]) -> None:
    model, optimizer, before, off = offloaded_model()
    sizes = [slot.nbytes for slot in off._slots]
    first = sizes[0] + sizes[1]  # the first two slots, exactly
    off.reload(by="kernel", copy_engine_first=first)
    assert cpu_mapping == sizes[2:]  # every later storage by kernel, in order
    assert_bitwise_equal(before, snapshot(model, optimizer))
    cpu_mapping.clear()
    off.offload()
    off.reload(by="kernel", copy_engine_first=first + 1)  # the third starts before the mark
    assert cpu_mapping == sizes[3:]
    cpu_mapping.clear()
    off.offload()
    off.reload(by="copy_engine", copy_engine_first=10)  # no kernel at all
    assert cpu_mapping == []
    assert_bitwise_equal(before, snapshot(model, optimizer))


@pytest.mark.parametrize(
    ("first", "error", "message"),
    [
        (-1, ValueError, "copy_engine_first"),
        (1.5, TypeError, "copy_engine_first"),
        ("1", TypeError, "copy_engine_first"),
    ],
)
def test_a_bad_copy_engine_first_is_refused(
    cpu_as_device: list[int], first: Any, error: type[Exception], message: str
) -> None:
    off = hm.Offloader(torch.nn.Linear(4, 4))
    off.offload()
    with pytest.raises(error, match=message):
        off.reload(by="kernel", copy_engine_first=first)
    assert off.offloaded_groups  # nothing moved
    off.reload()


@pytest.mark.parametrize("bad", ["kernels", "copy", None, 3])
def test_a_bad_reload_by_is_refused_naming_the_ways(fake_gpu: FakeTorch, bad: Any) -> None:
    with pytest.raises(ValueError, match=r"reload_by must be 'kernel' or 'copy_engine', got"):
        _switch(fake_gpu, reload_by=bad)


def test_kernel_bound_storages_are_allocated_before_any_kernel_is_queued(
    cpu_mapping: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mapping waits for kernels in flight (H200); a copy-engine slot's precedes its copy."""
    model, optimizer, before, off = offloaded_model()
    sizes = [slot.nbytes for slot in off._slots]
    events: list[str] = []
    resize, kernel = _torch.resize_storage, _torch.copy_by_kernel
    pool = off._host
    copy_one = pool.copy_one

    def allocate(storage: Any, nbytes: int) -> None:
        events.append(f"alloc:{nbytes}")
        resize(storage, nbytes)

    def by_kernel(dst: torch.Tensor, src: torch.Tensor) -> None:
        events.append(f"kernel:{dst.numel()}")
        kernel(dst, src)

    def copy(slot: Any, device: Any, *, to_host: bool, by_kernel: bool = False) -> None:
        if not by_kernel:
            events.append(f"ce:{slot.nbytes}")
        copy_one(slot, device, to_host=to_host, by_kernel=by_kernel)

    monkeypatch.setattr(_torch, "resize_storage", allocate)
    monkeypatch.setattr(_torch, "copy_by_kernel", by_kernel)
    monkeypatch.setattr(pool, "copy_one", copy)
    off.reload(by="kernel", copy_engine_first=sizes[0] + sizes[1])
    head, tail = sizes[:2], sizes[2:]
    assert events == (
        [f"alloc:{n}" for n in tail]  # every kernel-bound storage mapped first
        + [e for n in head for e in (f"alloc:{n}", f"ce:{n}")]  # then each, then its copy
        + [f"kernel:{n}" for n in tail]
    )
    assert_bitwise_equal(before, snapshot(model, optimizer))
