"""HybridSwitch's reload: queued before the engine's sleep when the device has room.

The fake device (tests/conftest.py) has 80 GiB, the fake vLLM engine holds 32 GiB
while awake, so 37 GiB are free during rollout; the fake Offloader logs whether a
reload was queued (``non_blocking``) or blocking. The GPU bench measures the effect.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import hybridmem as hm
from hybridmem.engine.switch_reload import early_margin, trainer_allocation
from hybridmem.scopes.allocator import ExpandableSegments
from hybridmem.scopes.profiles import Step
from hybridmem.scopes.registry import get_backend
from tests.conftest import FakeTorch
from tests.test_switch import AsyncSGLang, Boom, FakeOffloader, FakeVLLM

GiB = 1 << 30


class RefusingOffloader(FakeOffloader):
    """Refuses a feed as the Offloader does (what was not fed is intact and offloaded)."""

    def start_reload(self, groups: Any = None, **kw: Any) -> Any:
        self.log.append("reload:refused")
        raise hm.OffloadError("reload feed could not allocate optimizer (OutOfMemoryError)")


def switch_for(
    fake: FakeTorch, need: int, offloader: type[FakeOffloader] = FakeOffloader, **kw: Any
) -> tuple[hm.HybridSwitch, list[str]]:
    """A switch over the fake engine; ``reload_early`` on unless ``kw`` says (...: unset)."""
    if kw.setdefault("reload_early", True) is Ellipsis:
        del kw["reload_early"]  # the constructor's default
    kw.setdefault("barrier", None)
    log: list[str] = []
    switch = hm.HybridSwitch(
        hm.VLLMEngine(FakeVLLM(log, fake)),
        "vllm",
        offloader(log, need=need),
        confirm_timeout_s=0.0,
        **kw,
    )
    return switch, log


def cycle(switch: hm.HybridSwitch) -> None:
    with switch.rollout():
        pass


def test_with_room_the_reload_is_queued_before_the_sleep_and_waited_for(
    fake_gpu: FakeTorch,
) -> None:
    switch, log = switch_for(fake_gpu, need=4 * GiB)
    cycle(switch)
    # fed first, then the sleep; the reload stage finishes the feed (the rest by kernel)
    assert log[-3:] == ["reload:queued", "sleep:1", "reload:finish:kernel"]
    cycle(switch)
    assert log.count("reload") == 0  # never a second, blocking reload
    report = switch.reports[-1]
    assert [s.name for s in report.stages][-1] == "reload"


def test_without_room_the_reload_waits_for_the_sleep(fake_gpu: FakeTorch) -> None:
    switch, log = switch_for(fake_gpu, need=GiB)
    offloader = switch.offloader
    assert isinstance(offloader, FakeOffloader)
    with switch.rollout():
        free = hm.memory_info(0).free
        assert free is not None
        offloader.need = free  # fits, but without the margin
    assert log[-2:] == ["sleep:1", "reload"]


def test_reload_early_false_always_waits_for_the_sleep(fake_gpu: FakeTorch) -> None:
    switch, log = switch_for(fake_gpu, need=GiB, reload_early=False)
    cycle(switch)
    assert log[-2:] == ["sleep:1", "reload"]
    assert switch.reload_early is False


def test_a_refused_early_reload_reloads_after_the_sleep(
    fake_gpu: FakeTorch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="hybridmem")
    switch, log = switch_for(fake_gpu, need=GiB, offloader=RefusingOffloader)
    cycle(switch)
    assert log[-3:] == ["reload:refused", "sleep:1", "reload"]
    assert "early reload refused" in caplog.text
    assert switch.reports[-1].stage("reload") is not None


def test_nothing_offloaded_means_nothing_to_queue(fake_gpu: FakeTorch) -> None:
    switch, log = switch_for(fake_gpu, need=0)
    cycle(switch)
    assert "reload:queued" not in log
    assert log[-2:] == ["sleep:1", "reload"]


def test_the_async_driver_queues_it_too(
    fake_gpu: FakeTorch, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybridmem.scopes import phases

    async def no_wait(device: Any, timeout_s: float, enough: Any = None) -> None:
        return None

    monkeypatch.setattr(phases, "await_free_async", no_wait)
    log: list[str] = []
    offloader = FakeOffloader(log, need=GiB)
    switch = hm.HybridSwitch(AsyncSGLang(log), "sglang", offloader, barrier=None, reload_early=True)

    async def main() -> None:
        async with switch.rollout():
            pass

    asyncio.run(main())
    assert log[-3:] == ["reload:queued", "release_memory_occupation", "reload:finish:kernel"]


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_reload_early_must_be_a_bool(fake_gpu: FakeTorch, bad: object) -> None:
    with pytest.raises(TypeError, match="reload_early must be True or False"):
        switch_for(fake_gpu, need=0, reload_early=bad)


def test_the_margin_is_256_mib_or_a_32nd() -> None:
    assert early_margin(0) == 256 << 20
    assert early_margin(4 * GiB) == 256 << 20
    assert early_margin(64 * GiB) == 2 * GiB


def test_it_is_on_by_default(fake_gpu: FakeTorch) -> None:
    switch, log = switch_for(fake_gpu, need=GiB, reload_early=...)
    assert switch.reload_early is True
    cycle(switch)
    assert log[-3:] == ["reload:queued", "sleep:1", "reload:finish:kernel"]
    assert "reload" not in log  # the feed was finished, never repeated


def test_a_sleep_that_fails_after_queueing_never_skips_a_later_reload(
    fake_gpu: FakeTorch,
) -> None:
    switch, log = switch_for(fake_gpu, need=GiB)
    engine = switch.engine
    assert isinstance(engine, hm.VLLMEngine)
    fake_engine = engine.engine
    assert isinstance(fake_engine, FakeVLLM)
    fake_engine.fail = "sleep"
    with pytest.raises(hm.HybridSwitchError), switch.rollout():
        pass
    assert "reload:queued" in log  # queued, then the sleep failed: never waited for
    fake_engine.fail = ""
    switch.reload_early = False  # the next cycle reloads after the sleep
    log.clear()
    cycle(switch)
    assert log[-2:] == ["sleep:1", "reload"]  # brought back, not taken for queued


@pytest.mark.parametrize(
    ("other_device", "early"), [("GPU-a", False), ("GPU-b", True), (None, True)]
)
def test_a_gpu_shared_with_another_ranks_switch_never_reloads_early(
    fake_gpu: FakeTorch, monkeypatch: pytest.MonkeyPatch, other_device: str | None, early: bool
) -> None:
    """Another rank's engine on this GPU may still generate: the reload waits for it."""
    from hybridmem import _torch
    from hybridmem.engine.ranks import RankStatus

    monkeypatch.setattr(_torch, "device_uuid", lambda index: "GPU-a")
    seen: list[RankStatus] = []

    class TwoRanks:
        def exchange(self, status: RankStatus) -> list[RankStatus]:
            seen.append(status)
            other = RankStatus(1, status.cycle, status.point, True, device=other_device)
            return [status, other]

    switch, log = switch_for(fake_gpu, need=GiB, barrier=TwoRanks())
    for _ in range(2):
        cycle(switch)
        assert ("reload:queued" in log) is early
        assert ("reload" in log) is not early  # else after every rank's engine slept
        log.clear()
    assert {s.device for s in seen} == {"GPU-a"}  # each status names this rank's GPU


class ModeOffloader(FakeOffloader):
    """Logs the allocator settings each reload allocates under (the fake seam's last)."""

    fake: FakeTorch

    def reload(self, groups: Any = None, **kw: Any) -> Any:
        self.log.append(f"mode:{self.fake.last}")
        return super().reload(groups, **kw)

    def start_reload(self, groups: Any = None, **kw: Any) -> Any:
        self.log.append(f"mode:{self.fake.last}")
        return super().start_reload(groups, **kw)


def mode_switch(fake: FakeTorch, need: int, backend: Any = "vllm") -> tuple[Any, list[str]]:
    log: list[str] = []
    offloader = ModeOffloader(log, need=need)
    offloader.fake = fake
    switch = hm.HybridSwitch(
        hm.VLLMEngine(FakeVLLM(log, fake)),
        backend,
        offloader,
        barrier=None,
        confirm_timeout_s=0.0,
    )
    return switch, log


@pytest.mark.parametrize(("need", "reload"), [(4 * GiB, "reload:queued"), (60 * GiB, "reload")])
def test_the_state_is_reloaded_where_the_trainer_trains(
    fake_gpu: FakeTorch, need: int, reload: str
) -> None:
    # Decision 85: in the train recipe's expandable segments, early (room) or after the
    # sleep (none); then the process's classic mode is written back.
    switch, log = mode_switch(fake_gpu, need)
    assert fake_gpu.last is None  # the process runs classic segments (no env)
    cycle(switch)
    at = log.index(reload)
    assert log[at - 1] == "mode:expandable_segments:True"
    assert [e for e in log if e.startswith("mode:")] == ["mode:expandable_segments:True"]
    assert fake_gpu.applied[-2:] == ["expandable_segments:True", "expandable_segments:False"]


def test_a_backend_without_a_train_mode_reloads_in_the_process_settings(
    fake_gpu: FakeTorch,
) -> None:
    plain = hm.BackendProfile("plain-reload", "no train recipe", {})
    switch, log = mode_switch(fake_gpu, 60 * GiB, plain)
    before = fake_gpu.last
    cycle(switch)
    assert [entry for entry in log if entry.startswith("mode:")] == [f"mode:{before}"]


def test_trainer_allocation_reads_the_train_step() -> None:
    off = hm.BackendProfile(
        "classic-train",
        "trains in classic segments",
        {"train": (Step("es", "expandable_segments", "scope", {"enabled": False}),)},
    )
    scope = trainer_allocation(off)
    assert isinstance(scope, ExpandableSegments)
    assert scope.enabled is False
    assert scope._release_cache is False  # the switch has just released: no second one
    sglang = trainer_allocation(get_backend("sglang"))
    assert isinstance(sglang, ExpandableSegments)
    assert sglang.enabled is True


def test_a_failed_sleep_stops_the_feed_before_recovery(fake_gpu: FakeTorch) -> None:
    """Recovery stops a feed first: no thread copies while it decides what comes back."""
    switch, log = switch_for(fake_gpu, need=GiB)
    cycle(switch)  # one full cycle: the next reload is fed through the sleep
    engine = switch.engine
    assert isinstance(engine, hm.VLLMEngine)
    fake_engine = engine.engine
    assert isinstance(fake_engine, FakeVLLM)
    fake_engine.fail = "sleep"
    log.clear()
    with pytest.raises(hm.HybridSwitchError, match="still offloaded"):
        cycle(switch)
    assert log.index("reload:queued") < log.index("reload:stopped")
    assert "reload:finish:kernel" not in log
    fake_engine.fail = ""
    log.clear()
    cycle(switch)  # the rest still comes back
    assert log[-3:] == ["reload:queued", "sleep:1", "reload:finish:kernel"]


def test_a_failed_finish_is_recovered_by_a_reload_after_the_sleep(fake_gpu: FakeTorch) -> None:
    switch, log = switch_for(fake_gpu, need=GiB)
    offloader = switch.offloader
    assert isinstance(offloader, FakeOffloader)
    offloader.fail = "finish"
    with pytest.raises(Boom):
        cycle(switch)
    # the feed was ended by its failed finish; recovery reloads what it left
    assert log[-2:] == ["reload:finish:kernel", "reload"]
    assert offloader.left == 0
