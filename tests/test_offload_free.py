"""An offload frees and releases its storages chunk by chunk as their copies land.

On the CPU the streams are fakes that log what the Offloader asks of them (events
recorded, waited for, the cache emptied); the copies themselves run at once. The
chunk is made small so that the test model's offload lands in several chunks. The
GPU test (tests/gpu) and ``benchmarks/release_during_offload.py`` measure the effect.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

import hybridmem as hm
from hybridmem import _torch
from hybridmem.memory import offload_free
from hybridmem.memory.host_pool import HostPool
from hybridmem.memory.offload_free import Landing
from hybridmem.memory.offload_report import CopyClock, OffloadReport
from tests.conftest import fail_resizes
from tests.test_offload import (
    _FAULT_POINTS,
    assert_bitwise_equal,
    fault_plans,
    make_model,
    run_fault_plan,
    snapshot,
)

CHUNK = 2048  # bytes: the test model's state lands in several chunks


class FakeStream:
    """A stream the seam's fakes accept; the copies on the CPU have already run."""


class TimedEvent:
    """A fake timed event (the copy clock's): not logged with the landing's events."""

    SECONDS = 0.125  # what the fake seam says lay between two of them


@pytest.fixture
def landings(cpu_as_device: list[int], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Fake streams and events; return the log of waits, frees and releases."""
    log: list[str] = []
    monkeypatch.setattr(offload_free, "LANDING_CHUNK_BYTES", CHUNK)
    seam: dict[str, Any] = {
        "new_stream": lambda device: FakeStream(),
        "release_stream": lambda stream: None,
        "current_stream": lambda device: FakeStream(),
        "stream_scope": lambda stream: contextlib.nullcontext(),
        "wait_stream": lambda waiter, waitee: None,
        "synchronize_stream": lambda stream: log.append("sync"),
        "new_event": lambda: object(),
        "new_timed_event": TimedEvent,
        "record_event": lambda event, stream: (
            None if isinstance(event, TimedEvent) else log.append("record")
        ),
        "event_seconds": lambda start, end: TimedEvent.SECONDS,
        "synchronize_event": lambda event: log.append("wait"),
        "empty_cache": lambda: log.append("empty_cache"),
    }
    for name, fake in seam.items():
        monkeypatch.setattr(_torch, name, fake)
    real = _torch.resize_storage

    def resize(storage: Any, nbytes: int) -> None:
        if nbytes == 0:
            log.append("free")
        real(storage, nbytes)

    monkeypatch.setattr(_torch, "resize_storage", resize)
    return log


def fresh() -> tuple[Any, Any, list[Any], hm.Offloader]:
    """The test model, its snapshot and an Offloader of it (nothing offloaded)."""
    model, optimizer = make_model()
    return model, optimizer, snapshot(model, optimizer), hm.Offloader(model, optimizer)


def fail_call(
    monkeypatch: pytest.MonkeyPatch, point: str, number: int, error: BaseException
) -> None:
    """Make call ``number`` (from 1) of the seam's ``point`` raise ``error``."""
    fake = getattr(_torch, point)
    calls = [0]

    def failing(*args: Any) -> Any:
        calls[0] += 1
        if calls[0] == number:
            raise error
        return fake(*args)

    monkeypatch.setattr(_torch, point, failing)


def chunks_of(log: list[str]) -> list[list[str]]:
    """The offload's log cut after each release: what happened per chunk."""
    cut: list[list[str]] = [[]]
    for entry in log:
        if entry != "record":
            cut[-1].append(entry)
        if entry == "empty_cache":
            cut.append([])
    return [c for c in cut if c]


def test_each_chunk_is_freed_after_its_copies_land_and_released_at_once(
    landings: list[str],
) -> None:
    model, optimizer, before, off = fresh()
    report = off.offload()
    chunks = chunks_of(landings)
    assert landings.count("record") == len(chunks) - 1 >= 2  # several chunks
    for chunk in chunks[:-1]:  # wait for its copies, free them, release them
        assert chunk[0] == "wait"
        assert chunk[-1] == "empty_cache"
        assert set(chunk[1:-1]) == {"free"}, chunk
    assert chunks[-1][0] == "sync"  # the copies after the last event
    assert chunks[-1][-1] == "empty_cache"
    assert landings.count("free") == report.tensors
    assert off.offloaded_groups == {"parameters", "buffers", "gradients", "optimizer"}
    off.reload()
    assert_bitwise_equal(before, snapshot(model, optimizer))
    landings.clear()
    off.offload()  # the streamed offload (planned, nothing offloaded) lands by chunks too
    assert landings.count("record") == len(chunks) - 1
    off.reload()
    assert_bitwise_equal(before, snapshot(model, optimizer))


def test_without_release_cache_all_is_freed_once_every_copy_landed(landings: list[str]) -> None:
    model, optimizer = make_model()
    off = hm.Offloader(model, optimizer)
    off.offload(release_cache=False)
    assert "record" not in landings
    assert "empty_cache" not in landings
    assert landings[0] == "sync"
    assert set(landings[1:]) == {"free"}


def test_a_chunk_that_fails_to_free_puts_back_the_chunks_before_it(
    landings: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer, before, off = fresh()
    off.offload()
    off.reload()
    first = chunks_of(landings)[0].count("free")
    landings.clear()
    real = fail_resizes(monkeypatch, frees=(first + 1,))  # the second chunk's first free
    with pytest.raises(hm.OffloadError, match="freed in earlier chunks were reloaded") as info:
        off.offload()
    assert info.value.offloaded == frozenset() == off.offloaded_groups
    assert_bitwise_equal(before, snapshot(model, optimizer))
    monkeypatch.setattr(_torch, "resize_storage", real)
    off.offload()
    off.reload()
    assert_bitwise_equal(before, snapshot(model, optimizer))


def test_a_chunk_that_cannot_be_put_back_leaves_the_earlier_ones_offloaded(
    landings: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer, before, off = fresh()
    off.offload()
    off.reload()
    first = chunks_of(landings)[0].count("free")
    real = fail_resizes(monkeypatch, frees=(first + 2,), allocations=(1,))
    with pytest.raises(hm.OffloadError, match="earlier chunks stay offloaded too") as info:
        off.offload()
    assert info.value.offloaded == off.offloaded_groups != frozenset()
    monkeypatch.setattr(_torch, "resize_storage", real)
    off.reload()  # brings back every chunk freed
    assert off.offloaded_groups == frozenset()
    assert_bitwise_equal(before, snapshot(model, optimizer))


@pytest.mark.parametrize("point", ["empty_cache", "synchronize_event"])
def test_a_release_or_wait_that_fails_midway_puts_back_what_was_freed(
    landings: list[str], monkeypatch: pytest.MonkeyPatch, point: str
) -> None:
    model, optimizer, before, off = fresh()
    fail_call(monkeypatch, point, 2, RuntimeError(f"injected: {point}"))
    with pytest.raises(hm.OffloadError, match="those were reloaded from the host pool") as info:
        off.offload()
    assert isinstance(info.value.__cause__, RuntimeError)
    assert off.offloaded_groups == frozenset()
    assert_bitwise_equal(before, snapshot(model, optimizer))


def test_putting_back_the_earlier_chunks_can_fail_too_and_they_stay_retrievable(
    landings: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer, before, off = fresh()
    fail_call(monkeypatch, "synchronize_event", 2, RuntimeError("injected: wait"))
    real = fail_resizes(monkeypatch, allocations=(1,))  # putting back fails
    with pytest.raises(hm.OffloadError, match=r"stay offloaded.*reload\(\) brings") as info:
        off.offload()
    assert info.value.offloaded == off.offloaded_groups != frozenset()
    monkeypatch.setattr(_torch, "resize_storage", real)
    off.reload()
    assert_bitwise_equal(before, snapshot(model, optimizer))


def test_an_interrupt_between_chunks_puts_back_what_was_freed_and_goes_on(
    landings: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer, before, off = fresh()
    fail_call(monkeypatch, "synchronize_event", 2, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        off.offload()
    assert off.offloaded_groups == frozenset()
    assert_bitwise_equal(before, snapshot(model, optimizer))


@pytest.mark.parametrize("release_cache", [True, False])
def test_the_report_times_the_copies_alone_between_two_events_on_their_stream(
    landings: list[str], monkeypatch: pytest.MonkeyPatch, release_cache: bool
) -> None:
    """Decision 90: the copies' own time, whatever ran beside them before the frees."""
    seen: list[str] = []
    record = _torch.record_event

    def clocked(event: Any, stream: Any) -> None:
        if isinstance(event, TimedEvent):
            assert isinstance(stream, FakeStream)  # the side stream, where the copies run
            seen.append("clock")
        record(event, stream)

    copy_one = HostPool.copy_one

    def copying(pool: HostPool, *args: Any, **kwargs: Any) -> None:
        seen.append("copy")
        copy_one(pool, *args, **kwargs)

    monkeypatch.setattr(_torch, "record_event", clocked)
    monkeypatch.setattr(HostPool, "copy_one", copying)
    model, optimizer, before, off = fresh()
    for label in ("planned", "streamed"):  # the first offload plans, the next walks
        seen.clear()
        flight = off.start_offload(release_cache=release_cache)
        assert seen[0] == seen[-1] == "clock", label  # around the copies, and only them
        assert seen.count("clock") == 2, label
        assert seen.count("copy") >= 2, label
        report = flight.finish()
        assert report.copy_seconds == TimedEvent.SECONDS, label
        assert report.copy_gbps == report.nbytes / TimedEvent.SECONDS / 1e9
        assert f"copies {TimedEvent.SECONDS * 1e3:.1f} ms" in str(report)
        reloaded = off.reload()
        assert reloaded.copy_seconds is None  # a reload is not timed on the device
        assert reloaded.copy_gbps == reloaded.gbps
    assert_bitwise_equal(before, snapshot(model, optimizer))


def test_an_unreadable_clock_leaves_the_offload_done_and_untimed(
    landings: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def unreadable(start: Any, end: Any) -> float:
        raise RuntimeError("injected: elapsed_time")

    monkeypatch.setattr(_torch, "event_seconds", unreadable)
    model, optimizer, before, off = fresh()
    report = off.offload()
    assert report.copy_seconds is None
    assert off.offloaded_groups == {"parameters", "buffers", "gradients", "optimizer"}
    off.reload()
    assert_bitwise_equal(before, snapshot(model, optimizer))


def test_without_a_stream_nothing_is_timed(cpu_as_device: list[int]) -> None:
    clock = CopyClock()
    clock.start(None)
    clock.stop(None)
    assert clock.seconds() is None
    model, optimizer, before, off = fresh()  # the CPU's real seam: no side stream
    report = off.offload()
    assert report.nbytes > 0
    assert report.copy_seconds is None
    assert report.copy_gbps == report.gbps
    off.reload()
    assert_bitwise_equal(before, snapshot(model, optimizer))


def test_landing_records_an_event_every_chunk_and_yields_the_total_last() -> None:
    recorded: list[int] = []
    landing = Landing(100)
    stream = FakeStream()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_torch, "new_event", lambda: object())
        mp.setattr(_torch, "record_event", lambda event, s: recorded.append(1))
        mp.setattr(_torch, "synchronize_event", lambda event: None)
        for nbytes in (60, 60, 10, 200, 5):  # events after the 2nd and the 4th copy
            landing.copied(stream, nbytes)
        assert len(recorded) == 2
        assert list(landing.landed(5)) == [2, 4, 5]
        assert list(landing.landed(4)) == [2, 4]  # an event at the end is not waited for


@given(
    fault_plans(
        [
            "offload",
            "reload",
            "offload_params",
            "reload_optimizer",
            "offload_in_flight",
            "offload_cancelled",
        ],
        [*_FAULT_POINTS, "synchronize_event", "record_event", "new_timed_event", "event_seconds"],
    )
)
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_injected_faults_never_lose_data_as_chunks_land(
    landings: list[str],
    monkeypatch: pytest.MonkeyPatch,
    plan: list[tuple[str, str, set[int]]],
) -> None:
    run_fault_plan(monkeypatch, plan)


@pytest.mark.parametrize(("copy_seconds", "expected"), [(0.05, 0.05), (None, 0.2), (0.0, 0.2)])
def test_a_reports_rate_is_read_over_its_copies_own_time_where_measured(
    copy_seconds: float | None, expected: float
) -> None:
    report = OffloadReport(
        "offload", ("optimizer",), 1 << 30, 3, 0.2, 1 << 30, "cuda:0", 0, copy_seconds
    )
    assert report.copy_or_wall_seconds == expected
    assert report.copy_gbps == pytest.approx((1 << 30) / expected / 1e9)
