"""HybridSwitch told what the rollout needs: only the deficit moves, cheapest first.

A real Offloader on CPU tensors standing in for device tensors, over the fake seam's
device (80 GiB, 2 GiB allocated, 1 GiB of others: 77 GiB free once the cache is
released). The rollout's need is set relative to that, so the deficit is a known
number of the model's bytes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

import hybridmem as hm
from hybridmem.engine.switch_offload import NEED_MARGIN_BYTES
from tests.conftest import FakeTorch, fail_resizes
from tests.test_offload import assert_bitwise_equal, make_model, snapshot
from tests.test_switch import FakeVLLM, ThreadRanks

GiB = 1 << 30
FREE = 77 * GiB  # the fake device's free memory once the trainer's cache is released


def switch_for(
    fake: FakeTorch,
    need: int | Callable[[], int | None] | None,
    backend: str | hm.BackendProfile = "vllm",
    **kw: Any,
) -> tuple[hm.HybridSwitch, hm.Offloader, torch.nn.Module, torch.optim.Optimizer, list[str]]:
    model, optimizer = make_model()
    offloader = hm.Offloader(model, optimizer)
    log: list[str] = []
    switch = hm.HybridSwitch(
        hm.VLLMEngine(FakeVLLM(log, fake)),
        backend,
        offloader,
        sync_weights=lambda adapter: None,
        confirm_timeout_s=0.0,
        rollout_need=need,
        **kw,
    )
    return switch, offloader, model, optimizer, log


def sizes(offloader: hm.Offloader, group: str) -> int:
    return sum(size for g, size in offloader.resident() if g == group)


def test_nothing_short_moves_nothing(fake_gpu: FakeTorch, cpu_as_device: list[int]) -> None:
    switch, offloader, model, optimizer, _ = switch_for(fake_gpu, FREE - NEED_MARGIN_BYTES)
    before = snapshot(model, optimizer)
    with switch.rollout():
        assert offloader.offloaded_groups == frozenset()
        assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())
    plan = switch.reports[-2].plan
    assert plan is not None
    assert plan.deficit == 0
    assert plan.moved == {}
    assert switch.offload_report is None
    assert_bitwise_equal(before, snapshot(model, optimizer))


def test_a_deficit_moves_the_optimizer_state_first_and_comes_back_bit_for_bit(
    fake_gpu: FakeTorch, cpu_as_device: list[int]
) -> None:
    model, optimizer = make_model()
    state = sizes(hm.Offloader(model, optimizer), "optimizer")
    switch, offloader, model, optimizer, _ = switch_for(fake_gpu, FREE - NEED_MARGIN_BYTES + state)
    before = snapshot(model, optimizer)
    for _ in range(3):
        with switch.rollout():
            assert offloader.offloaded_groups == {"optimizer"}
            assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())
        assert offloader.offloaded_groups == frozenset()
        plan = switch.reports[-2].plan
        assert plan is not None
        assert plan.deficit == state
        assert set(plan.moved) == {"optimizer"}
        assert plan.moved["optimizer"] == state
        assert "parameters" in plan.stayed
        assert "planned: need" in str(switch.reports[-2])
        assert_bitwise_equal(before, snapshot(model, optimizer))


def test_a_planned_switch_walks_the_targets_once_each_way_to_rollout(
    fake_gpu: FakeTorch, cpu_as_device: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan's walk is the offload's: the walk's Python work grows with the tensors."""
    from tests.test_need_plan import _count_walks

    model, optimizer = make_model()
    state = sizes(hm.Offloader(model, optimizer), "optimizer")
    switch, offloader, model, optimizer, _ = switch_for(fake_gpu, FREE - NEED_MARGIN_BYTES + state)
    before = snapshot(model, optimizer)
    walks = _count_walks(monkeypatch)
    for cycle in range(3):
        switch.to_rollout()
        assert len(walks) == cycle + 1
        assert offloader.offloaded_groups == {"optimizer"}
        switch.to_trainer()
        assert len(walks) == cycle + 1  # the reload walks nothing
    assert_bitwise_equal(before, snapshot(model, optimizer))


def test_a_need_the_state_cannot_cover_fails_before_anything_moves(
    fake_gpu: FakeTorch, cpu_as_device: list[int]
) -> None:
    switch, offloader, model, optimizer, log = switch_for(fake_gpu, FREE + GiB)
    before = snapshot(model, optimizer)
    with pytest.raises(hm.HybridSwitchError, match=r"still leaves it .* short"), switch.rollout():
        log.append("generate")
    assert "generate" not in log
    assert offloader.offloaded_groups == frozenset()
    assert_bitwise_equal(before, snapshot(model, optimizer))
    switch.rollout_need = None  # usable again: everything moves
    with switch.rollout():
        assert offloader.offloaded_groups
    assert switch.reports[-2].plan is None


def test_a_callable_need_is_asked_every_cycle_and_none_offloads_everything(
    fake_gpu: FakeTorch, cpu_as_device: list[int]
) -> None:
    asked: list[int | None] = [None, FREE - NEED_MARGIN_BYTES]
    calls: list[int | None] = []

    def need() -> int | None:
        calls.append(asked[len(calls)])
        return calls[-1]

    switch, offloader, *_ = switch_for(fake_gpu, need)
    with switch.rollout():
        everything = set(offloader.offloaded_groups)
    assert {"parameters", "optimizer"} <= everything
    assert switch.reports[-2].plan is None
    with switch.rollout():
        assert offloader.offloaded_groups == frozenset()
    assert len(calls) == 2


def test_the_plan_is_on_the_timeline(fake_gpu: FakeTorch, cpu_as_device: list[int]) -> None:
    switch, *_ = switch_for(fake_gpu, FREE - NEED_MARGIN_BYTES)
    timeline = hm.get_timeline()
    with hm.record():
        timeline.clear()
        with switch.rollout():
            pass
    plans = [e for e in timeline.events() if e.name == "switch:plan"]
    assert len(plans) == 1
    assert plans[0].args["deficit"] == 0
    assert plans[0].args["need"] == FREE - NEED_MARGIN_BYTES


@pytest.mark.parametrize(
    ("need", "error", "match"),
    [
        (-1, ValueError, "rollout_need must be bytes"),
        (1.5, TypeError, "rollout_need must be bytes"),
        (True, TypeError, "rollout_need must be bytes"),
        ("8GiB", TypeError, "rollout_need must be bytes"),
        ("Engine", TypeError, "or 'engine'"),
        (2 << 40, ValueError, "rollout_need must be bytes"),
    ],
)
def test_a_bad_need_is_refused_at_construction(
    fake_gpu: FakeTorch, need: object, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        hm.HybridSwitch(hm.VLLMEngine(FakeVLLM([], fake_gpu)), "vllm", rollout_need=need)  # type: ignore[arg-type]


def test_a_callable_that_answers_wrong_fails_the_switch_and_loses_nothing(
    fake_gpu: FakeTorch, cpu_as_device: list[int]
) -> None:
    switch, offloader, model, optimizer, _ = switch_for(fake_gpu, lambda: "lots")  # type: ignore[arg-type, return-value]
    before = snapshot(model, optimizer)
    with pytest.raises(TypeError, match="rollout_need must be bytes"), switch.rollout():
        pass
    assert offloader.offloaded_groups == frozenset()
    assert_bitwise_equal(before, snapshot(model, optimizer))


@pytest.mark.parametrize(("frees", "allocations"), [((1,), ()), ((2,), (1,)), ((), (1,))])
def test_a_partial_plan_under_faults_loses_nothing(
    fake_gpu: FakeTorch,
    cpu_as_device: list[int],
    monkeypatch: pytest.MonkeyPatch,
    frees: tuple[int, ...],
    allocations: tuple[int, ...],
) -> None:
    model, optimizer = make_model()
    state = sizes(hm.Offloader(model, optimizer), "optimizer")
    switch, offloader, model, optimizer, _ = switch_for(fake_gpu, FREE - NEED_MARGIN_BYTES + state)
    before = snapshot(model, optimizer)
    fail_resizes(monkeypatch, frees=frees, allocations=allocations)
    try:
        with switch.rollout():
            pass
    except (hm.OffloadError, hm.HybridSwitchError):
        pass
    offloader.reload()  # whatever a double fault left offloaded is still there, intact
    assert offloader.offloaded_groups == frozenset()
    assert_bitwise_equal(before, snapshot(model, optimizer))


class _Config:
    """What a vllm.LLM keeps of its engine config, as far as awake_bytes reads it."""

    def __init__(self, utilization: object) -> None:
        cache = type("CacheConfig", (), {"gpu_memory_utilization": utilization})()
        config = type("VllmConfig", (), {"cache_config": cache})()
        self.vllm_config = config


def engine_switch(
    fake: FakeTorch, utilization: object
) -> tuple[hm.HybridSwitch, hm.Offloader, torch.nn.Module, torch.optim.Optimizer, list[str]]:
    switch, offloader, model, optimizer, log = switch_for(fake, "engine")  # type: ignore[arg-type]
    switch.engine.engine.llm_engine = _Config(utilization)  # type: ignore[attr-defined]
    return switch, offloader, model, optimizer, log


def test_the_engines_own_setting_plans_the_hand_back(
    fake_gpu: FakeTorch, cpu_as_device: list[int]
) -> None:
    # the fake device has 80 GiB: vLLM at 0.5 takes 40 GiB awake, and 77 GiB are free
    switch, offloader, *_ = engine_switch(fake_gpu, 0.5)
    with switch.rollout():
        assert offloader.offloaded_groups == frozenset()
    plan = switch.reports[-2].plan
    assert plan is not None
    assert (plan.need, plan.deficit) == (40 * GiB, 0)
    # at 0.99 it takes 79.2 GiB: more than the whole trainer state frees, refused first
    switch, offloader, model, optimizer, _ = engine_switch(fake_gpu, 0.99)
    before = snapshot(model, optimizer)
    with pytest.raises(hm.HybridSwitchError, match="short"), switch.rollout():
        pass
    assert offloader.offloaded_groups == frozenset()
    assert_bitwise_equal(before, snapshot(model, optimizer))


@pytest.mark.parametrize("utilization", [None, 0, 1.5, True, "0.5"])
def test_an_engine_that_says_nothing_fails_the_switch_before_anything_moves(
    fake_gpu: FakeTorch, cpu_as_device: list[int], utilization: object
) -> None:
    switch, offloader, model, optimizer, log = engine_switch(fake_gpu, utilization)
    before = snapshot(model, optimizer)
    nothing = pytest.raises(hm.HybridSwitchError, match="says nothing of what it takes awake")
    with nothing, switch.rollout():
        log.append("generate")
    assert "generate" not in log
    assert offloader.offloaded_groups == frozenset()
    assert_bitwise_equal(before, snapshot(model, optimizer))


def test_sglang_says_its_static_share() -> None:
    class Engine:
        server_args = type("ServerArgs", (), {"mem_fraction_static": 0.75})()

        def release_memory_occupation(self) -> None: ...

        def resume_memory_occupation(self, tags: list[str] | None = None) -> None: ...

    assert hm.SGLangEngine(Engine()).awake_bytes(80 * GiB) == 60 * GiB
    Engine.server_args = None
    assert hm.SGLangEngine(Engine()).awake_bytes(80 * GiB) is None


def _two_ranks(
    fake: FakeTorch, needs: dict[int, int], cycles: int = 1
) -> tuple[dict[int, list[str]], dict[int, Any], ThreadRanks]:
    """Two ranks (threads), each with its own model and need; what each switch did."""
    ranks = ThreadRanks(2)
    outcomes: dict[int, list[str]] = {0: [], 1: []}
    seen: dict[int, Any] = {}

    def rank(r: int) -> None:
        # no allocator steps: the allocator's scopes are process-wide, one per rank here
        plain = hm.BackendProfile("plain", "no allocator steps", {})
        switch, offloader, model, optimizer, _ = switch_for(fake, needs[r], plain, barrier=ranks)
        switch.rank = r
        before = snapshot(model, optimizer)
        seen[r] = {"plans": [], "groups": [], "optimizer": sizes(offloader, "optimizer")}
        for _ in range(cycles):
            try:
                with switch.rollout():
                    seen[r]["groups"].append(set(offloader.offloaded_groups))
                outcomes[r].append("ok")
            except hm.HybridSwitchError as exc:
                outcomes[r].append(f"HybridSwitchError: {exc}")
            seen[r]["plans"].append(switch.plan)
            seen[r]["left"] = set(offloader.offloaded_groups)
            assert_bitwise_equal(before, snapshot(model, optimizer))

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert not any(thread.is_alive() for thread in threads), "a rank hung"
    return outcomes, seen, ranks


def test_every_rank_moves_the_largest_deficit_of_the_ranks(
    fake_gpu: FakeTorch, cpu_as_device: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.test_need_plan import _count_walks

    model, optimizer = make_model()
    state = sizes(hm.Offloader(model, optimizer), "optimizer")
    walks = _count_walks(monkeypatch)
    # rank 0 lacks nothing, rank 1 lacks its optimizer state: both move it
    outcomes, seen, ranks = _two_ranks(
        fake_gpu, {0: FREE - NEED_MARGIN_BYTES, 1: FREE - NEED_MARGIN_BYTES + state}, cycles=2
    )
    assert outcomes == {0: ["ok", "ok"], 1: ["ok", "ok"]}
    # One walk a rank a switch to rollout, the agreed plan made from the plan's walk
    # (and one a rank where _two_ranks reads the optimizer state's size).
    assert len(walks) == 2 * 2 + 2
    for r in (0, 1):
        assert seen[r]["groups"] == [{"optimizer"}] * 2
        plan = seen[r]["plans"][-1]
        assert plan.deficit == state
        assert plan.moved == {"optimizer": state}
        assert seen[r]["left"] == set()
    assert seen[0]["plans"][-1].need == FREE - NEED_MARGIN_BYTES  # its own need kept
    assert seen[0]["plans"][-1].short == 0
    by_rank = {r: [p for rr, p in ranks.points if rr == r] for r in (0, 1)}
    assert by_rank[0] == by_rank[1]
    assert by_rank[0][0] == "barrier_plan"  # met before anything moved


def test_one_ranks_unmeetable_need_fails_every_rank_before_anything_moves(
    fake_gpu: FakeTorch, cpu_as_device: list[int]
) -> None:
    outcomes, seen, _ = _two_ranks(fake_gpu, {0: FREE - NEED_MARGIN_BYTES, 1: FREE + GiB})
    assert outcomes[1][0].startswith("HybridSwitchError")
    assert "short" in outcomes[1][0]
    assert outcomes[0][0].startswith("HybridSwitchError: rank 0: the switch rank 1 failed at ")
    assert "stage 'plan'" in outcomes[0][0]
    for r in (0, 1):
        assert seen[r]["groups"] == []  # no rollout ran
        assert seen[r]["left"] == set()  # nothing was offloaded, nothing left behind
