"""The wait after the engine's sleep ends once free memory is back where the last sleep took it.

The fake SGLang engine's release lands over the next readings of free memory (its
``release_memory_occupation`` returns before the scheduler has freed, as SGLang's
can): the first cycle waits for free memory to settle (three equal readings), the
next ends at the reading that shows everything back, never before it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import hybridmem as hm
from hybridmem import _torch
from hybridmem.engine.switch_settle import SETTLE_SLACK_BYTES, EngineReturn
from hybridmem.observe.memory import MemoryInfo
from hybridmem.scopes import phases
from tests.conftest import FakeTorch

GiB = 1 << 30


class LateSGLang:
    """SGLang's sync API over the fake device; a release lands over ``steps`` readings."""

    def __init__(self, fake: FakeTorch, steps: int = 3) -> None:
        self.fake = fake
        self.steps = steps
        self.held = 0
        self.kv = 30 * GiB
        self.pending: list[int] = []
        self.readings = 0  # of free memory
        self.waited: list[int] = []  # readings in each wait for free memory
        self.waiting = False  # the parts land during the waits (the stages read too)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        size = 2 * GiB if tags == ["weights"] else self.kv
        self.fake.devices[0].other += size
        self.held += size

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        share = self.held // self.steps
        self.pending = [share] * (self.steps - 1) + [self.held - share * (self.steps - 1)]
        self.held = 0

    def read(self, index: int) -> tuple[int, int]:
        self.readings += 1
        if self.pending and self.waiting:  # the scheduler frees a part between two readings
            self.fake.devices[0].other -= self.pending.pop(0)
        return self.fake.mem_get_info(index)


def late_switch(
    fake: FakeTorch, monkeypatch: pytest.MonkeyPatch, **kw: Any
) -> tuple[hm.HybridSwitch, LateSGLang]:
    """A switch over :class:`LateSGLang`; ``engine.waited`` counts the readings of each wait."""
    engine = LateSGLang(fake)
    monkeypatch.setattr(_torch, "mem_get_info", engine.read)
    monkeypatch.setattr(phases, "POLL_S", 0.0)  # the readings, not the clock, are tested
    wait, wait_async = phases.await_free, phases.await_free_async

    def counted(*args: Any, **kw: Any) -> Any:
        before, engine.waiting = engine.readings, True
        result = wait(*args, **kw)
        engine.waited.append(engine.readings - before)
        engine.waiting = False
        return result

    async def counted_async(*args: Any) -> None:
        before, engine.waiting = engine.readings, True
        await wait_async(*args)
        engine.waited.append(engine.readings - before)
        engine.waiting = False

    monkeypatch.setattr(phases, "await_free", counted)
    monkeypatch.setattr(phases, "await_free_async", counted_async)
    switch = hm.HybridSwitch(engine, "sglang", barrier=None, confirm_timeout_s=5.0, **kw)
    return switch, engine


def run_cycle(switch: hm.HybridSwitch, driver: str) -> None:
    if driver == "sync":
        with switch.rollout():
            pass
        return

    async def main() -> None:
        async with switch.rollout():
            pass

    asyncio.run(main())


@pytest.mark.parametrize("driver", ["sync", "async"])
def test_the_second_wait_ends_when_memory_is_back_not_later_not_sooner(
    fake_gpu: FakeTorch, monkeypatch: pytest.MonkeyPatch, driver: str
) -> None:
    switch, engine = late_switch(fake_gpu, monkeypatch)
    baseline = fake_gpu.devices[0].other  # the engine's part of the device
    run_cycle(switch, driver)
    [first] = engine.waited
    assert fake_gpu.devices[0].other == baseline  # everything came back
    assert switch._returns.freed == 32 * GiB
    assert first == engine.steps + 2  # settled: three equal readings after the last part
    run_cycle(switch, driver)
    second = engine.waited[-1]
    assert not engine.pending  # the wait did not end before the last part landed
    assert fake_gpu.devices[0].other == baseline
    assert second == engine.steps  # the reading that showed the last part ended it
    assert switch.reports[-1].stage("confirm") is not None


def test_a_sleep_that_gives_back_less_waits_for_settling_and_is_not_learned(
    fake_gpu: FakeTorch, monkeypatch: pytest.MonkeyPatch
) -> None:
    switch, engine = late_switch(fake_gpu, monkeypatch)
    run_cycle(switch, "sync")
    engine.kv -= 2 * GiB  # this time the engine holds (and gives back) less
    run_cycle(switch, "sync")
    assert engine.waited == [engine.steps + 2] * 2  # settled again, as the first time
    assert switch._returns.freed == 32 * GiB  # never lowered (EngineReturn's docstring)


def test_another_rank_on_the_gpu_means_settling(
    fake_gpu: FakeTorch, monkeypatch: pytest.MonkeyPatch
) -> None:
    switch, engine = late_switch(fake_gpu, monkeypatch)
    run_cycle(switch, "sync")
    switch._shared_device = True  # as the rank exchange finds it
    run_cycle(switch, "sync")
    assert engine.waited == [engine.steps + 2] * 2


def info(free: int | None, reserved: int = 0) -> MemoryInfo:
    return MemoryInfo(0, free is not None, reserved=reserved, free=free, total=80 * GiB)


def test_engine_return_learns_the_most_and_counts_out_its_own_release() -> None:
    returns = EngineReturn()
    assert returns.mark(info(10 * GiB, reserved=4 * GiB), shared=False) is None
    # 40 GiB came back from the engine; this process released 3 GiB of its own cache
    returns.learn(info(53 * GiB, reserved=GiB))
    assert returns.freed == 40 * GiB
    assert returns.mark(info(12 * GiB), shared=False) == 52 * GiB - SETTLE_SLACK_BYTES
    returns.learn(info(30 * GiB))  # less came back: not learned
    assert returns.freed == 40 * GiB
    assert returns.mark(info(5 * GiB), shared=True) is None
    returns.learn(info(3 * GiB))  # free memory fell (another process took it): nothing
    assert returns.freed == 40 * GiB
    assert returns.mark(info(None), shared=False) is None  # no context: nothing to read
    returns.learn(info(70 * GiB))  # no mark to compare with
    assert returns.freed == 40 * GiB
    returns.learn(info(None))
    assert returns.freed == 40 * GiB


def test_await_free_ends_at_enough(monkeypatch: pytest.MonkeyPatch) -> None:
    readings = iter([1, 5, 9, 9, 9, 9])
    seen: list[int] = []

    def read(index: int) -> tuple[int, int]:
        seen.append(next(readings))
        return seen[-1] << 30, 80 << 30

    monkeypatch.setattr(_torch, "current_device", lambda: 0)
    monkeypatch.setattr(_torch, "mem_get_info", read)
    monkeypatch.setattr(phases, "POLL_S", 0.0)
    free, _ = phases.await_free(timeout_s=5, enough=5 << 30)
    assert (free, seen) == (5 << 30, [1, 5])
    seen.clear()
    readings = iter([9, 9, 9, 9])
    free, _ = phases.await_free(timeout_s=5, enough=0)  # the first reading ends it
    assert seen == [9]


@pytest.mark.parametrize(
    ("value", "error"), [(-1, ValueError), (1.5, TypeError), (True, TypeError), ("1", TypeError)]
)
def test_enough_is_checked_where_it_is_given(value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="enough"):
        phases.await_free(timeout_s=1, enough=value)  # type: ignore[arg-type]
