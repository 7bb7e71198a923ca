"""How a switch runs a phase's recipe (engine/switch_phase.py): its garbage policy, its skips.

A phase runs its recipe as written; the switch runs the same checked steps with its
own choices: what its releases collect, no release while the offload's copies run,
the engine's await_free ended by what its last sleep gave back.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import hybridmem as hm
from hybridmem.engine.switch_phase import SwitchPhase
from hybridmem.scopes import phases
from tests.conftest import FakeTorch


def expandable() -> bool:
    return hm.allocator_state().expandable_segments


def test_the_switch_passes_its_garbage_policy_without_rebuilding(fake_gpu: FakeTorch) -> None:
    wake = hm.phase("wake_up", backend="vllm")
    fake_gpu.events.clear()
    with SwitchPhase(wake, False, None):
        assert not expandable()
    assert "gc" not in fake_gpu.events
    assert "empty_cache" in fake_gpu.events  # the release itself still ran
    fake_gpu.events.clear()
    with SwitchPhase(wake, None, None):  # None: as the recipe says
        pass
    assert "gc" in fake_gpu.events
    fake_gpu.events.clear()
    with SwitchPhase(wake, "young", None):  # the one vocabulary: a young pass
        pass
    assert "gc:1" in fake_gpu.events
    assert "gc" not in fake_gpu.events


def test_the_switch_can_skip_the_releases_on_entry_and_keeps_the_scopes(
    fake_gpu: FakeTorch,
) -> None:
    # While an offload's copies run: a release synchronizes the device.
    wake = hm.phase("wake_up", backend="vllm")
    fake_gpu.events.clear()
    with SwitchPhase(wake, None, None, enter_releases=False):  # classic already
        assert not expandable()
    assert not [e for e in fake_gpu.events if e.startswith(("sync:", "gc", "empty_cache"))]
    with hm.expandable_segments(True):
        fake_gpu.events.clear()
        with SwitchPhase(wake, None, None, enter_releases=False):
            assert not expandable()  # the recipe's scope still applies (and its mode
        assert expandable()  # change releases: allocator blocks must not mix kinds)
    assert "ipc_collect" not in fake_gpu.events  # the recipe's release_cache step did not run
    assert "gc" not in fake_gpu.events


def test_the_switch_can_skip_the_releases_on_exit_decided_before_leaving(
    fake_gpu: FakeTorch,
) -> None:
    # Its offload's copies may still run when it leaves weight_sync.
    sync = hm.phase("weight_sync", backend="vllm")
    releases = ("sync:", "empty_cache", "ipc_collect")
    fake_gpu.events.clear()
    with SwitchPhase(sync, None, None):
        pass
    assert [e for e in fake_gpu.events if e.startswith(releases)]  # its release on exit
    fake_gpu.events.clear()
    use = SwitchPhase(sync, None, None)
    with use:
        use.exit_releases = False  # decided while inside: read when it is left
    assert not [e for e in fake_gpu.events if e.startswith(releases)]


@pytest.mark.parametrize("driver", ["sync", "async"])
def test_the_switch_passes_enough_free_to_the_await_free_step(
    fake_gpu: FakeTorch, monkeypatch: pytest.MonkeyPatch, driver: str
) -> None:
    got: list[object] = []

    def wait(device: Any = None, *, timeout_s: float = 5.0, enough: Any = None) -> Any:
        got.append(enough)
        return 0, 0.0

    async def wait_async(device: Any, timeout_s: float, enough: Any = None) -> None:
        got.append(enough)

    monkeypatch.setattr(phases, "await_free", wait)
    monkeypatch.setattr(phases, "await_free_async", wait_async)
    sleep = hm.phase("sleep", backend="sglang")
    if driver == "sync":
        with SwitchPhase(sleep, None, 7):
            pass
        with sleep:
            pass
    else:

        async def main() -> None:
            async with SwitchPhase(sleep, None, 7):
                pass
            async with sleep:
                pass

        asyncio.run(main())
    assert got == [7, None]
