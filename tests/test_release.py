"""Cache release: order, garbage-collection rounds, devices, report, scoped form."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Literal

import pytest
import torch

import hybridmem as hm
from hybridmem.scopes.release import MAX_GC_ROUNDS
from tests.conftest import FakeDevice, FakeTorch, patch_seam

GiB = 1 << 30


def test_order_is_sync_gc_ipc_empty(fake_gpu: FakeTorch) -> None:
    hm.release_cache()
    assert fake_gpu.events == ["sync:0", "gc", "ipc_collect", "empty_cache"]


def test_report_figures(fake_gpu: FakeTorch) -> None:
    report = hm.release_cache()
    (dev,) = report.devices
    assert dev.device == 0
    assert (dev.allocated_before, dev.allocated_after) == (2 * GiB, 2 * GiB)
    assert (dev.reserved_before, dev.reserved_after) == (10 * GiB, 2 * GiB)
    assert dev.returned == report.bytes_returned == 8 * GiB
    assert report.free_after - report.free_before == 8 * GiB
    assert dev.total == 80 * GiB
    assert report.synchronized
    assert report.ipc_collected
    assert report.gc_rounds == 1
    assert report.duration_s >= 0
    assert report.reserved_before == 10 * GiB
    assert report.reserved_after == 2 * GiB
    assert report.allocated_before == report.allocated_after == 2 * GiB
    assert "returned 8.00 GiB" in str(report)


def test_one_info_line(fake_gpu: FakeTorch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="hybridmem")
    hm.release_cache()
    lines = [r for r in caplog.records if r.name == "hybridmem"]
    assert len(lines) == 1
    assert lines[0].levelno == logging.INFO
    assert lines[0].getMessage().startswith("release_cache(cuda:0): returned 8.00 GiB")


def test_gc_repeats_only_while_it_frees_device_memory(fake_gpu: FakeTorch) -> None:
    fake_gpu.gc_results = [10, 5, 0]
    fake_gpu.gc_frees = [GiB, GiB, 0]
    report = hm.release_cache()
    assert report.gc_rounds == 3
    assert report.gc_collected == 15
    assert fake_gpu.events == ["sync:0", "gc", "gc", "gc", "ipc_collect", "empty_cache"]


def test_gc_found_garbage_but_freed_no_device_memory(fake_gpu: FakeTorch) -> None:
    fake_gpu.gc_results = [100, 100]
    assert hm.release_cache().gc_rounds == 1


def test_gc_rounds_are_capped(fake_gpu: FakeTorch) -> None:
    fake_gpu.devices[0].allocated = 100 * GiB
    fake_gpu.gc_results = [1] * 10
    fake_gpu.gc_frees = [GiB] * 10
    assert hm.release_cache().gc_rounds == MAX_GC_ROUNDS


def test_switches_turn_steps_off(fake_gpu: FakeTorch) -> None:
    report = hm.release_cache(sync=False, collect_garbage=False, ipc_collect=False)
    assert fake_gpu.events == ["empty_cache"]
    assert not report.synchronized
    assert report.gc_rounds == 0
    assert not report.ipc_collected


def test_uninitialised_cuda_is_a_noop(fake: FakeTorch) -> None:
    report = hm.release_cache()
    assert report.devices == ()
    assert fake.events == []
    assert "nothing to do" in str(report)


def test_current_device_not_device_zero(fake_gpu: FakeTorch) -> None:
    fake_gpu.devices[1] = FakeDevice(allocated=GiB, reserved=3 * GiB)
    fake_gpu.current = 1
    report = hm.release_cache()
    assert [d.device for d in report.devices] == [1]
    assert fake_gpu.events[0] == "sync:1"


def test_device_all_and_explicit(fake_gpu: FakeTorch) -> None:
    fake_gpu.devices[1] = FakeDevice(allocated=GiB, reserved=3 * GiB)
    report = hm.release_cache("all")
    assert [d.device for d in report.devices] == [0, 1]
    assert fake_gpu.events[:2] == ["sync:0", "sync:1"]
    assert report.bytes_returned == 8 * GiB + 2 * GiB
    assert [d.device for d in hm.release_cache(torch.device("cuda", 1)).devices] == [1]
    assert [d.device for d in hm.release_cache("cuda:1").devices] == [1]
    assert [d.device for d in hm.release_cache("cuda").devices] == [0]


def test_device_without_context_is_skipped(fake_gpu: FakeTorch) -> None:
    fake_gpu.devices[2] = FakeDevice()  # two devices have contexts; index 1 has none
    report = hm.release_cache(device=1)
    assert report.devices == ()
    assert "sync:1" not in fake_gpu.events


@pytest.mark.parametrize(
    ("device", "error", "message"),
    [
        (True, TypeError, "bool"),
        (-1, ValueError, ">= 0"),
        (7, ValueError, "out of range"),
        ("cpu", ValueError, "not a CUDA device"),
        ("gpu0", ValueError, "is not a device"),
        (torch.device("cpu"), ValueError, "not a CUDA device"),
        (1.5, TypeError, "device must be"),
    ],
)
def test_bad_device(
    fake_gpu: FakeTorch, device: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        hm.release_cache(device)  # type: ignore[arg-type]


@pytest.mark.parametrize("flag", ["sync", "collect_garbage", "ipc_collect"])
def test_bad_flags(fake_gpu: FakeTorch, flag: str) -> None:
    with pytest.raises(TypeError, match=flag):
        hm.release_cache(**{flag: 1})  # type: ignore[arg-type]


def test_kill_switch(fake_gpu: FakeTorch, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDMEM_DISABLE", "true")
    assert hm.release_cache().devices == ()
    assert fake_gpu.events == []


# --------------------------------------------------------------------------- #
# aggressive_cache_release
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("on", "expected"),
    [
        ("enter", ["empty_cache", "body"]),
        ("exit", ["body", "empty_cache"]),
        ("both", ["empty_cache", "body", "empty_cache"]),
    ],
)
def test_scoped_release_when(
    fake_gpu: FakeTorch, on: Literal["enter", "exit", "both"], expected: list[str]
) -> None:
    with hm.aggressive_cache_release(
        on=on, collect_garbage=False, sync=False, ipc_collect=False
    ) as ctx:
        fake_gpu.events.append("body")
    assert fake_gpu.events == expected
    assert ctx.last_report is not None


def test_bare_and_called_decorator_forms(fake_gpu: FakeTorch) -> None:
    @hm.aggressive_cache_release
    def bare() -> str:
        fake_gpu.events.append("body")
        return "ok"

    @hm.aggressive_cache_release(on="enter", collect_garbage=False)
    async def called() -> str:
        fake_gpu.events.append("body")
        return "ok"

    assert bare() == "ok"
    assert fake_gpu.events[0] == "body"
    assert fake_gpu.events[-1] == "empty_cache"
    fake_gpu.events.clear()
    assert asyncio.run(called()) == "ok"
    assert fake_gpu.events[-1] == "body"
    assert "empty_cache" in fake_gpu.events
    assert bare.__name__ == "bare"


def test_every_form_releases_once_per_use(fake_gpu: FakeTorch) -> None:
    """The card's name in every form: with, async with, generators, classes."""

    def releases() -> int:
        count = fake_gpu.events.count("empty_cache")
        fake_gpu.events.clear()
        return count

    @hm.aggressive_cache_release()
    def gen() -> Iterator[int]:
        yield 1

    @hm.aggressive_cache_release(on="both")
    async def agen() -> AsyncIterator[int]:
        yield 1

    @hm.aggressive_cache_release
    class Manager:
        def __enter__(self) -> Manager:
            return self

        def __exit__(self, *exc: object) -> None:
            fake_gpu.events.append("manager exit")

    async def async_with() -> None:
        async with hm.aggressive_cache_release(on="enter"):
            pass

    # A generator's scope is left at each yield and at its end: two exits here.
    assert list(gen()) == [1]
    assert releases() == 2

    async def consume() -> list[int]:
        return [x async for x in agen()]

    assert asyncio.run(consume()) == [1]
    assert releases() == 4  # on="both": entered twice, left twice
    with Manager():
        pass
    assert fake_gpu.events[-1] == "empty_cache"  # after the class's own __exit__
    assert "manager exit" in fake_gpu.events
    assert releases() == 1
    asyncio.run(async_with())
    assert releases() == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_a_named_device_that_is_not_there_is_refused_without_cuda() -> None:
    for call in (hm.release_cache, hm.memory_info):
        with pytest.raises(
            ValueError,
            match=r"device index 99 is out of range: (this torch is built without CUDA|no CUDA "
            r"device is visible)",
        ):
            call(device="cuda:99")
        with pytest.raises(ValueError, match="device index 0 is out of range"):
            call(device=0)
    assert hm.release_cache().devices == ()  # no device named: a harmless no-op


def test_a_named_device_past_the_visible_ones_is_refused(
    fake_gpu: FakeTorch, monkeypatch: pytest.MonkeyPatch
) -> None:
    patch_seam(monkeypatch, "device_count", lambda: 2)
    for call in (hm.release_cache, hm.memory_info):
        with pytest.raises(
            ValueError,
            match=r"device index 99 is out of range: 2 CUDA device\(s\) are visible, "
            "indices 0 to 1",
        ):
            call(device="cuda:99")


def test_release_on_error_never_masks_the_error(
    fake_gpu: FakeTorch, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken() -> None:
        raise RuntimeError("CUDA error: device lost")

    monkeypatch.setattr("hybridmem._torch.empty_cache", broken)
    with pytest.raises(KeyError), hm.aggressive_cache_release():
        raise KeyError("original")
    assert any("release_cache failed" in r.getMessage() for r in caplog.records)
    with pytest.raises(RuntimeError, match="device lost"), hm.aggressive_cache_release():
        pass  # without an error in flight, the release error is raised


def test_scoped_release_runs_on_exception(fake_gpu: FakeTorch) -> None:
    with pytest.raises(ValueError, match="x"), hm.aggressive_cache_release(collect_garbage=False):
        raise ValueError("x")
    assert fake_gpu.events[-1] == "empty_cache"


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"on": "start"}, ValueError, "on must be one of"),
        ({"sync": "yes"}, TypeError, "sync"),
        ({"device": -2}, ValueError, ">= 0"),
    ],
)
def test_scoped_bad_input(kwargs: dict[str, object], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        hm.aggressive_cache_release(**kwargs)  # type: ignore[call-overload]


def test_young_collection_collects_generations_0_and_1(fake_gpu: FakeTorch) -> None:
    report = hm.release_cache(collect_garbage="young")
    assert fake_gpu.events == ["sync:0", "gc:1", "ipc_collect", "empty_cache"]
    assert report.gc_rounds == 1
    with pytest.raises(TypeError, match="collect_garbage must be True, False or 'young'"):
        hm.release_cache(collect_garbage="old")  # type: ignore[arg-type]


def test_the_gate_pays_a_full_pass_only_when_memory_stayed(fake_gpu: FakeTorch) -> None:
    from hybridmem.scopes.garbage import GC_SLACK_BYTES, GarbageGate

    gate = GarbageGate()
    gate.release(None, "a")  # nothing to compare with yet
    assert fake_gpu.events.count("gc") == 1
    for _ in range(3):
        fake_gpu.events.clear()
        gate.release(None, "a")
        assert fake_gpu.events.count("gc:1") == 1
        assert "gc" not in fake_gpu.events
    # A little more (under the slack) is not worth a full pass.
    fake_gpu.devices[0].allocated += GC_SLACK_BYTES // 2
    fake_gpu.events.clear()
    gate.release(None, "a")
    assert "gc" not in fake_gpu.events
    # A planted cycle holding a gigabyte: the young pass misses it, the full one frees it.
    fake_gpu.devices[0].allocated += GiB
    fake_gpu.gc_results, fake_gpu.gc_frees = [0, 3], [0, GiB]
    fake_gpu.events.clear()
    report = gate.release(None, "a")
    assert fake_gpu.events.index("gc:1") < fake_gpu.events.index("gc")
    assert report.allocated_after == 2 * GiB + GC_SLACK_BYTES // 2
    assert gate.full_passes == 2
    gate.release(None, "b")  # another point of the cycle has its own reference
    assert gate.full_passes == 3


def test_blas_workspaces_go_before_the_cache_is_emptied(
    fake_gpu: FakeTorch, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.conftest import patch_seam

    patch_seam(monkeypatch, "clear_blas_workspaces", lambda: fake_gpu.events.append("blas"))
    hm.release_cache()
    assert fake_gpu.events == ["sync:0", "gc", "ipc_collect", "blas", "empty_cache"]
    fake_gpu.events.clear()
    hm.release_cache(sync=False)  # kernels may still use them: kept
    assert "blas" not in fake_gpu.events


def test_a_stuck_cache_is_explained_once(
    fake_gpu: FakeTorch, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from hybridmem.scopes.release import STUCK_CACHE_BYTES

    caplog.set_level(logging.INFO, logger="hybridmem")
    device = fake_gpu.devices[0]

    def empty_cache() -> None:  # a live block keeps part of a segment cached
        device.reserved = device.allocated + STUCK_CACHE_BYTES + 1

    patch_seam(monkeypatch, "empty_cache", empty_cache)
    hm.release_cache()
    hm.release_cache()
    hints = [r.getMessage() for r in caplog.records if "stayed cached" in r.getMessage()]
    assert len(hints) == 1
    assert "hm.compact(model)" in hints[0]


def test_a_small_cache_left_is_not_worth_a_line(
    fake_gpu: FakeTorch, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from hybridmem.scopes.release import STUCK_CACHE_BYTES

    caplog.set_level(logging.INFO, logger="hybridmem")
    device = fake_gpu.devices[0]
    patch_seam(
        monkeypatch,
        "empty_cache",
        lambda: setattr(device, "reserved", device.allocated + STUCK_CACHE_BYTES),
    )
    hm.release_cache()
    assert not [r for r in caplog.records if "stayed cached" in r.getMessage()]


def test_release_seconds_adds_up_every_release_from_every_thread(fake_gpu: FakeTorch) -> None:
    import threading

    from hybridmem.scopes.release import release_seconds

    before = release_seconds()
    reports = [hm.release_cache(0)]
    worker = threading.Thread(target=lambda: reports.append(hm.release_cache(0)))
    worker.start()
    worker.join(timeout=30)
    assert len(reports) == 2
    assert all(r.devices for r in reports)  # real releases (on the fake device)
    assert release_seconds() - before == pytest.approx(sum(r.duration_s for r in reports))
