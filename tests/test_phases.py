"""phase(): recipes composed in order, overrides, every form, restore on error."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

import hybridmem as hm
from hybridmem import _torch
from hybridmem.scopes import phases
from tests.conftest import FakeTorch
from tests.helpers import LoopTicker


def expandable() -> bool:
    return hm.allocator_state().expandable_segments


def settings_events(fake: FakeTorch) -> list[str]:
    """The event log with each settings string reduced to its expandable value."""
    out = []
    for event in fake.events:
        if event.startswith("set:"):
            out.append("expandable=" + event.split("expandable_segments:")[1].split(",")[0])
        elif not event.startswith("sync"):
            out.append(event)
    return out


def test_train_turns_expandable_on_and_restores(fake_gpu: FakeTorch) -> None:
    with hm.phase("train", backend="vllm"):
        assert expandable()
    assert not expandable()


def test_wake_up_releases_before_switching(fake_gpu: FakeTorch) -> None:
    with hm.expandable_segments(True):
        fake_gpu.events.clear()
        with hm.phase("wake_up", backend="vllm"):
            assert not expandable()
        assert expandable()
    # release (gc, ipc_collect, empty_cache) first, then the switch (which drops the cache)
    events = settings_events(fake_gpu)
    assert events[:3] == ["gc", "ipc_collect", "empty_cache"]
    assert "expandable=False" in events[3:]


def test_weight_sync_collects_and_releases_inside_the_ipc_scope(fake_gpu: FakeTorch) -> None:
    with hm.expandable_segments(True):
        fake_gpu.events.clear()
        with hm.phase("weight_sync", backend="sglang"):
            assert not expandable()
            fake_gpu.events.append("body")
    events = settings_events(fake_gpu)
    body = events.index("body")
    restore = events.index("expandable=True", body)
    assert "ipc_collect" in events[body:restore]  # the exit release ran before the restore
    assert "gc" not in events[body:restore]  # collect_garbage=False in this recipe


def test_sglang_sleep_waits_for_free_memory(
    fake_gpu: FakeTorch, monkeypatch: pytest.MonkeyPatch
) -> None:
    waited: list[float] = []
    monkeypatch.setattr(
        phases, "await_free", lambda d, timeout_s, enough=None: waited.append(timeout_s)
    )
    with hm.phase("sleep", backend="sglang"):
        pass
    assert waited == [5.0]
    with hm.phase("sleep", backend="vllm"):
        pass
    assert waited == [5.0]


def test_overrides(fake_gpu: FakeTorch, monkeypatch: pytest.MonkeyPatch) -> None:
    waited: list[float] = []
    monkeypatch.setattr(
        phases, "await_free", lambda d, timeout_s, enough=None: waited.append(timeout_s)
    )
    quiet = hm.phase("sleep", backend="sglang", release_cache=False, await_free={"timeout_s": 1})
    assert [s.name for s in quiet.steps] == ["await_free"]
    with quiet:
        pass
    assert waited == [1]
    assert "empty_cache" not in fake_gpu.events
    inverted = hm.phase("rollout", backend="vllm", expandable_segments={"enabled": True})
    with inverted:
        assert expandable()
    assert len(hm.phase("rollout", backend="vllm", expandable_segments=True).steps) == 1


def test_bad_overrides() -> None:
    with pytest.raises(
        ValueError, match=r"unknown override\(s\) 'relase_cache' \(did you mean 'release_cache'\?\)"
    ):
        hm.phase("sleep", backend="vllm", relase_cache=False)
    with pytest.raises(TypeError, match="pass True, False or a dict"):
        hm.phase("sleep", backend="vllm", release_cache="yes")


def test_restores_on_error_and_nests(fake_gpu: FakeTorch) -> None:
    with pytest.raises(KeyboardInterrupt), hm.phase("train", backend="vllm"):
        raise KeyboardInterrupt
    assert not expandable()
    with hm.phase("train", backend="vllm"):
        with hm.phase("rollout", backend="vllm"):
            assert not expandable()
        assert expandable()
    assert not expandable()


def test_failing_exit_action_still_restores(
    fake_gpu: FakeTorch, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(*a: Any, **k: Any) -> None:
        raise RuntimeError("release failed")

    monkeypatch.setattr(phases, "release_cache", boom)
    with (
        pytest.raises(RuntimeError, match="release failed"),
        hm.phase("weight_sync", backend="vllm"),
    ):
        assert not expandable()
    assert hm.allocator_state().scopes == ()


def test_every_form(fake_gpu: FakeTorch) -> None:
    seen: list[bool] = []
    train = hm.phase("train", backend="vllm")

    @train
    def fn() -> None:
        seen.append(expandable())

    @train
    async def coro() -> None:
        await asyncio.sleep(0)
        seen.append(expandable())

    @train
    def gen() -> Iterator[int]:
        seen.append(expandable())
        yield 1

    @train
    async def agen() -> AsyncIterator[int]:
        seen.append(expandable())
        yield 1

    @hm.phase("train", backend="vllm")
    class Manager:
        def __enter__(self) -> Manager:
            seen.append(expandable())
            return self

        def __exit__(self, *exc: object) -> None:
            seen.append(expandable())

    @hm.phase("train", backend="sglang")
    class AsyncManager:
        async def __aenter__(self) -> AsyncManager:
            seen.append(expandable())
            return self

        async def __aexit__(self, *exc: object) -> None:
            seen.append(expandable())

    fn()
    asyncio.run(coro())
    list(gen())

    async def drive() -> None:
        async for _ in agen():
            pass
        async with AsyncManager():
            seen.append(expandable())
        async with hm.phase("train", backend="vllm"):
            seen.append(expandable())

    asyncio.run(drive())
    with Manager():
        seen.append(expandable())
    assert seen == [True] * len(seen)
    assert len(seen) == 11
    assert not expandable()


def test_async_sleep_phase_polls_without_blocking(
    fake_gpu: FakeTorch, monkeypatch: pytest.MonkeyPatch
) -> None:
    polls: list[int] = []

    def mem_get_info(index: int) -> tuple[int, int]:
        polls.append(index)
        return 10 << 30, 80 << 30

    monkeypatch.setattr(_torch, "mem_get_info", mem_get_info)

    async def main() -> int:
        async with LoopTicker() as ticker, hm.phase("sleep", backend="sglang"):
            pass
        return ticker.ticks

    assert asyncio.run(main()) > 0
    assert len(polls) >= 3  # settled after three equal readings


def test_await_free_settles_and_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    readings = iter([1, 5, 9, 9, 9, 9])
    monkeypatch.setattr(_torch, "current_device", lambda: 0)
    monkeypatch.setattr(_torch, "mem_get_info", lambda i: (next(readings) << 30, 0))
    monkeypatch.setattr(time, "sleep", lambda s: None)
    free, _ = phases.await_free(timeout_s=5)
    assert free == 9 << 30
    rising = iter(range(1000))
    monkeypatch.setattr(_torch, "mem_get_info", lambda i: (next(rising) << 30, 0))
    free, seconds = phases.await_free(timeout_s=0.0)
    assert seconds >= 0.0
    monkeypatch.setattr(_torch, "current_device", lambda: None)
    assert phases.await_free() == (0, 0.0)


def test_offload_steps_in_a_custom_profile(fake_gpu: FakeTorch) -> None:
    calls: list[str] = []

    class Off:
        def offload(self, groups: Any) -> None:
            calls.append(f"offload:{groups}")

        def reload(self, groups: Any) -> None:
            calls.append(f"reload:{groups}")

    profile = hm.BackendProfile(
        "offloading",
        "test",
        {
            "rollout": (
                hm.Step("offload", "offload", "enter"),
                hm.Step("reload", "reload", "exit", {"groups": ["optimizer"]}),
            )
        },
    )
    with hm.phase("rollout", backend=profile):  # no offloader given: skipped
        pass
    off = Off()
    with hm.phase("rollout", backend=profile, offload=off, reload={"offloader": off}):
        calls.append("body")
    assert calls == ["offload:None", "body", "reload:['optimizer']"]


def test_an_opt_in_step_runs_only_when_an_override_names_it(fake_gpu: FakeTorch) -> None:
    step = hm.Step("extra", "release_cache", "exit", {"collect_garbage": False}, opt_in=True)
    profile = hm.BackendProfile("opting", "test", {"sleep": (step,)})
    assert hm.phase("sleep", backend=profile).steps == ()
    assert [s.name for s in hm.phase("sleep", backend=profile, extra=True).steps] == ["extra"]
    (named,) = hm.phase("sleep", backend=profile, extra={"sync": False}).steps
    assert dict(named.args) == {"collect_garbage": False, "sync": False}
    assert hm.phase("sleep", backend=profile, extra=False).steps == ()
    with pytest.raises(TypeError, match="opt_in must be True or False, got 'yes'"):
        hm.Step("extra", "release_cache", "exit", opt_in="yes")  # type: ignore[arg-type]


def test_a_reload_step_passes_its_way_and_refuses_a_bad_one(fake_gpu: FakeTorch) -> None:
    ways: list[Any] = []

    class Off:
        def reload(self, groups: Any, **kw: Any) -> None:
            ways.append(kw)

    step = hm.Step("reload", "reload", "exit", {"groups": None})
    profile = hm.BackendProfile("reloading", "test", {"train": (step,)})
    off = Off()
    with hm.phase("train", backend=profile, reload={"offloader": off, "by": "kernel"}):
        pass
    with hm.phase("train", backend=profile, reload={"offloader": off}):
        pass
    assert ways == [{"by": "kernel"}, {}]  # without "by", the Offloader's own default
    with pytest.raises(
        ValueError, match=r"phase\('train', backend='reloading'\): .*reload's by must be one of"
    ):
        hm.phase("train", backend=profile, reload={"offloader": off, "by": "sm"})


def test_kill_switch(fake_gpu: FakeTorch, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDMEM_DISABLE", "1")
    with hm.phase("wake_up", backend="vllm"):
        pass
    assert fake_gpu.events == []


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"expandable_segments": {"enabled": "no"}}, TypeError, "enabled must be True or False"),
        ({"release_cache": {"collect_garbage": 1}}, TypeError, "release_cache.collect_garbage"),
    ],
)
def test_bad_step_arguments_fail_when_the_phase_is_made(
    overrides: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        hm.phase("wake_up", backend="vllm", **overrides)


def test_bad_wait_timeout() -> None:
    with pytest.raises(ValueError, match="timeout_s must be a number of seconds >= 0"):
        hm.phase("sleep", backend="sglang", await_free={"timeout_s": -1})


def test_a_phase_takes_what_release_cache_takes_and_refuses_what_it_refuses(
    fake_gpu: FakeTorch,
) -> None:
    """Issue #27: each step is checked by its primitive's own checker, once."""
    with hm.expandable_segments(True):
        fake_gpu.events.clear()
        with hm.phase("wake_up", backend="vllm", release_cache={"collect_garbage": "young"}):
            pass
    assert "gc:1" in fake_gpu.events  # release_cache's young pass, as the primitive does it
    assert "gc" not in fake_gpu.events
    with pytest.raises(TypeError, match=r"release_cache\.collect_garbage must be True, False or"):
        hm.phase("wake_up", backend="vllm", release_cache={"collect_garbage": "old"})
    with pytest.raises(ValueError, match=r"timeout_s must be a number of seconds >= 0"):
        hm.phase("sleep", backend="sglang", await_free={"timeout_s": -1})
    with pytest.raises(ValueError, match="timeout_s must be a number of seconds >= 0"):
        phases.await_free(timeout_s=-1)  # the primitive refuses the same


def test_a_phase_is_checked_once_and_entering_again_reruns_only_its_steps(
    fake_gpu: FakeTorch, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[str] = []
    original = phases.PhaseStep.__init__

    def counting(self: Any, step: Any, where: str) -> None:
        made.append(step.name)
        original(self, step, where)

    monkeypatch.setattr(phases.PhaseStep, "__init__", counting)
    wake = hm.phase("wake_up", backend="vllm")
    assert made == [s.name for s in wake.steps]
    for _ in range(3):
        fake_gpu.events.clear()
        with wake:
            assert not expandable()
        assert fake_gpu.events.count("empty_cache") >= 1  # the steps ran each time
    with wake, wake:  # re-entrant, as every scope
        assert not expandable()
    assert len(made) == len(wake.steps)  # and nothing was built or checked again
