"""The engine's weights woken and synced under the offload's copies (decision 86).

From the second cycle, where the device has room for what the last cycle's weight
stages took, the switch only queues the offload's copies, wakes and syncs the weights,
then frees as the copies land (``offload_land``); no release that synchronizes the
device runs in between. On the CPU: the fake seam's events and the fakes' logs.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import hybridmem as hm
from hybridmem.engine import phases
from hybridmem.engine.reports import StageReport, SwitchReport
from hybridmem.engine.switch_offload import WEIGHTS_MARGIN_BYTES, weights_need
from hybridmem.engine.switch_reload import tail_bytes
from hybridmem.memory.offload import OffloadInFlight
from hybridmem.observe.memory import MemoryInfo
from tests.conftest import FakeTorch
from tests.test_switch import AsyncSGLang, Boom, FakeOffloader, _no_wait, make

GiB = 1 << 30
QUEUED = ["offload:queued", "barrier", "wake:weights", "sync(expandable=False)", "offload:landed"]


def to_rollout_log(switch: hm.HybridSwitch, log: list[str]) -> list[str]:
    log.clear()
    switch.to_rollout()
    return list(log)


def test_from_the_second_cycle_the_weights_wake_and_sync_under_the_copies(
    fake_gpu: FakeTorch,
) -> None:
    switch, log = make(fake_gpu)
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
    fake_gpu.events.clear()
    switch.to_rollout()
    between = fake_gpu.events[fake_gpu.events.index("queued") : fake_gpu.events.index("landing")]
    assert not [e for e in between if e.startswith(("sync:", "empty_cache"))], between
    after = fake_gpu.events[fake_gpu.events.index("landing") :]
    assert "empty_cache" in after  # offload_land releases once the copies landed


def test_without_room_for_the_weights_the_offload_finishes_first(fake_gpu: FakeTorch) -> None:
    switch, log = make(fake_gpu)
    switch.to_rollout()
    switch.to_trainer()
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
    switch, log = make(fake_gpu)
    switch.to_rollout()
    switch.to_trainer()
    offloader = switch.offloader
    assert isinstance(offloader, FakeOffloader)
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
    switch, log = make(fake_gpu)
    switch.to_rollout()
    switch.to_trainer()
    offloader = switch.offloader
    assert isinstance(offloader, FakeOffloader)
    offloader.fail = "land"
    log.clear()
    with pytest.raises(Boom):
        switch.to_rollout()
    assert "offload:landed" in log
    assert "offload:cancelled" not in log  # the flight ended at finish()
    assert log[-1] == "reload"  # recovery brought the state back


def test_the_reload_tail_is_sized_by_the_offloads_own_seconds() -> None:
    info = MemoryInfo(0, True, free=1 << 40, total=1 << 40)
    stages = [StageReport("offload", 0.001, info, info, 0.0)]
    window = [StageReport(name, 0.1, info, info, 0.0) for name in ("sleep", "confirm")]
    reports = [SwitchReport("to_rollout", 0, stages), SwitchReport("to_trainer", 0, window)]
    queued_only = tail_bytes(reports, 10 * GiB)  # the stage: 1 ms, as if the copies were free
    assert queued_only == 10 * GiB
    assert tail_bytes(reports, 10 * GiB, offload_s=1.0) == int(10 * GiB * 0.5 * 0.2)


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
        "offload:landed",
        "resume:kv_cache",
    ]
    assert switch.offload_report is not None
