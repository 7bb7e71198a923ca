"""Allocator writes made outside hybridmem: seen, kept in force, reported by source.

The stand-in writers do what the field's code does with torch's setter: vLLM 0.33's
``CuMemAllocator.use_memory_pool`` reads the live settings string, writes it back
with ``expandable_segments`` flipped off, and writes the string it read at exit;
verl's ``set_expandable_segments`` writes ``expandable_segments:<bool>`` alone (which
resets ``max_split_size_mb`` and the like). The fake seam runs torch's rules.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hybridmem as hm
from hybridmem import _torch
from tests.conftest import FakeTorch

USER_ENV = "expandable_segments:True,max_split_size_mb:256,garbage_collection_threshold:0.6"
USER_KEYS = {"max_split_size_mb": "256", "garbage_collection_threshold": "0.6"}


def flip(text: str, key: str, value: str) -> str:
    """``text`` with ``key`` set to ``value``, every other field as written."""
    fields = [f.strip() for f in text.split(",") if f.strip()]
    out = [f"{key}:{value}" if f.partition(":")[0].strip() == key else f for f in fields]
    if not any(f.partition(":")[0].strip() == key for f in fields):
        out.append(f"{key}:{value}")
    return ",".join(out)


@contextlib.contextmanager
def pool_toggle(fake: FakeTorch) -> Iterator[None]:
    """vLLM 0.33's pool: expandable segments off inside, the string it read back at exit."""
    read = fake.last_allocator_settings() or ""
    on = any(f.strip() in ("expandable_segments:True",) for f in read.split(","))
    if on:
        fake.set_allocator_settings(flip(read, "expandable_segments", "False"))
    try:
        yield
    finally:
        if on:
            fake.set_allocator_settings(read)


def verl_toggle(fake: FakeTorch, enable: bool) -> None:
    """verl's ``set_expandable_segments``: the one key, alone."""
    fake.set_allocator_settings(f"expandable_segments:{enable}")


def torch_runs(fake: FakeTorch) -> dict[str, object]:
    return fake.meaning()


def reported(fake: FakeTorch) -> dict[str, object]:
    """What hybridmem says torch runs with, in torch's terms."""
    text = hm.allocator_state().to_settings_string()
    return fake.rules.run(text).state


@pytest.fixture(params=["getter", "watch"])
def user_env(
    fake: FakeTorch, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> FakeTorch:
    """The user's env, CUDA up; writes seen by torch's getter (2.12+) or the watch (2.10-2.11)."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", USER_ENV)
    fake.initialized = True
    fake.devices = {}
    if request.param == "watch":
        fake.watch_writes()
    return fake


# --------------------------------------------------------------------------- #
# vLLM's pool inside a hybridmem scope, and the other way round
# --------------------------------------------------------------------------- #


def test_a_pool_inside_a_scope_is_seen_and_a_scope_inside_the_pool_keeps_it(
    user_env: FakeTorch,
) -> None:
    fake = user_env
    with hm.expandable_segments(True):
        with pool_toggle(fake):
            state = hm.allocator_state()
            assert state.expandable_segments is False  # what torch runs with
            assert state.source("expandable_segments") == "outside"
            assert state["max_split_size_mb"] == "256"
            with hm.expandable_segments(False):
                assert torch_runs(fake)["expandable_segments"] is False
            # the scope that exited inside the pool left the pool's write in force
            assert torch_runs(fake)["expandable_segments"] is False
            assert hm.allocator_state().expandable_segments is False
        # the pool wrote back what it read: hybridmem's own settings, no layer left
        assert torch_runs(fake)["expandable_segments"] is True
        state = hm.allocator_state()
        assert state.source("expandable_segments") == "env"
        assert not [s for s in state.scopes if s.startswith("outside")]
    assert torch_runs(fake) == fake.rules.run(USER_ENV).state


def test_a_scope_inside_the_pool_applies_then_gives_the_pool_its_setting_back(
    user_env: FakeTorch,
) -> None:
    fake = user_env
    hm.allocator_state()
    with pool_toggle(fake):
        assert hm.allocator_state().expandable_segments is False
        with hm.expandable_segments(True):  # entered after the pool's write: it applies
            assert torch_runs(fake)["expandable_segments"] is True
            assert hm.allocator_state().source("expandable_segments") == "runtime"
        assert torch_runs(fake)["expandable_segments"] is False  # the pool's, again
        assert torch_runs(fake)["max_split_size_mb"] == 256
    assert torch_runs(fake) == fake.rules.run(USER_ENV).state
    assert hm.allocator_state().source("expandable_segments") == "env"


@pytest.mark.parametrize("where", ["scope inside pool", "pool inside scope"])
def test_an_exception_inside_either_leaves_the_right_settings(
    user_env: FakeTorch, where: str
) -> None:
    fake = user_env

    def body() -> None:
        if where == "scope inside pool":
            with pool_toggle(fake), hm.allocator_settings(max_split_size_mb=64):
                raise KeyError("inside")
        with hm.expandable_segments(False), pool_toggle(fake):
            raise KeyError("inside")

    with pytest.raises(KeyError):
        body()
    with hm.allocator_settings(max_split_size_mb=128):  # the next change sees all of it
        assert torch_runs(fake)["expandable_segments"] is True
    assert torch_runs(fake) == fake.rules.run(USER_ENV).state
    assert reported(fake) == torch_runs(fake)


def test_a_scope_exiting_under_a_write_from_another_thread_leaves_it_in_force(
    user_env: FakeTorch,
) -> None:
    fake = user_env
    entered, leave = threading.Event(), threading.Event()

    def engine() -> None:
        with pool_toggle(fake):
            entered.set()
            leave.wait(timeout=30)

    with hm.allocator_settings(max_split_size_mb=64):
        thread = threading.Thread(target=engine)
        thread.start()
        assert entered.wait(timeout=30)
    # the scope exited while the other thread's pool is active: the pool's write holds,
    # the scope's own setting goes with it
    assert torch_runs(fake)["expandable_segments"] is False
    assert torch_runs(fake)["max_split_size_mb"] == 256
    assert hm.allocator_state().expandable_segments is False
    leave.set()
    thread.join(timeout=30)
    # the pool wrote back the string it read at entry, the exited scope's 64 MiB in
    # it: a write from outside, seen, reported as such and left in force
    state = hm.allocator_state()
    assert torch_runs(fake)["max_split_size_mb"] == 64
    assert (state["max_split_size_mb"], state.source("max_split_size_mb")) == ("64", "outside")
    with hm.expandable_segments(False):
        assert torch_runs(fake)["max_split_size_mb"] == 64
    assert torch_runs(fake) == {**fake.rules.run(USER_ENV).state, "max_split_size_mb": 64}


# --------------------------------------------------------------------------- #
# verl's one-key toggle: the reset settings are pending, never claimed
# --------------------------------------------------------------------------- #


def test_a_one_key_write_reports_what_it_reset_and_the_next_change_gives_it_back(
    user_env: FakeTorch, caplog: pytest.LogCaptureFixture
) -> None:
    fake = user_env
    with hm.expandable_segments(True):
        verl_toggle(fake, False)
        state = hm.allocator_state()
        # never a value torch is not running with: the reset keys are at torch's default
        assert reported(fake) == torch_runs(fake)
        assert state.source("max_split_size_mb") == "default"
        assert set(state.pending) == set(USER_KEYS)
        assert state.pending["max_split_size_mb"].source == "env"
        assert "pending: max_split_size_mb:256" in str(state)
        assert state.as_dict()["pending"]["max_split_size_mb"]["value"] == "256"
        with hm.allocator_settings(garbage_collection_threshold=0.8):
            # the next change writes the user's settings back, verl's key kept
            assert torch_runs(fake)["max_split_size_mb"] == 256
            assert torch_runs(fake)["expandable_segments"] is False
        assert not hm.allocator_state().pending
        assert torch_runs(fake)["expandable_segments"] is False  # verl's, still
    assert any(
        "reset garbage_collection_threshold, max_split_size_mb" in r.getMessage()
        for r in caplog.records
    )
    # no scope under it any more: verl's write is still in force, the env's keys around it
    assert torch_runs(fake) == {**fake.rules.run(USER_ENV).state, "expandable_segments": False}
    with hm.expandable_segments(True):
        assert torch_runs(fake)["expandable_segments"] is True
    assert torch_runs(fake)["expandable_segments"] is False


def test_a_newer_process_default_wins_over_an_older_write_from_outside(
    user_env: FakeTorch, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = user_env
    # (an env that sets expandable segments itself keeps them over process defaults)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:256")
    hm.allocator_state()
    verl_toggle(fake, False)
    hm.set_allocator_defaults(expandable_segments=True)
    assert torch_runs(fake)["expandable_segments"] is True
    assert torch_runs(fake)["max_split_size_mb"] == 256


def test_where_writes_cannot_be_seen_the_state_says_so(
    user_env: FakeTorch,
) -> None:
    user_env.sees = False
    state = hm.allocator_state()
    assert state.sees_outside is False
    assert "not seen" in str(state)
    assert user_env.last_allocator_settings() is None


# --------------------------------------------------------------------------- #
# Random interleavings: hybridmem never claims, and never overwrites
# --------------------------------------------------------------------------- #

_STEPS = st.lists(
    st.sampled_from(["es_on", "es_off", "split", "pool", "verl_on", "verl_off", "exit", "state"]),
    max_size=14,
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(steps=_STEPS)
def test_random_nesting_with_outside_writes_keeps_both_guarantees(
    user_env: FakeTorch, steps: list[str]
) -> None:
    from hybridmem.scopes.allocator import _reset_state_for_tests

    fake = user_env
    _reset_state_for_tests()
    fake.applied.clear()
    fake.last = None
    if fake.watch is not None:
        fake.watch.stop()  # a fresh process: started again at hybridmem's first read
    fake.torch_state = dict(fake.rules.run(USER_ENV).items)  # torch parsed the env
    open_: list[tuple[str, Any]] = []

    def outside_in_force() -> dict[str, object]:
        state, runs = hm.allocator_state(), torch_runs(fake)
        return {k: runs[k] for k, v in state.settings.items() if v.source == "outside"}

    def close_one() -> None:
        kind, scope = open_.pop()
        held = outside_in_force() if kind == "hm" else {}
        scope.__exit__(None, None, None)
        runs = torch_runs(fake)
        # a hybridmem exit never overwrites a write from outside still in force
        assert {k: runs[k] for k in held} == held, (held, runs)

    for step in steps:
        if step == "exit" and open_:
            close_one()
        elif step in ("es_on", "es_off", "split"):
            scope: Any = (
                hm.allocator_settings(max_split_size_mb=64)
                if step == "split"
                else hm.expandable_segments(step == "es_on")
            )
            scope.__enter__()
            open_.append(("hm", scope))
        elif step == "pool":
            scope = pool_toggle(fake)
            scope.__enter__()
            open_.append(("pool", scope))
        elif step in ("verl_on", "verl_off"):
            verl_toggle(fake, step == "verl_on")
        # never a value torch is not running with
        assert reported(fake) == torch_runs(fake)
    while open_:
        close_one()
        assert reported(fake) == torch_runs(fake)
    if not any(step.startswith("verl") for step in steps):
        # every write from outside was given back: the env's settings, sourced so
        assert torch_runs(fake) == fake.rules.run(USER_ENV).state


# --------------------------------------------------------------------------- #
# The real torch here (its CPU build parses and keeps the string), and vLLM's own
# alloc_conf where vLLM is installed (CI's vllm job)
# --------------------------------------------------------------------------- #

_REAL_SCRIPT = """
import importlib.util, json, torch, hybridmem as hm
from hybridmem import _torch
out = {"sees": hm.allocator_state().sees_outside}
if _torch.last_allocator_settings() is None:
    print(json.dumps(out)); raise SystemExit
if importlib.util.find_spec("vllm") is not None:
    from vllm.device_allocator import alloc_conf as vllm_conf
    out["writer"] = "vllm"
    def write_off():
        conf = torch._C._accelerator_getAllocatorSettings()
        vllm_conf.set_alloc_conf(vllm_conf.with_conf_flag(conf, "expandable_segments", False))
        return conf
    put_back = vllm_conf.set_alloc_conf
else:
    out["writer"] = "torch"
    def write_off():
        conf = torch._C._accelerator_getAllocatorSettings()
        off = conf.replace("expandable_segments:True", "expandable_segments:False")
        torch._C._accelerator_setAllocatorSettings(off)
        return conf
    put_back = torch._C._accelerator_setAllocatorSettings
with hm.expandable_segments(True):
    read = write_off()
    written = torch._C._accelerator_getAllocatorSettings()
    state = hm.allocator_state()
    out["inside"] = [
        state.expandable_segments, state.source("expandable_segments"), state["max_split_size_mb"]
    ]
    with hm.expandable_segments(False):
        pass
    out["after_scope"] = torch._C._accelerator_getAllocatorSettings() == written
    put_back(read)
    out["restored_source"] = hm.allocator_state().source("expandable_segments")
print(json.dumps(out))
"""


def test_the_real_torch_and_vllm_here_a_pool_write_is_seen_and_kept() -> None:
    """A fresh interpreter: torch's own setter and getter (vLLM's alloc_conf if installed)."""
    import json

    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": USER_ENV}
    env.pop("PYTORCH_ALLOC_CONF", None)
    done = subprocess.run(
        [sys.executable, "-c", _REAL_SCRIPT],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    if _torch.torch_version() < (2, 12):
        # no getter, and no CUDA for the snapshot: such a write cannot be seen, and
        # the state says so
        assert out == {"sees": False}
        return
    assert out["sees"] is True
    assert out["inside"] == [False, "outside", "256"]
    assert out["after_scope"] is True  # the scope's exit wrote nothing over the pool's
    assert out["restored_source"] == "env"
    if os.environ.get("HYBRIDMEM_REQUIRE_VLLM"):
        assert out["writer"] == "vllm"
