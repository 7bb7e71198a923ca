"""HybridSwitch with fake engines: staged order, failures in every stage, async, ranks."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

import hybridmem as hm
from hybridmem.engine.ranks import RankStatus
from hybridmem.engine.reports import StageReport, SwitchReport
from hybridmem.memory.offload import OffloadInFlight, OffloadReport
from hybridmem.observe.memory import MemoryInfo
from hybridmem.scopes import phases
from tests.conftest import FakeTorch, fail_resizes

GiB = 1 << 30


class Boom(RuntimeError):
    pass


class FakeVLLM:
    """Records calls; moves fake device memory like a sleeping/waking engine."""

    def __init__(self, log: list[str], fake: FakeTorch, fail: str = "") -> None:
        self.log = log
        self.fake = fake
        self.fail = fail
        self.held = 0

    def _dev(self) -> Any:
        return self.fake.devices[0]

    def sleep(self, level: int = 1) -> None:
        self.log.append(f"sleep:{level}")
        if self.fail == "sleep":
            raise Boom("sleep")
        self._dev().other -= self.held
        self.held = 0

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.log.append(f"wake:{','.join(tags or ['all'])}")
        if self.fail == f"wake:{tags[0] if tags else 'all'}":
            raise Boom("wake")
        size = 2 * GiB if tags == ["weights"] else 30 * GiB
        self._dev().other += size
        self.held += size


class FakeOffloader(hm.Offloader):
    """Logs its moves; a reload with ``max_bytes`` below ``host_bytes`` leaves some offloaded."""

    host_bytes = 0  # no pool

    def __init__(self, log: list[str], fail: str = "", need: int = 0) -> None:  # no targets
        self.log = log
        self.fail = fail
        self.need = need
        self.left = 0  # bytes still offloaded

    @property
    def offloaded_groups(self) -> frozenset[str]:
        return frozenset({"optimizer"} if self.left else ())

    def reload_bytes(self, groups: Any = None) -> int:
        return self.need

    def offload(self, groups: Any = None, **kw: Any) -> Any:
        self.log.append("offload")
        self.left = max(self.host_bytes, 1)  # before: a failed offload may have moved some
        if self.fail == "offload":
            raise Boom("offload")
        return OffloadReport.of("offload", [], time.perf_counter(), 0, None)

    def start_offload(self, groups: Any = None, **kw: Any) -> Any:
        """The copies queued (weights under them); finish or cancel logs what ran."""
        self.log.append("offload:queued")
        if self.fail == "offload":
            raise Boom("offload")

        def finish() -> Any:
            self.log.append("offload:landed")
            self.left = max(self.host_bytes, 1)
            if self.fail == "land":
                raise Boom("land")
            return OffloadReport.of("offload", [], time.perf_counter(), 0, None)

        return OffloadInFlight(finish, lambda: self.log.append("offload:cancelled"))

    def reload(self, groups: Any = None, **kw: Any) -> Any:
        head = kw.get("max_bytes") is not None
        self.log.append(
            "reload:queued" if kw.get("non_blocking") else ("reload:head" if head else "reload")
        )
        if self.fail == "reload":
            raise Boom("reload")
        self.left = max(0, self.left - kw["max_bytes"]) if head else 0

    def start_reload(self, groups: Any = None, **kw: Any) -> Any:
        """A feed through the sleep: its finish or stop logs what ended it."""
        self.log.append("reload:queued")
        if self.fail == "reload":
            raise Boom("reload")
        return FakeFeed(self)


class FakeFeed:
    """The fake Offloader's :class:`~hybridmem.memory.reload_feed.ReloadFeed`."""

    def __init__(self, offloader: FakeOffloader) -> None:
        self.offloader = offloader
        self.pending = True

    def finish(self, by: str = "kernel", **kw: Any) -> None:
        self.offloader.log.append(f"reload:finish:{by}")
        if self.offloader.fail == "finish":
            raise Boom("finish")
        self.offloader.left = 0
        self.pending = False

    def stop(self, **kw: Any) -> None:
        self.offloader.log.append("reload:stopped")
        self.pending = False


def make(
    fake: FakeTorch, *, fail: str = "", backend: str = "vllm", **kw: Any
) -> tuple[hm.HybridSwitch, list[str]]:
    log: list[str] = []
    engine = hm.VLLMEngine(FakeVLLM(log, fake, fail))

    def sync(adapter: hm.EngineAdapter) -> None:
        log.append(f"sync(expandable={hm.allocator_state().expandable_segments})")
        if fail == "sync":
            raise Boom("sync")

    def barrier() -> None:
        log.append("barrier")
        if fail == "barrier":
            raise Boom("barrier")

    switch = hm.HybridSwitch(
        engine,
        backend,
        FakeOffloader(log, fail),
        sync_weights=sync,
        barrier=barrier,
        confirm_timeout_s=0.0,
        **kw,
    )
    return switch, log


@pytest.fixture
def trainer(fake_gpu: FakeTorch) -> FakeTorch:
    """A trainer with expandable segments on (its own phase)."""
    return fake_gpu


def test_staged_order_and_allocator_state(trainer: FakeTorch) -> None:
    switch, log = make(trainer)
    with hm.expandable_segments(True):
        with switch.rollout():
            log.append(f"generate(expandable={hm.allocator_state().expandable_segments})")
        assert hm.allocator_state().expandable_segments  # trainer's mode is back
    assert log == [
        "offload",
        "barrier",
        "wake:weights",
        "sync(expandable=False)",
        "barrier",
        "wake:kv_cache",
        "generate(expandable=False)",
        "sleep:1",
        "barrier",
        "reload",
    ]
    to_rollout, to_trainer = switch.reports
    assert [s.name for s in to_rollout.stages] == [
        "offload",
        "release",
        "barrier",
        "wake_weights",
        "weight_sync",
        "offload_land",
        "free_staging",
        "barrier_kv",
        "wake_kv",
        "offload_land_late",
        "rollout",
    ]
    assert [s.name for s in to_trainer.stages] == [
        "reload_early",
        "sleep",
        "confirm",
        "release",
        "barrier_reload",
        "reload",
    ]
    # memory at the boundaries: the engine took 32 GiB and gave it back
    wake_kv, sleep = to_rollout.stage("wake_kv"), to_trainer.stage("sleep")
    assert wake_kv.free_before is not None
    assert wake_kv.free_after is not None
    assert sleep.free_before is not None
    assert sleep.free_after is not None
    assert wake_kv.free_before - wake_kv.free_after == 30 * GiB
    assert sleep.free_after - sleep.free_before == 32 * GiB
    assert to_rollout.rank == 0
    assert "rank 0 to_rollout" in str(to_rollout)


STAGE_FAILURES = ["offload", "barrier", "wake:weights", "sync", "wake:kv_cache"]


@pytest.mark.parametrize("fail", STAGE_FAILURES)
def test_failure_in_any_stage_returns_to_the_trainer_phase(trainer: FakeTorch, fail: str) -> None:
    switch, log = make(trainer, fail=fail)
    engine_before = trainer.devices[0].other
    with hm.expandable_segments(True):
        with pytest.raises(Boom), switch.rollout():
            log.append("generate")
        assert hm.allocator_state().expandable_segments
        assert hm.allocator_state().scopes == ("expandable_segments(True)",)
    assert "generate" not in log
    woke = any(e.startswith("wake") for e in log)
    assert (log.count("sleep:1") == 1) == woke  # asleep again if it ever woke
    assert log[-1] == "reload" or log == ["offload"]
    assert trainer.devices[0].other == engine_before  # every byte the engine took is back


def test_usable_again_after_a_failure(trainer: FakeTorch) -> None:
    switch, log = make(trainer, fail="wake:kv_cache")
    with pytest.raises(Boom), switch.rollout():
        pass
    fake_engine = switch.engine.engine
    assert isinstance(fake_engine, FakeVLLM)
    fake_engine.fail = ""
    with switch.rollout():
        log.append("generate")
    assert log[-5:] == ["wake:kv_cache", "generate", "sleep:1", "barrier", "reload"]


def test_failure_in_the_rollout_body(trainer: FakeTorch) -> None:
    switch, log = make(trainer)
    with pytest.raises(Boom), switch.rollout():
        raise Boom("generate")
    assert log[-2:] == ["sleep:1", "reload"]
    assert hm.allocator_state().scopes == ()


def test_failed_recovery_says_what_remains(trainer: FakeTorch) -> None:
    switch, _ = make(trainer, fail="sleep")
    with pytest.raises(hm.HybridSwitchError) as info, switch.rollout():
        raise Boom("generate")
    message = str(info.value)
    assert "the engine is still awake (weights, kv_cache)" in message
    assert "trainer state is still offloaded" in message
    assert "Allocator settings are restored" in message
    assert isinstance(info.value.__cause__, Boom)
    assert hm.allocator_state().scopes == ()


def test_failed_reload_is_reported(trainer: FakeTorch) -> None:
    switch, _ = make(trainer, fail="reload")
    with pytest.raises(hm.HybridSwitchError, match="reload failed"), switch.rollout():
        pass


def test_switches_do_not_nest(trainer: FakeTorch) -> None:
    switch, _ = make(trainer)
    with switch.rollout(), pytest.raises(RuntimeError, match="do not nest"), switch.rollout():
        pass


class AsyncSGLang:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        await asyncio.sleep(0)
        self.log.append("release_memory_occupation")

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        await asyncio.sleep(0)
        self.log.append(f"resume:{','.join(tags or [])}")


def test_async_engine(trainer: FakeTorch, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(phases, "await_free_async", _no_wait)
    log: list[str] = []

    async def sync(adapter: hm.EngineAdapter) -> None:
        await asyncio.sleep(0)
        log.append("sync")

    switch = hm.HybridSwitch(
        AsyncSGLang(log), "sglang", sync_weights=sync, barrier=None, confirm_timeout_s=0.0
    )
    assert isinstance(switch.engine, hm.SGLangEngine)

    async def main() -> None:
        async with switch.rollout():
            log.append("generate")

    asyncio.run(main())
    assert log == [
        "resume:weights",
        "sync",
        "resume:kv_cache",
        "generate",
        "release_memory_occupation",
    ]
    with pytest.raises(TypeError, match="is async: use the async API"), switch.rollout():
        pass
    assert hm.allocator_state().scopes == ()


async def _no_wait(device: Any, timeout_s: float, enough: Any = None) -> None:
    return None


def test_async_failure_puts_the_engine_to_sleep(trainer: FakeTorch) -> None:
    log: list[str] = []
    engine = AsyncSGLang(log)

    async def sync(adapter: hm.EngineAdapter) -> None:
        raise Boom("sync")

    switch = hm.HybridSwitch(engine, "sglang", sync_weights=sync, barrier=None)

    async def main() -> None:
        async with switch.rollout():
            log.append("generate")

    with pytest.raises(Boom):
        asyncio.run(main())
    assert log == ["resume:weights", "release_memory_occupation"]


class KVTimed(hm.EngineAdapter):
    """An engine that notes the time of each KV-cache wake (the rank tests' threads)."""

    def __init__(self, woke: list[float], lock: threading.Lock) -> None:
        super().__init__(object(), ())
        self.woke = woke
        self.lock = lock

    def sleep(self) -> None:
        return None

    def wake_up(self, tags: Any) -> None:
        if list(tags) == ["kv_cache"]:
            with self.lock:
                self.woke.append(time.monotonic())


class LandingTimed(FakeOffloader):
    """An offloader that notes the time its copies landed, ``delay`` seconds after the call."""

    def __init__(self, landed: list[float], lock: threading.Lock, delay: float = 0.0) -> None:
        super().__init__([])
        self.landed = landed
        self.lock = lock
        self.delay = delay

    def offload(self, groups: Any = None, **kw: Any) -> Any:
        time.sleep(self.delay)  # one rank slow to offload (the other waits at the barrier)
        with self.lock:
            self.landed.append(time.monotonic())

    def start_offload(self, groups: Any = None, **kw: Any) -> Any:
        # Under the weights (and the KV cache): it lands at offload_land(_late).
        return OffloadInFlight(lambda: self.offload(), lambda: None)


def run_ranks(switch_of: Callable[[Any], hm.HybridSwitch], ranks: Sequence[Any]) -> None:
    """Three cycles of ``switch_of(rank)``'s switch per rank, a thread each; re-raises."""
    failed: list[BaseException] = []

    def rank(arg: Any) -> None:
        try:
            switch = switch_of(arg)
            for _ in range(3):
                with switch.rollout():
                    pass
        except BaseException as exc:  # a rank that failed must fail the test
            failed.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed:
        raise failed[0]


def test_ranks_never_wake_kv_before_every_rank_offloaded(fake_gpu: FakeTorch) -> None:
    """Two ranks (threads), one slow to offload: nobody wakes its KV cache before it is done."""
    plain = hm.BackendProfile("plain", "no allocator steps", {})
    barrier = threading.Barrier(2)
    times: dict[str, list[float]] = {"offload_done": [], "wake_kv": []}
    lock = threading.Lock()

    def switch_of(delay: float) -> hm.HybridSwitch:
        # Each rank without room for the KV cache beside its copies (decision 89 lets
        # a rank with room land after the KV wake: tests/test_switch_offload.py).
        engine = KVTimed(times["wake_kv"], lock)
        return hm.HybridSwitch(
            engine,
            plain,
            LandingTimed(times["offload_done"], lock, delay),
            barrier=barrier.wait,
            kv_under_offload=False,
        )

    run_ranks(switch_of, (0.0, 0.05))
    for cycle in range(3):
        done = times["offload_done"][2 * cycle : 2 * cycle + 2]
        woke = times["wake_kv"][2 * cycle : 2 * cycle + 2]
        assert max(done) <= min(woke)


def test_rank_from_env(trainer: FakeTorch, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    switch, _ = make(trainer)
    assert switch.rank == 3
    with switch.rollout():
        pass
    assert all(r.rank == 3 for r in switch.reports)


def test_auto_barrier_without_distributed(trainer: FakeTorch) -> None:
    switch = hm.HybridSwitch(hm.VLLMEngine(FakeVLLM([], trainer)), "vllm")
    assert switch.barrier is None


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"engine": object(), "backend": "vllm"}, TypeError, "lacks sleep, wake_up"),
        ({"engine": object(), "backend": "default"}, TypeError, "wrap the engine in an adapter"),
        ({"backend": "nope"}, ValueError, "unknown backend"),
        ({"offloader": "x"}, TypeError, "offloader must be an hm.Offloader"),
        ({"sync_weights": 3}, TypeError, "sync_weights must be callable"),
        ({"barrier": "always"}, TypeError, "barrier must be 'auto', None, a callable or a Rank"),
        (
            {"confirm_timeout_s": -1},
            ValueError,
            "confirm_timeout_s must be a number of seconds >= 0",
        ),
        ({"confirm_timeout_s": True}, TypeError, "confirm_timeout_s must be a number"),
    ],
)
def test_bad_arguments(
    trainer: FakeTorch, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    args: dict[str, Any] = {"engine": hm.VLLMEngine(FakeVLLM([], trainer)), "backend": "vllm"}
    args.update(kwargs)
    with pytest.raises(error, match=match):
        hm.HybridSwitch(args.pop("engine"), args.pop("backend"), **args)


def test_vllm_adapter() -> None:
    log: list[str] = []

    class Old:  # a vLLM whose wake_up takes no tags
        def sleep(self, level: int) -> None:
            log.append(f"sleep:{level}")

        def wake_up(self) -> None:
            log.append("wake")

    adapter = hm.VLLMEngine(Old(), level=2)
    adapter.wake_up(["weights"])
    adapter.wake_up(["kv_cache"])  # already awake: nothing
    adapter.sleep()
    adapter.wake_up(["weights"])
    assert log == ["wake", "sleep:2", "wake"]
    with pytest.raises(ValueError, match="level must be 0, 1 or 2"):
        hm.VLLMEngine(Old(), level=3)
    with pytest.raises(ValueError, match="tags must be a non-empty subset"):
        adapter.wake_up(["everything"])
    with pytest.raises(TypeError, match="not the string 'weights'"):
        adapter.wake_up("weights")


@pytest.mark.parametrize("level", [1, 2])
def test_vllm_adapter_keeps_the_lifecycle_in_order_once_it_slept_the_engine(
    level: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Sleep twice or wake a tag twice: no call reaches vLLM; failed calls are retried."""
    import logging

    caplog.set_level(logging.INFO, logger="hybridmem")
    log: list[str] = []
    fail: list[str] = []

    class Engine:
        def sleep(self, level: int = 1) -> None:
            if "sleep" in fail:
                fail.remove("sleep")
                raise Boom("sleep")
            log.append(f"sleep:{level}")

        def wake_up(self, tags: list[str] | None = None) -> None:
            if "wake" in fail:
                fail.remove("wake")
                raise Boom("wake")
            log.append(f"wake:{','.join(tags or [])}")

    adapter = hm.VLLMEngine(Engine(), level=level)
    adapter.wake_up(["weights"])  # never slept through the adapter: passed through
    adapter.wake_up(["weights"])
    adapter.sleep()
    assert adapter.sleep() is None  # asleep already: nothing reaches vLLM
    adapter.wake_up(["weights"])
    assert adapter.wake_up(["weights"]) is None  # woken already since that sleep
    adapter.wake_up(["weights", "kv_cache"])  # only what still sleeps
    fail.append("sleep")
    with pytest.raises(Boom):
        adapter.sleep()
    adapter.sleep()  # the failed sleep changed nothing: this one goes through
    fail.append("wake")
    with pytest.raises(Boom):
        adapter.wake_up(["weights"])
    adapter.wake_up(["weights"])  # the failed wake is retried
    assert log == [
        "wake:weights",
        "wake:weights",
        f"sleep:{level}",
        "wake:weights",
        "wake:kv_cache",
        f"sleep:{level}",
        "wake:weights",
    ]
    said = [r.getMessage() for r in caplog.records]
    assert any("asleep already; sleep() does nothing" in m for m in said)
    assert any("woke already since the last sleep" in m for m in said)


@pytest.mark.parametrize("level", [0, 1, 2])
def test_vllm_adapter_refuses_to_generate_while_it_has_the_engine_asleep(level: int) -> None:
    """Before vLLM is called; once both tags woke, generate passes through."""
    log: list[str] = []

    class Engine:
        def sleep(self, level: int = 1) -> None:
            log.append("sleep")

        def wake_up(self, tags: list[str] | None = None) -> None:
            log.append(f"wake:{','.join(tags or [])}")

        def generate(self, prompts: list[str], params: object = None) -> list[str]:
            log.append("generate")
            return [p.upper() for p in prompts]

    adapter = hm.VLLMEngine(Engine(), level=level)
    assert adapter.generate(["a"]) == ["A"]  # never slept through the adapter
    adapter.sleep()
    with pytest.raises(hm.EngineAsleepError, match=r"weights, kv_cache sleep .*at level") as info:
        adapter.generate(["b"])
    assert ("syncing the weights" in str(info.value)) == (level == 2)
    adapter.wake_up(["weights"])
    with pytest.raises(hm.EngineAsleepError, match=r"kv_cache sleeps .*wake_up\(\['kv_cache'\]\)"):
        adapter.generate(["b"])
    adapter.wake_up(["kv_cache"])
    assert adapter.generate(["c"], params=None) == ["C"]
    assert log.count("generate") == 2  # the refused calls never reached vLLM


def test_vllm_adapter_level_0_pauses_scheduling_only() -> None:
    """Level 0 moves no memory: the weights stage does nothing, the last one resumes."""
    log: list[object] = []

    class Paused:
        def sleep(self, level: int = 1) -> None:
            log.append(("sleep", level))

        def wake_up(self, tags: list[str] | None = None) -> bool:
            log.append(("wake", tags))
            return True

    adapter = hm.VLLMEngine(Paused(), level=0)
    adapter.sleep()
    assert adapter.wake_up(["weights"]) is None
    adapter.wake_up(["kv_cache"])
    adapter.wake_up(["scheduling"])
    assert log == [("sleep", 0), ("wake", ["scheduling"]), ("wake", ["scheduling"])]
    # Levels 1 and 2 pass vLLM's tags through, "scheduling" included.
    staged = hm.VLLMEngine(Paused(), level=1)
    staged.wake_up(["scheduling"])
    assert log[-1] == ("wake", ["scheduling"])


def test_sglang_adapter_without_tags() -> None:
    log: list[str] = []

    class Old:
        def release_memory_occupation(self) -> None:
            log.append("release")

        def resume_memory_occupation(self) -> None:
            log.append("resume")

    adapter = hm.SGLangEngine(Old())
    adapter.wake_up(["weights"])
    adapter.wake_up(["kv_cache"])
    adapter.sleep()
    assert log == ["resume", "release"]
    assert "SGLangEngine(Old)" in repr(adapter)


def test_stage_report_formatting() -> None:
    before = MemoryInfo(0, True, allocated=1, reserved=2, free=10 * GiB, total=80 * GiB)
    after = MemoryInfo(0, True, allocated=1, reserved=2, free=5 * GiB, total=80 * GiB)
    stage = StageReport("wake_kv", 0.002, before, after, 0.0)
    assert "wake_kv" in str(stage)
    assert "10.00 GiB -> 5.00 GiB" in str(stage)
    none = MemoryInfo(None, False)
    assert "no device" in str(StageReport("x", 0.0, none, none, 0.0))
    report = SwitchReport("to_rollout", 0, [stage])
    with pytest.raises(KeyError, match="no stage 'sleep'"):
        report.stage("sleep")


def test_switch_collects_young_generations_and_a_full_pass_only_when_memory_stays(
    trainer: FakeTorch,
) -> None:
    # The KV cache after the copies landed: two release points to rollout (with it under
    # them, one: tests/test_switch_offload.py).
    switch, _ = make(trainer, kv_under_offload=False)  # the default: "adaptive"
    assert switch.garbage.mode == "adaptive"
    # The first switch has nothing to compare with: a full pass at each release point
    # (to rollout: after the offload and after the weight sync).
    switch.to_rollout()
    assert trainer.events.count("gc:1") == 2
    assert trainer.events.count("gc") == 2
    switch.to_trainer()
    for _ in range(3):  # memory comes back as before: young generations only
        trainer.events.clear()
        switch.to_rollout()
        assert trainer.events.count("gc:1") == 2
        assert "gc" not in trainer.events
        trainer.events.clear()
        switch.to_trainer()
        assert "gc" not in trainer.events
    # A reference cycle holds 1 GiB that only a full pass frees: it is found.
    held = trainer.devices[0].allocated
    trainer.devices[0].allocated += GiB
    trainer.gc_results = [0, 7]  # the young pass finds nothing, the full one the cycle
    trainer.gc_frees = [0, GiB]
    trainer.events.clear()
    switch.to_rollout()
    assert trainer.events.count("gc:1") == 2
    assert "gc" in trainer.events  # after the offload, where memory stayed
    assert trainer.events.index("gc:1") < trainer.events.index("gc")
    assert switch.garbage.gate.full_passes == 4  # the first cycle's 3 release points, then this
    assert trainer.devices[0].allocated == held  # the cycle's gigabyte is back


def test_switch_without_garbage_collection(trainer: FakeTorch) -> None:
    switch, _ = make(trainer, collect_garbage=False)
    with switch.rollout():
        pass
    assert "gc" not in trainer.events  # neither the stages' releases nor the recipes'
    assert trainer.events.count("empty_cache") >= 5
    every, _ = make(trainer, collect_garbage=True)
    trainer.events.clear()
    with every.rollout():
        pass
    assert trainer.events.count("gc") >= 5
    for bad in (1, 0, "always", None):
        with pytest.raises(
            TypeError, match="collect_garbage must be True, False, 'young', 'once' or 'adaptive'"
        ):
            make(trainer, collect_garbage=bad)


def test_switch_collects_garbage_once_per_direction(trainer: FakeTorch) -> None:
    switch, _ = make(trainer, collect_garbage="once")
    assert switch.garbage.mode == "once"
    for cycle in range(3):
        trainer.events.clear()
        switch.to_rollout()
        # the first release after the offload collects; the later ones only empty the cache
        first_release = trainer.events.index("empty_cache")
        assert trainer.events.count("gc") == 1
        assert trainer.events.index("gc") < first_release
        # From the second cycle the weights and the KV cache wake under the copies: one
        # release, once they landed (decisions 86, 89).
        assert trainer.events.count("empty_cache") == (1 if cycle else 4)
        trainer.events.clear()
        switch.to_trainer()
        assert trainer.events.count("gc") == 1
        assert trainer.events.index("gc") < trainer.events.index("empty_cache")


# --------------------------------------------------------------------------- #
# Issue #11: ranks fail together; cancellation; an engine that does not let go
# --------------------------------------------------------------------------- #


class ThreadRanks:
    """A RankSync for ranks that are threads: every rank's status at each point."""

    def __init__(self, world: int) -> None:
        self.barrier = threading.Barrier(world, timeout=10)
        self.world = world
        self.lock = threading.Lock()
        self.slots: dict[int, RankStatus] = {}
        self.points: list[tuple[int, str]] = []

    def exchange(self, status: RankStatus) -> list[RankStatus]:
        with self.lock:
            self.slots[status.rank] = status
            self.points.append((status.rank, status.point))
        self.barrier.wait()
        with self.lock:
            seen = [self.slots[r] for r in range(self.world)]
        self.barrier.wait()  # nobody overwrites a slot before everyone read it
        return seen


class RankEngine(hm.EngineAdapter):
    """Records (rank, cycle, event, time) of wakes and sleeps."""

    def __init__(self, rank: int, events: list[tuple[int, int, str, float]]) -> None:
        super().__init__(object(), ())
        self.rank, self.events, self.cycle = rank, events, 0

    def sleep(self) -> None:
        self.events.append((self.rank, self.cycle, "sleep", time.monotonic()))

    def wake_up(self, tags: Any) -> None:
        self.events.append((self.rank, self.cycle, f"wake:{tags[0]}", time.monotonic()))


def test_one_ranks_failure_fails_the_cycle_on_every_rank_then_all_succeed(
    fake_gpu: FakeTorch,
) -> None:
    """Rank 1's weight sync fails in cycle 1 (after a slow start): rank 0 must not wake KV."""
    plain = hm.BackendProfile("plain", "no allocator steps", {})
    ranks = ThreadRanks(2)
    events: list[tuple[int, int, str, float]] = []
    outcomes: dict[int, list[str]] = {0: [], 1: []}

    def rank(r: int) -> None:
        engine = RankEngine(r, events)

        def sync(adapter: hm.EngineAdapter) -> None:
            events.append((r, engine.cycle, "sync", time.monotonic()))
            if r == 1 and engine.cycle == 1:
                time.sleep(0.05)  # rank 0 reaches barrier_kv first, and must wait there
                raise Boom("weight sync lost a batch")

        switch = hm.HybridSwitch(
            engine, plain, FakeOffloader([]), sync_weights=sync, barrier=ranks, confirm_timeout_s=0
        )
        switch.rank = r
        for cycle in range(3):
            engine.cycle = cycle
            try:
                with switch.rollout():
                    events.append((r, cycle, "generate", time.monotonic()))
                outcomes[r].append("ok")
            except Boom:
                outcomes[r].append("Boom")
            except hm.HybridSwitchError as exc:
                outcomes[r].append(f"HybridSwitchError: {exc}")

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    assert outcomes[1] == ["ok", "Boom", "ok"]
    assert outcomes[0][0] == "ok"
    assert outcomes[0][2] == "ok"
    assert outcomes[0][1].startswith("HybridSwitchError: rank 0: the switch rank 1 failed at ")
    assert "stage 'weight_sync' (Boom: weight sync lost a batch)" in outcomes[0][1]
    assert "every rank recovered" in outcomes[0][1]
    in_cycle_1 = [(r, e) for r, c, e, _ in events if c == 1]
    assert (0, "wake:kv_cache") not in in_cycle_1  # the OOM the barriers exist to prevent
    assert (0, "generate") not in in_cycle_1
    assert (0, "sleep") in in_cycle_1  # rank 0's engine woke its weights: put back to sleep
    # every rank met at the same points in the same order, failed or not
    by_rank = {r: [p for rr, p in ranks.points if rr == r] for r in (0, 1)}
    assert by_rank[0] == by_rank[1]


def test_ranks_out_of_step_are_an_error_not_a_silent_pairing(fake_gpu: FakeTorch) -> None:
    statuses: list[RankStatus] = []

    class Skewed:
        def exchange(self, status: RankStatus) -> list[RankStatus]:
            statuses.append(status)
            other = RankStatus(
                1, status.cycle, "barrier_kv" if status.point == "barrier" else status.point, True
            )
            return [status, other]

    log: list[str] = []
    switch = hm.HybridSwitch(
        hm.VLLMEngine(FakeVLLM(log, fake_gpu)), "vllm", FakeOffloader(log), barrier=Skewed()
    )
    with (
        pytest.raises(hm.HybridSwitchError, match=r"out of step.*rank 1 at 'barrier_kv'"),
        switch.rollout(),
    ):
        pytest.fail("never reached")
    assert "wake:weights" not in log  # stopped at the mismatched point
    assert log[-1] == "reload"


def test_cancelling_an_async_switch_during_its_offload_waits_for_the_worker(
    trainer: FakeTorch,
) -> None:
    """The offload runs in a worker thread; recovery must not start before it ends."""
    started, release = threading.Event(), threading.Event()
    log: list[str] = []

    class SlowOffloader(FakeOffloader):
        def offload(self, groups: Any = None, **kw: Any) -> Any:
            log.append("offload:start")
            started.set()
            release.wait(5)
            log.append("offload:end")

    switch = hm.HybridSwitch(AsyncSGLang(log), "sglang", SlowOffloader(log), barrier=None)

    async def main() -> None:
        async def run() -> None:
            async with switch.rollout():
                log.append("generate")

        task = asyncio.create_task(run())
        await asyncio.to_thread(started.wait, 5)
        task.cancel()
        await asyncio.sleep(0.05)
        assert "reload" not in log  # still waiting for the worker
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert log.index("offload:end") < log.index("reload")  # recovery after the worker
    assert "generate" not in log
    assert hm.allocator_state().scopes == ()
    assert not switch._active


def test_an_engine_that_does_not_let_go_fails_the_switch_before_the_reload(
    trainer: FakeTorch,
) -> None:
    log: list[str] = []
    device = trainer.devices[0]

    class Clingy(FakeVLLM):
        def sleep(self, level: int = 1) -> None:
            self.log.append(f"sleep:{level}")  # says it slept, frees nothing

    need = device.free + (1 << 30)  # more than will be free while the engine holds on
    switch = hm.HybridSwitch(
        hm.VLLMEngine(Clingy(log, trainer)),
        "vllm",
        FakeOffloader(log, need=need),
        barrier=None,
        confirm_timeout_s=0.05,
    )
    with pytest.raises(hm.HybridSwitchError) as info, switch.rollout():
        pass
    message = str(info.value)
    assert "failed at stage 'confirm'" in message
    assert "has not let go of its memory" in message
    assert "after 0.05 s (confirm_timeout_s)" in message
    assert "still offloaded and intact" in message
    assert "reload" not in log  # no reload into memory that cannot hold it


def test_a_plugin_backend_brings_its_engine_adapter(trainer: FakeTorch) -> None:
    """HybridSwitch asks the profile for the adapter: a plugin's engine needs no wrapping."""
    log: list[str] = []
    wrapped: list[object] = []

    class PluginAdapter(hm.EngineAdapter):
        def __init__(self, engine: Any) -> None:
            super().__init__(engine, ("sleep", "wake_up"))
            wrapped.append(engine)
            self.raw = engine

        def sleep(self) -> None:
            self.raw.sleep()

        def wake_up(self, tags: Sequence[str]) -> None:
            self.raw.wake_up(list(tags))

    vllm = hm.get_backend("vllm")
    hm.register_backend(
        hm.BackendProfile("plugin", "a plugin's engine", vllm.recipes, adapter=PluginAdapter)
    )
    raw = FakeVLLM(log, trainer)
    switch = hm.HybridSwitch(raw, "plugin", barrier=None, confirm_timeout_s=0.0)
    assert isinstance(switch.engine, PluginAdapter)
    assert wrapped == [raw]
    with switch.rollout():
        pass
    assert log == ["wake:weights", "wake:kv_cache", "sleep:1"]
    # the built-in profiles name theirs
    assert hm.get_backend("vllm").adapter is hm.VLLMEngine
    assert hm.get_backend("sglang").adapter is hm.SGLangEngine
    assert hm.get_backend("default").adapter is None


def test_a_profile_adapter_is_checked(trainer: FakeTorch) -> None:
    with pytest.raises(TypeError, match="adapter must be callable"):
        hm.BackendProfile("bad", "x", {}, adapter=3)  # type: ignore[arg-type]
    hm.register_backend(hm.BackendProfile("liar", "x", {}, adapter=lambda engine: engine))
    with pytest.raises(TypeError, match=r"its adapter returned .* not an hm\.EngineAdapter"):
        hm.HybridSwitch(object(), "liar", barrier=None)


def test_an_offload_that_fails_twice_is_reloaded_by_the_recovery(
    trainer: FakeTorch, cpu_as_device: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real Offloader: freeing the bias fails, and so does putting the weight back.

    The weight stays offloaded in the pool; the switch's recovery must find it there
    and reload it, so the trainer gets its model back bit for bit.
    """
    model = torch.nn.Linear(8, 8)
    before = [p.detach().clone() for p in model.parameters()]
    offloader = hm.Offloader(model)
    log: list[str] = []
    switch = hm.HybridSwitch(
        hm.VLLMEngine(FakeVLLM(log, trainer)),
        "vllm",
        offloader,
        sync_weights=lambda adapter: None,
        confirm_timeout_s=0.0,
    )
    fail_resizes(monkeypatch, frees=(2,), allocations=(1,))  # the bias; the weight back
    with pytest.raises(hm.OffloadError, match="stay offloaded"), switch.rollout():
        log.append("generate")
    assert "generate" not in log
    assert offloader.offloaded_groups == frozenset()  # the recovery reloaded it
    after = list(model.parameters())
    assert all(p.untyped_storage().nbytes() > 0 for p in after)  # before reading them
    assert all(torch.equal(a, b) for a, b in zip(after, before))


def test_a_switch_builds_its_phases_once(
    trainer: FakeTorch, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue #27: built in __init__, entered every cycle; the garbage policy at entry."""
    from hybridmem.scopes import phases

    built: list[str] = []
    original = phases.Phase.__init__

    def counting(self: Any, name: str, backend: Any, overrides: Any) -> None:
        built.append(name)
        original(self, name, backend, overrides)

    monkeypatch.setattr(phases.Phase, "__init__", counting)
    switch = hm.HybridSwitch(hm.VLLMEngine(FakeVLLM([], trainer)), "vllm", barrier=None)
    assert sorted(built) == ["rollout", "sleep", "wake_up", "weight_sync"]
    for _ in range(3):
        with switch.rollout():
            pass
    assert len(built) == 4  # three cycles, no phase built again
    assert len(switch.reports) == 6  # each cycle: to rollout and back


class SyncSGLang:
    """SGLang's sync engine API, logging."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.log.append("release_memory_occupation")

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.log.append(f"resume:{','.join(tags or [])}")


@pytest.mark.parametrize(
    ("backend", "driver"),
    [("sglang", "sync"), ("sglang", "async"), ("vllm", "sync"), ("default", "sync")],
)
def test_confirm_watches_free_memory_settle_once_per_cycle(
    trainer: FakeTorch, monkeypatch: pytest.MonkeyPatch, backend: str, driver: str
) -> None:
    """SGLang's sleep recipe waits for free memory to settle; confirm must not wait again.

    Two waits back to back cost the quick bench 20 ms of its 43 ms confirm (each is
    three readings 10 ms apart); a backend without such a step still gets one, the
    switch's own. The room check runs either way (an engine that does not let go
    still fails at confirm: test_an_engine_that_does_not_let_go_...).
    """
    waits: list[str] = []

    def counting(device: Any = None, *, timeout_s: float = 5.0, **kw: Any) -> Any:
        waits.append("sync")
        return 0, 0.0

    async def counting_async(device: Any, timeout_s: float, enough: Any = None) -> None:
        waits.append("async")

    monkeypatch.setattr(phases, "await_free", counting)
    monkeypatch.setattr(phases, "await_free_async", counting_async)
    log: list[str] = []
    engine: object
    if backend == "sglang":
        engine = AsyncSGLang(log) if driver == "async" else SyncSGLang(log)
    else:  # the fake vLLM engine is sync only
        fake = FakeVLLM(log, trainer)
        engine = fake if backend == "vllm" else hm.VLLMEngine(fake)
    need = 1 << 20
    switch = hm.HybridSwitch(
        engine,
        backend,
        FakeOffloader(log, need=need),
        barrier=None,
        confirm_timeout_s=0.0,
        reload_early=False,  # the reload after the sleep, which confirm makes room for
    )
    if driver == "sync":
        with switch.rollout():
            pass
    else:

        async def main() -> None:
            async with switch.rollout():
                pass

        asyncio.run(main())
    assert waits == [driver], waits  # one settling per cycle, on the driver's kind
    assert log[-1] == "reload"
    assert switch.reports[-1].stage("confirm") is not None
