"""The engine's weights woken and synced under the offload's copies (decision 86).

From the second cycle, where the device has room for what the last cycle's weight
stages took, the switch only queues the offload's copies, wakes and syncs the weights,
then frees as the copies land (``offload_land``); no release that synchronizes the
device runs in between. On the CPU: the fake seam's events and the fakes' logs.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

import hybridmem as hm
from hybridmem.engine import switch_reload
from hybridmem.engine.reports import StageReport, SwitchReport
from hybridmem.engine.switch_offload import WEIGHTS_MARGIN_BYTES, kv_need, weights_need
from hybridmem.engine.switch_reload import tail_bytes
from hybridmem.memory.offload import OffloadInFlight
from hybridmem.observe.memory import MemoryInfo
from hybridmem.scopes import phases
from tests.conftest import FakeTorch
from tests.test_switch import (
    AsyncSGLang,
    Boom,
    FakeOffloader,
    FakeVLLM,
    KVTimed,
    LandingTimed,
    _no_wait,
    make,
    run_ranks,
)

GiB = 1 << 30
QUEUED = ["offload:queued", "barrier", "wake:weights", "sync(expandable=False)", "offload:landed"]


def to_rollout_log(switch: hm.HybridSwitch, log: list[str]) -> list[str]:
    log.clear()
    switch.to_rollout()
    return list(log)


def after_one_cycle(
    fake_gpu: FakeTorch, **kw: Any
) -> tuple[hm.HybridSwitch, list[str], FakeOffloader]:
    """A switch (``make``'s, with ``kw``), its log and offloader, after one whole cycle."""
    switch, log = make(fake_gpu, **kw)
    switch.to_rollout()
    switch.to_trainer()
    offloader = switch.offloader
    assert isinstance(offloader, FakeOffloader)
    return switch, log, offloader


def mark_the_flight(switch: hm.HybridSwitch, fake_gpu: FakeTorch) -> None:
    """Log ``queued`` when the offload's copies are queued and ``landing`` as they land."""
    offloader = switch.offloader
    assert isinstance(offloader, FakeOffloader)
    real = offloader.start_offload

    def marked(groups: Any = None, **kw: Any) -> Any:
        flight = real(groups, **kw)
        fake_gpu.events.append("queued")

        def finish() -> Any:
            fake_gpu.events.append("landing")
            return flight.finish()

        return OffloadInFlight(finish, flight.cancel)

    offloader.start_offload = marked  # type: ignore[method-assign]


def test_from_the_second_cycle_the_weights_wake_and_sync_under_the_copies(
    fake_gpu: FakeTorch,
) -> None:
    switch, log = make(fake_gpu, kv_under_offload=False)  # the KV cache: tests below
    assert switch.weights_under_offload
    first = to_rollout_log(switch, log)
    assert first[0] == "offload"  # nothing known of the weights yet: offloaded in full
    switch.to_trainer()
    second = to_rollout_log(switch, log)
    assert second[: len(QUEUED)] == QUEUED
    assert second.index("offload:landed") < second.index("wake:kv_cache")
    report = switch.reports[-1]
    assert [s.name for s in report.stages][:6] == [
        "offload",
        "release",
        "barrier",
        "wake_weights",
        "weight_sync",
        "offload_land",
    ]
    switch.to_trainer()
    assert "reload" in log  # what was offloaded came back


def test_no_release_synchronizes_the_device_while_the_copies_run(fake_gpu: FakeTorch) -> None:
    switch, _ = make(fake_gpu)
    switch.to_rollout()
    switch.to_trainer()
    mark_the_flight(switch, fake_gpu)
    fake_gpu.events.clear()
    switch.to_rollout()
    between = fake_gpu.events[fake_gpu.events.index("queued") : fake_gpu.events.index("landing")]
    assert not [e for e in between if e.startswith(("sync:", "empty_cache"))], between
    after = fake_gpu.events[fake_gpu.events.index("landing") :]
    assert "empty_cache" in after  # offload_land releases once the copies landed


def test_without_room_for_the_weights_the_offload_finishes_first(fake_gpu: FakeTorch) -> None:
    switch, log, _ = after_one_cycle(fake_gpu)
    need = weights_need(switch.reports)
    assert need == 2 * GiB  # what the fake engine's weights took
    device = fake_gpu.devices[0]
    device.other = device.total - device.reserved - (need + WEIGHTS_MARGIN_BYTES - 1)
    assert to_rollout_log(switch, log)[0] == "offload"


def test_switched_off_the_offload_always_finishes_first(fake_gpu: FakeTorch) -> None:
    switch, log = make(fake_gpu, weights_under_offload=False)
    for _ in range(3):
        assert to_rollout_log(switch, log)[0] == "offload"
        switch.to_trainer()
    with pytest.raises(TypeError, match="weights_under_offload"):
        make(fake_gpu, weights_under_offload="yes")


def test_a_failed_weight_sync_cancels_the_copies_and_frees_nothing(fake_gpu: FakeTorch) -> None:
    switch, log, offloader = after_one_cycle(fake_gpu)
    offloader.left = 0
    failing = {"on": True}
    sync = switch.sync_weights

    def flaky(adapter: hm.EngineAdapter) -> object:
        if failing["on"]:
            raise Boom("sync")
        return None if sync is None else sync(adapter)

    switch.sync_weights = flaky
    log.clear()
    with pytest.raises(Boom):
        switch.to_rollout()
    assert "offload:queued" in log
    assert "offload:cancelled" in log
    assert "offload:landed" not in log
    assert "reload" not in log  # nothing was freed: nothing to bring back
    assert not switch._copying
    failing["on"] = False
    switch.to_rollout()  # the next cycle runs
    switch.to_trainer()


def test_a_failed_landing_reloads_what_was_offloaded(fake_gpu: FakeTorch) -> None:
    # offload_land's own failure: the KV cache not under the copies (since decision 89
    # the default lands late; test_a_failed_late_landing_reloads_what_was_offloaded)
    switch, log, offloader = after_one_cycle(fake_gpu, kv_under_offload=False)
    offloader.fail = "land"
    log.clear()
    with pytest.raises(Boom):
        switch.to_rollout()
    assert log[: len(QUEUED)] == QUEUED
    assert "wake:kv_cache" not in log  # the landing failed before the KV wake
    assert "offload:cancelled" not in log  # the flight ended at finish()
    assert log[-1] == "reload"  # recovery brought the state back


def test_the_reload_tail_is_sized_by_the_offloads_own_seconds() -> None:
    info = MemoryInfo(0, True, free=1 << 40, total=1 << 40)
    stages = [StageReport("offload", 0.001, info, info, 0.0)]
    window = [StageReport(name, 0.1, info, info, 0.0) for name in ("sleep", "confirm")]
    reports = [SwitchReport("to_rollout", 0, stages), SwitchReport("to_trainer", 0, window)]
    queued_only = tail_bytes(reports, 10 * GiB)  # the stage: 1 ms, as if the copies were free
    assert queued_only == 10 * GiB
    stretch = switch_reload.TAIL_STRETCH
    assert tail_bytes(reports, 10 * GiB, offload_s=1.0) == int(10 * GiB * 0.5 * 0.2 * stretch)


def test_weights_need_reads_the_last_switch_to_rollout() -> None:
    def info(free: int) -> MemoryInfo:
        return MemoryInfo(0, True, free=free, total=80 * GiB)

    stages = [
        StageReport("wake_weights", 0.0, info(50 * GiB), info(47 * GiB), 0.0),
        StageReport("weight_sync", 0.0, info(47 * GiB), info(46 * GiB), 0.0),
    ]
    assert weights_need([]) is None
    assert weights_need([SwitchReport("to_rollout", 0, stages)]) == 4 * GiB
    failed_early = SwitchReport("to_rollout", 0, stages[:1])
    assert weights_need([SwitchReport("to_rollout", 0, stages), failed_early]) is None


def test_the_async_driver_lands_the_copies_off_the_loop(
    fake_gpu: FakeTorch, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(phases, "await_free_async", _no_wait)
    log: list[str] = []

    async def sync(adapter: hm.EngineAdapter) -> None:
        log.append("sync")

    switch = hm.HybridSwitch(
        AsyncSGLang(log),
        "sglang",
        FakeOffloader(log),
        sync_weights=sync,
        barrier=None,
        confirm_timeout_s=0.0,
    )

    async def cycles() -> None:
        for _ in range(2):
            log.clear()
            async with switch.rollout():
                log.append("generate")

    asyncio.run(cycles())
    assert log[:5] == [
        "offload:queued",
        "resume:weights",
        "sync",
        "resume:kv_cache",  # the fake engine takes no memory: room for it under the copies
        "offload:landed",
    ]
    assert switch.offload_report is not None


# --------------------------------------------------------------------------- #
# Decision 89: the KV cache woken under the copies too, where the device has room
# --------------------------------------------------------------------------- #
UNDER_KV = [*QUEUED[:-1], "barrier", "wake:kv_cache", "offload:landed"]


def test_from_the_second_cycle_the_kv_cache_wakes_under_the_copies_too(
    fake_gpu: FakeTorch,
) -> None:
    switch, log = make(fake_gpu)
    assert switch.kv_under_offload
    first = to_rollout_log(switch, log)
    assert first.index("offload") < first.index("wake:kv_cache")
    assert switch._kv_need == 30 * GiB  # what the fake engine's KV cache took
    switch.to_trainer()
    offloader = switch.offloader
    assert isinstance(offloader, FakeOffloader)
    real, device = offloader.start_offload, fake_gpu.devices[0]

    def freeing(groups: Any = None, **kw: Any) -> Any:  # the landing frees 4 GiB
        flight = real(groups, **kw)

        def finish() -> Any:
            device.other -= 4 * GiB  # (as if: the trainer state freed)
            return flight.finish()

        return OffloadInFlight(finish, flight.cancel)

    offloader.start_offload = freeing  # type: ignore[method-assign]
    for _ in range(2):
        assert to_rollout_log(switch, log) == UNDER_KV
        report = switch.reports[-1]
        names = [s.name for s in report.stages]
        assert names.index("wake_kv") < names.index("offload_land_late")
        freed = report.stage("offload_land_late")
        assert freed.free_after is not None
        assert freed.free_before is not None
        assert freed.free_after - freed.free_before == 4 * GiB
        # not re-learned where the landing blurs the reading (it would say 26 GiB)
        assert switch._kv_need == 30 * GiB
        switch.to_trainer()
        device.other += 4 * GiB
        assert "reload" in log  # what was offloaded came back


def test_one_release_runs_once_the_copies_landed_after_the_kv_wake(fake_gpu: FakeTorch) -> None:
    switch, log, _ = after_one_cycle(fake_gpu)
    mark_the_flight(switch, fake_gpu)
    fake_gpu.events.clear()
    log.clear()
    switch.to_rollout()
    assert log.index("wake:kv_cache") < log.index("offload:landed")
    between = fake_gpu.events[fake_gpu.events.index("queued") : fake_gpu.events.index("landing")]
    assert not [e for e in between if e.startswith(("sync:", "empty_cache", "ipc"))], between
    after = fake_gpu.events[fake_gpu.events.index("landing") :]
    # the staging's release (its IPC leftovers too) is the landing's: one for both
    assert after.count("ipc_collect") >= 1
    assert "empty_cache" in after
    assert [e for e in fake_gpu.events if e.startswith("sync:")] == ["sync:0"]


def test_without_room_for_the_kv_cache_the_copies_land_before_its_wake(
    fake_gpu: FakeTorch,
) -> None:
    switch, log, _ = after_one_cycle(fake_gpu)
    device = fake_gpu.devices[0]
    # room for the weights (2 GiB and the margin), not for the KV cache (30 GiB) too
    device.other = device.total - device.reserved - 20 * GiB
    assert to_rollout_log(switch, log) == [*QUEUED, "barrier", "wake:kv_cache"]
    report = switch.reports[-1]
    assert report.stage("offload_land_late").free_before == report.stage("wake_kv").free_after
    switch.to_trainer()
    device.other = 1 << 30
    # the learned need came from that cycle, whose copies landed first: still 30 GiB
    assert switch._kv_need == 30 * GiB
    assert to_rollout_log(switch, log) == UNDER_KV


def test_switched_off_the_copies_always_land_before_the_kv_wake(fake_gpu: FakeTorch) -> None:
    switch, log = make(fake_gpu, kv_under_offload=False)
    for cycle in range(3):
        got = to_rollout_log(switch, log)
        assert got == [
            *(QUEUED if cycle else ["offload", *QUEUED[1:-1]]),
            "barrier",
            "wake:kv_cache",
        ]
        switch.to_trainer()
    assert switch._kv_need is None  # nothing learned for a switch that does not use it
    with pytest.raises(TypeError, match="kv_under_offload"):
        make(fake_gpu, kv_under_offload="yes")


def test_a_failed_kv_wake_under_the_copies_cancels_them_and_frees_nothing(
    fake_gpu: FakeTorch,
) -> None:
    switch, log, offloader = after_one_cycle(fake_gpu)
    offloader.left = 0
    engine = switch.engine.engine
    assert isinstance(engine, FakeVLLM)
    engine.fail = "wake:kv_cache"
    log.clear()
    with pytest.raises(Boom):
        switch.to_rollout()
    assert log[: len(UNDER_KV) - 1] == UNDER_KV[:-1]
    assert "offload:cancelled" in log
    assert "offload:landed" not in log
    assert "sleep:1" in log  # the weights (and what the KV wake took) were put back to sleep
    assert "reload" not in log  # nothing was freed: nothing to bring back
    assert not switch._copying
    assert fake_gpu.devices[0].other == 1 << 30  # the engine holds nothing
    engine.fail = ""
    assert to_rollout_log(switch, log) == UNDER_KV  # the next cycle runs
    switch.to_trainer()


def test_a_failed_late_landing_reloads_what_was_offloaded(fake_gpu: FakeTorch) -> None:
    switch, log, offloader = after_one_cycle(fake_gpu)
    offloader.fail = "land"
    log.clear()
    with pytest.raises(Boom):
        switch.to_rollout()
    assert log[: len(UNDER_KV)] == UNDER_KV
    assert "offload:cancelled" not in log  # the flight ended at finish()
    assert log.index("sleep:1") < log.index("reload")  # the engine let go first
    assert log[-1] == "reload"  # recovery brought the state back


def test_kv_need_reads_from_barrier_kv_to_after_the_last_exchange() -> None:
    def info(free: int) -> MemoryInfo:
        return MemoryInfo(0, True, free=free, total=80 * GiB)

    stages = [
        StageReport("free_staging", 0.0, info(60 * GiB), info(61 * GiB), 0.0),
        StageReport("barrier_kv", 0.0, info(61 * GiB), info(61 * GiB), 0.0),
        StageReport("wake_kv", 0.0, info(61 * GiB), info(40 * GiB), 0.0),
    ]
    report = SwitchReport("to_rollout", 0, stages)
    # another rank's wake may still have been mapping this GPU when wake_kv ended here
    assert kv_need(report, 31 * GiB) == 30 * GiB
    assert kv_need(report, 62 * GiB) == 0  # never negative
    assert kv_need(report, None) is None  # not measured
    assert kv_need(SwitchReport("to_rollout", 0, stages[:1]), 31 * GiB) is None


def test_ranks_wake_kv_only_where_each_gpu_has_room_or_landed(fake_gpu: FakeTorch) -> None:
    """Two ranks (threads): one lands before ``barrier_kv``, one under the KV wake."""
    plain = hm.BackendProfile("plain", "no allocator steps", {})
    barrier = threading.Barrier(2)
    times: dict[str, list[float]] = {"landed-0": [], "landed-1": [], "wake_kv": []}
    lock = threading.Lock()

    def switch_of(index: int) -> hm.HybridSwitch:
        # rank 1: no room for the KV cache beside its copies (as if: switched off)
        engine = KVTimed(times["wake_kv"], lock)
        return hm.HybridSwitch(
            engine,
            plain,
            LandingTimed(times[f"landed-{index}"], lock),
            barrier=barrier.wait,
            kv_under_offload=index == 0,
        )

    run_ranks(switch_of, (0, 1))
    for cycle in range(3):
        woke = times["wake_kv"][2 * cycle : 2 * cycle + 2]
        assert times["landed-1"][cycle] <= min(woke)  # landed before any rank's KV wake
        if cycle:  # from the second cycle rank 0's copies land after its KV wake
            assert times["landed-0"][cycle] >= min(woke)


def test_the_landing_after_the_kv_wake_releases_at_the_staging_s_point(
    fake_gpu: FakeTorch,
) -> None:
    """No full gc pass for the first cycle under the KV cache: like is compared with like."""
    switch, _ = make(fake_gpu)  # "adaptive"
    switch.to_rollout()  # the first cycle: a full pass at each of its release points
    switch.to_trainer()
    passes = switch.garbage.gate.full_passes
    for _ in range(3):  # then young generations only, from the first cycle under it on
        fake_gpu.events.clear()
        switch.to_rollout()
        assert switch._state.kv_under
        assert [e for e in fake_gpu.events if e.startswith("gc")] == ["gc:1"]
        switch.to_trainer()
    assert switch.garbage.gate.full_passes == passes
