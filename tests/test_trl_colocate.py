"""The TRL drop-in (hybridmem.integrations.trl) on a stand-in checked against TRL's source."""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch

from hybridmem._errors import OffloadError
from hybridmem.engine.switch_offload import NEED_MARGIN_BYTES
from hybridmem.integrations import trl as drop_in
from tests import trl_source, trl_standin
from tests.trl_standin import CALLS, Trainer, VLLMGeneration


@pytest.fixture(autouse=True)
def _recorded(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every engine call and phase boundary lands in CALLS, in order."""
    CALLS.clear()

    @contextlib.contextmanager
    def phase(name: str, backend: str | None = None) -> Iterator[None]:
        assert backend == "vllm"
        CALLS.append(("enter", name))
        try:
            yield
        finally:
            CALLS.append(("exit", name))

    monkeypatch.setattr(drop_in, "phase", phase)
    yield
    CALLS.clear()


def _generation(**kwargs: Any) -> VLLMGeneration:
    generation = VLLMGeneration(torch.nn.Linear(2, 2), **kwargs)
    CALLS.clear()  # the start-up sleep, before hybridmem is around it
    return generation


def test_the_stand_in_makes_trls_engine_calls_in_trls_order() -> None:
    found = trl_source.trl_source()
    if found is None:
        if trl_source.required():
            pytest.fail(trl_source.missing_reason())
        pytest.skip(trl_source.missing_reason())
    source, where = found
    theirs = trl_source.engine_calls(source)
    ours = trl_source.engine_calls(inspect.getsource(trl_standin))
    assert ours == theirs, f"TRL's calls ({where}) moved: the stand-in and the drop-in follow"
    # what the drop-in relies on, said plainly
    assert "self.llm.wake_up(tags=['kv_cache'])" in theirs["generate"]
    assert theirs["generate"][-1] == f"self.llm.sleep(level={drop_in.SLEEP_LEVEL})"
    assert "_llm_weights_sleeping" in source


def test_each_call_runs_in_its_phase_in_trls_order() -> None:
    generation = _generation()
    drop_in.colocate(Trainer(generation))
    generation.generate([[1, 2]], None, 1)
    assert CALLS == [
        ("enter", "rollout"),
        ("enter", "weight_sync"),
        ("empty_cache",),
        ("enter", "wake_up"),
        ("wake_up", ("weights",)),
        ("exit", "wake_up"),
        ("load_weights", "weight"),
        ("load_weights", "bias"),
        ("reset_prefix_cache",),
        ("exit", "weight_sync"),
        ("enter", "wake_up"),
        ("wake_up", ("kv_cache",)),
        ("exit", "wake_up"),
        ("generate", 1),
        ("enter", "sleep"),
        ("sleep", 2),
        ("exit", "sleep"),
        ("exit", "rollout"),
    ]


def test_a_failed_generate_puts_the_engine_back_to_sleep_and_the_weights_stale(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="hybridmem")
    generation = _generation()
    handle = drop_in.colocate(Trainer(generation))
    generation.llm.fail["generate"] = RuntimeError("CUDA error: out of memory")
    with pytest.raises(RuntimeError, match="out of memory") as raised:
        generation.generate([[1]], None, 1)
    assert CALLS[-4:] == [("enter", "sleep"), ("sleep", 2), ("exit", "sleep"), ("exit", "rollout")]
    assert generation._llm_weights_sleeping is True
    assert handle.awake == set()
    (said,) = [r.getMessage() for r in caplog.records]
    assert "vLLM, awake (kv_cache, weights), was put back to sleep (level 2)" in said
    if sys.version_info >= (3, 11):
        assert said in raised.value.__notes__
    CALLS.clear()
    generation.generate([[1]], None, 1)  # the next one syncs in full first
    assert [c for c in CALLS if c[0] in ("wake_up", "load_weights")] == [
        ("wake_up", ("weights",)),
        ("load_weights", "weight"),
        ("load_weights", "bias"),
        ("wake_up", ("kv_cache",)),
    ]


def test_a_load_failing_midway_never_leaves_half_synced_weights_taken_for_synced() -> None:
    generation = _generation()
    drop_in.colocate(Trainer(generation))
    original = generation.llm.llm_engine.model_executor.driver_worker.model_runner.model
    calls = 0

    def load_weights(weights: list[Any]) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("shape mismatch")
        original.load_weights(weights)

    generation.llm.llm_engine.model_executor.driver_worker.model_runner.model = type(
        "M", (), {"load_weights": staticmethod(load_weights)}
    )()
    with pytest.raises(RuntimeError, match="shape mismatch"):
        generation.sync_weights()
    assert ("sleep", 2) in CALLS
    assert generation._llm_weights_sleeping is True  # TRL's generate syncs again in full


def test_a_failure_with_the_engine_asleep_sleeps_nothing_again() -> None:
    generation = _generation()
    drop_in.colocate(Trainer(generation))
    generation.llm.fail["wake_up"] = RuntimeError("cuMemMap failed")
    with pytest.raises(RuntimeError, match="cuMemMap"):
        generation.sync_weights()
    assert ("sleep", 2) not in CALLS  # the wake never took: nothing is awake


def test_a_sleep_that_fails_too_raises_the_first_failure_and_says_the_engine_may_be_awake(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="hybridmem")
    generation = _generation()
    drop_in.colocate(Trainer(generation))
    generation.llm.fail["generate"] = RuntimeError("first")
    generation.llm.fail["sleep"] = RuntimeError("second")
    with pytest.raises(RuntimeError, match="first"):
        generation.generate([[1]], None, 1)
    said = [r.getMessage() for r in caplog.records]
    assert any("putting it back to sleep failed too (RuntimeError: second)" in s for s in said)
    assert any("it may be awake" in s for s in said)


class FakeOffloader:
    """hybridmem's Offloader as the drop-in uses it, over sizes the test sets."""

    made: ClassVar[list[FakeOffloader]] = []

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.sizes = [("optimizer", 300), ("optimizer", 500), ("optimizer", 200)]
        self.moved = 0
        self.closed = False
        FakeOffloader.made.append(self)

    @property
    def offloaded_groups(self) -> frozenset[str]:
        return frozenset({"optimizer"}) if self.moved else frozenset()

    def resident(self, groups: str, *, keep_walk: bool = False) -> list[tuple[str, int]]:
        assert groups == "optimizer"
        return [] if self.moved else list(self.sizes)

    def offload(self, groups: str, *, max_bytes: int | None = None) -> None:
        CALLS.append(("offload", max_bytes))
        self.moved = sum(s for _, s in self.sizes) if max_bytes is None else max_bytes

    def reload(self) -> None:
        CALLS.append(("reload",))
        self.moved = 0

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def by_need(monkeypatch: pytest.MonkeyPatch) -> dict[str, int | None]:
    """The KV cache's bytes and the device's free bytes, as the drop-in reads them."""
    sizes: dict[str, int | None] = {"kv": 1000, "free": 600 + NEED_MARGIN_BYTES}
    FakeOffloader.made.clear()
    monkeypatch.setattr(drop_in, "Offloader", FakeOffloader)
    monkeypatch.setattr(drop_in, "asleep_bytes", lambda tag: sizes["kv"])
    monkeypatch.setattr(drop_in, "release_cache", lambda **kwargs: None)
    monkeypatch.setattr(drop_in, "memory_info", lambda: type("M", (), {"free": sizes["free"]})())
    return sizes


def _optimizer() -> torch.optim.Optimizer:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()  # state filled
    return optimizer


def test_the_optimizer_state_moves_by_need_before_the_kv_wake_and_back_after_the_sleep(
    by_need: dict[str, int | None],
) -> None:
    generation = _generation()
    handle = drop_in.colocate(Trainer(generation, _optimizer()), offload_optimizer=True)
    generation.generate([[1]], None, 1)
    kv_wake = CALLS.index(("wake_up", ("kv_cache",)))
    weights_wake = CALLS.index(("wake_up", ("weights",)))
    offload = CALLS.index(("offload", 400))  # the deficit: free lacks 400 of the KV cache
    assert weights_wake < offload < kv_wake
    assert CALLS.index(("reload",)) > CALLS.index(("sleep", 2))
    assert handle.last_plan is not None
    assert handle.last_plan.deficit == 400
    assert handle.offloaded_groups() == []


def test_enough_free_moves_nothing_and_an_unreadable_need_moves_it_all(
    by_need: dict[str, int | None],
) -> None:
    generation = _generation()
    drop_in.colocate(Trainer(generation, _optimizer()), offload_optimizer=True)
    by_need["free"] = 10**9
    generation.generate([[1]], None, 1)
    assert not [c for c in CALLS if c[0] == "offload"]
    CALLS.clear()
    by_need["kv"] = None  # no sleep-mode pool to read
    generation.generate([[1]], None, 1)
    assert ("offload", None) in CALLS


def test_the_state_comes_back_before_the_optimizer_steps(by_need: dict[str, int | None]) -> None:
    generation = _generation()
    optimizer = _optimizer()
    handle = drop_in.colocate(Trainer(generation, optimizer), offload_optimizer=True)
    generation.sync_weights()
    generation.llm.wake_up(tags=["kv_cache"])  # woken outside generate, left awake
    assert handle.offloaded_groups() == ["optimizer"]
    optimizer.step()  # the pre-hook reloads first
    assert CALLS[-1] == ("reload",)
    assert handle.offloaded_groups() == []
    handle.remove()
    assert FakeOffloader.made[0].closed
    assert not optimizer._optimizer_step_pre_hooks


def test_a_failed_generate_brings_the_offloaded_state_back(by_need: dict[str, int | None]) -> None:
    generation = _generation()
    handle = drop_in.colocate(Trainer(generation, _optimizer()), offload_optimizer=True)
    generation.llm.fail["generate"] = RuntimeError("boom")
    with pytest.raises(RuntimeError):
        generation.generate([[1]], None, 1)
    assert handle.offloaded_groups() == []
    assert CALLS.index(("reload",)) > CALLS.index(("sleep", 2))


def test_no_optimizer_yet_or_no_state_yet_offloads_nothing(by_need: dict[str, int | None]) -> None:
    generation = _generation()
    trainer = Trainer(generation)  # before train() builds the optimizer
    drop_in.colocate(trainer, offload_optimizer=True)
    generation.generate([[1]], None, 1)
    model = torch.nn.Linear(2, 2)
    trainer.optimizer = torch.optim.AdamW(model.parameters())  # no step yet: no state
    generation.generate([[1]], None, 1)
    assert not [c for c in CALLS if c[0] == "offload"]
    assert not FakeOffloader.made


def test_remove_puts_trls_methods_back_and_keeps_an_earlier_wrapper() -> None:
    generation = _generation()

    def theirs(*args: Any) -> str:
        return "someone else's"

    generation.generate = theirs  # type: ignore[method-assign,assignment]
    handle = drop_in.colocate(Trainer(generation))
    assert generation.generate is not theirs
    handle.remove()
    assert generation.generate is theirs
    assert "sync_weights" not in vars(generation)
    assert "wake_up" not in vars(generation.llm)
    assert "sleep" not in vars(generation.llm)
    generation.sync_weights()
    assert ("enter", "weight_sync") not in CALLS


def test_a_second_call_returns_the_first_and_other_options_are_refused() -> None:
    generation = _generation()
    trainer = Trainer(generation, _optimizer())
    first = drop_in.colocate(trainer)
    assert drop_in.colocate(trainer) is first
    assert drop_in.colocate(generation) is first
    with pytest.raises(ValueError, match="already around this engine with offload_optimizer=False"):
        drop_in.colocate(trainer, offload_optimizer=True)


@pytest.mark.parametrize(
    ("make", "kwargs", "error", "says"),
    [
        (lambda: Trainer(_generation(mode="server")), {}, ValueError, "'server' mode"),
        (
            lambda: Trainer(_generation(enable_sleep_mode=False)),
            {"offload_optimizer": True},
            ValueError,
            "needs vllm_enable_sleep_mode=True",
        ),
        (lambda: _generation(), {"offload_optimizer": True}, ValueError, "pass the trainer"),
        (lambda: Trainer(None), {}, ValueError, "vllm_generation is None"),  # type: ignore[arg-type]
        (lambda: object(), {}, TypeError, "takes a TRL trainer with use_vllm=True"),
        (
            lambda: Trainer(_generation()),
            {"offload_optimizer": "yes"},
            TypeError,
            "offload_optimizer must be True or False",
        ),
    ],
    ids=["server", "no-sleep-mode", "bare-generation", "no-vllm", "not-trl", "bad-flag"],
)
def test_misuse_is_one_clear_error(
    make: Any, kwargs: dict[str, Any], error: type, says: str
) -> None:
    with pytest.raises(error, match=says):
        drop_in.colocate(make(), **kwargs)


def test_without_sleep_mode_the_phases_still_apply_and_a_failure_sleeps_nothing() -> None:
    generation = _generation(enable_sleep_mode=False)
    drop_in.colocate(Trainer(generation))
    generation.llm.fail["generate"] = RuntimeError("boom")
    with pytest.raises(RuntimeError):
        generation.generate([[1]], None, 1)
    assert ("enter", "rollout") in CALLS
    assert ("sleep", 2) not in CALLS
    assert generation._llm_weights_sleeping is False


def test_a_reload_that_finds_no_room_after_a_failure_says_the_state_is_retrievable(
    by_need: dict[str, int | None], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="hybridmem")
    generation = _generation()
    handle = drop_in.colocate(Trainer(generation, _optimizer()), offload_optimizer=True)
    generation.llm.fail["generate"] = RuntimeError("boom")
    offloader_reload = FakeOffloader.reload

    def no_room(self: FakeOffloader) -> None:
        raise OffloadError("out of memory: everything stays offloaded")

    FakeOffloader.reload = no_room  # type: ignore[method-assign]
    try:
        with pytest.raises(RuntimeError, match="boom"):
            generation.generate([[1]], None, 1)
    finally:
        FakeOffloader.reload = offloader_reload  # type: ignore[method-assign]
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "was put back to sleep (level 2)" in said  # the sleep is not blamed
    assert "did not come back" in said
    assert "Colocated.reload()" in said
    assert handle.offloaded_groups() == ["optimizer"]
    handle.reload()  # once there is room
    assert handle.offloaded_groups() == []
