"""The offload planned by need: the plan (pure), and an Offloader that moves only it.

The Offloader runs for real on CPU tensors standing in for device tensors (as in
tests/test_offload.py): a partial offload frees exactly the planned storages, a reload
puts every one back bit for bit, and an injected fault at any free or allocation loses
nothing.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hybridmem as hm
from hybridmem.memory.need_plan import NEED_ORDER, NeedPlan, choose, plan_by_need
from hybridmem.memory.offload import _place_bytes
from tests.conftest import fail_resizes
from tests.test_offload import assert_bitwise_equal, make_model, snapshot

GROUPS = st.sampled_from(["parameters", "buffers", "gradients", "optimizer", "tensors"])
STORAGES = st.lists(st.tuples(GROUPS, st.integers(1, 1 << 20)), max_size=30)


def test_the_optimizer_state_moves_first_and_the_parameters_last() -> None:
    storages = [("parameters", 100), ("gradients", 50), ("optimizer", 60), ("optimizer", 40)]
    plan = plan_by_need(storages, need=130, free=30)  # deficit 100: the optimizer state
    assert plan.deficit == 100
    assert plan.moved == {"optimizer": 100}
    assert plan.stayed == {"parameters": 100, "gradients": 50}
    plan = plan_by_need(storages, need=160, free=30)  # 130: the gradients too
    assert plan.moved == {"optimizer": 100, "gradients": 50}
    assert plan.stayed == {"parameters": 100}
    assert plan.short == 0


def test_nothing_short_moves_nothing_and_too_much_need_is_short() -> None:
    storages = [("parameters", 100), ("optimizer", 60)]
    assert plan_by_need(storages, need=10, free=500, margin=100).moved == {}
    plan = plan_by_need(storages, need=1000, free=500, margin=100)
    assert plan.moved == {"parameters": 100, "optimizer": 60}
    assert plan.short == 600 - 160
    assert "still" in str(plan)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"need": -1, "free": 0}, ValueError, "need must be a whole number of bytes"),
        ({"need": 1.5, "free": 0}, TypeError, "need must be a whole number of bytes"),
        ({"need": 1, "free": True}, TypeError, "free must be a whole number of bytes"),
        ({"need": 1, "free": 0, "margin": -2}, ValueError, "margin must be"),
    ],
)
def test_bad_sizes_are_refused_by_name(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        plan_by_need([], **kwargs)


@given(STORAGES, st.integers(0, 1 << 22), st.integers(0, 1 << 22), st.integers(0, 1 << 16))
def test_a_plan_covers_the_deficit_with_less_than_one_storage_over(
    storages: list[tuple[str, int]], need: int, free: int, margin: int
) -> None:
    plan = plan_by_need(storages, need, free, margin)
    total = sum(size for _, size in storages)
    assert plan.nbytes + sum(plan.stayed.values()) == total
    assert plan.deficit == max(0, need + margin - free)
    if plan.short:
        assert plan.nbytes == total  # everything moved, still short
        assert plan.short == plan.deficit - total
    else:
        assert plan.nbytes >= plan.deficit
        largest = max((size for _, size in storages), default=0)
        assert plan.nbytes < plan.deficit + largest or plan.deficit == 0
    if plan.deficit == 0:
        assert plan.moved == {}
    # cheapest first: no group moves while a cheaper one stays whole on the device
    ranks = [NEED_ORDER.index(g) for g in plan.moved]
    for group in plan.stayed:
        if group in plan.moved:
            continue
        assert all(NEED_ORDER.index(group) > r for r in ranks if r != NEED_ORDER.index(group))


def test_choose_keeps_the_targets_order_among_the_chosen() -> None:
    items = ["w0", "m0", "w1", "m1"]
    sizes = [4, 4, 4, 4]
    groups = ["parameters", "optimizer", "parameters", "optimizer"]
    assert choose(items, sizes, groups, 5) == ["m0", "m1"]
    assert choose(items, sizes, groups, 9) == ["w0", "m0", "m1"]
    assert choose(items, sizes, groups, 0) == []


def test_the_plan_is_json_ready() -> None:
    plan = plan_by_need([("optimizer", 8)], need=4, free=0)
    assert plan.as_dict()["moved"] == {"optimizer": 8}
    assert isinstance(plan, NeedPlan)


# --------------------------------------------------------------------------- #
# The Offloader, moving only the plan
# --------------------------------------------------------------------------- #


def optimizer_bytes(off: hm.Offloader) -> int:
    return sum(size for group, size in off.resident() if group == "optimizer")


def test_a_partial_offload_frees_only_the_optimizer_state_and_reloads_bit_for_bit(
    cpu_as_device: list[int],
) -> None:
    model, optimizer = make_model()
    before = snapshot(model, optimizer)
    off = hm.Offloader(model, optimizer)
    resident = off.resident()
    assert {group for group, _ in resident} >= {"parameters", "optimizer", "gradients"}
    state = optimizer_bytes(off)
    report = off.offload(max_bytes=1)  # one byte short: the first optimizer storage
    assert off.offloaded_groups == {"optimizer"}
    assert 0 < report.nbytes < state
    assert sum(size for _, size in off.resident()) == sum(s for _, s in resident) - report.nbytes
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())
    off.reload()
    assert off.offloaded_groups == frozenset()
    assert_bitwise_equal(before, snapshot(model, optimizer))
    off.offload(max_bytes=state + 1)  # a byte more: gradients start
    assert off.offloaded_groups == {"optimizer", "gradients"}
    off.reload()
    assert_bitwise_equal(before, snapshot(model, optimizer))


def _count_walks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the Offloader's walks of its targets (one entry per walk)."""
    from hybridmem.memory import offload as offload_module
    from hybridmem.memory import targets

    walks: list[int] = []
    real = targets.device_storages

    def counted(*args: Any, **kwargs: Any) -> Any:
        walks.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(offload_module, "device_storages", counted)
    return walks


def test_a_kept_walk_is_the_next_partial_offloads_and_moves_the_same(
    cpu_as_device: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = make_model()
    before = snapshot(model, optimizer)
    off = hm.Offloader(model, optimizer)
    state = optimizer_bytes(off)
    plain = off.offload(max_bytes=state)
    off.reload()
    walks = _count_walks(monkeypatch)
    resident = off.resident(keep_walk=True)
    kept = off.offload(max_bytes=state)
    assert len(walks) == 1  # the offload took resident()'s walk
    assert (kept.nbytes, off.offloaded_groups) == (plain.nbytes, frozenset({"optimizer"}))
    assert sum(size for _, size in resident) - kept.nbytes == sum(s for _, s in off.resident())
    off.reload()
    assert_bitwise_equal(before, snapshot(model, optimizer))
    walks.clear()
    off.offload(max_bytes=state)  # the kept walk was taken once: this one walks
    off.reload()
    assert len(walks) == 1


def test_a_kept_walk_is_dropped_by_any_other_call_and_by_a_resize(
    cpu_as_device: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = make_model()
    before = snapshot(model, optimizer)
    off = hm.Offloader(model, optimizer)
    state = optimizer_bytes(off)
    walks = _count_walks(monkeypatch)
    off.resident(keep_walk=True)
    off.resident()  # another call between: the offload walks again
    off.offload(max_bytes=state)
    assert len(walks) == 3
    off.reload()
    # A storage resized since the walk: the kept sizes are stale, the offload walks
    # and moves what is there now.
    off.resident(keep_walk=True)
    grown = next(iter(optimizer.state.values()))["exp_avg"]
    old = grown.detach().clone()
    grown.untyped_storage().resize_(grown.untyped_storage().nbytes() + 512)
    walks.clear()
    report = off.offload(max_bytes=state + 512)
    assert len(walks) == 1
    off.reload()
    assert torch.equal(grown, old)
    assert report.nbytes >= state + 512
    assert_bitwise_equal(before, snapshot(model, optimizer))
    with pytest.raises(TypeError, match="keep_walk must be True or False"):
        off.resident(keep_walk=1)  # type: ignore[arg-type]


def test_max_bytes_zero_moves_nothing_and_bad_values_are_refused(
    cpu_as_device: list[int],
) -> None:
    model, optimizer = make_model()
    off = hm.Offloader(model, optimizer)
    assert off.offload(max_bytes=0).nbytes == 0
    assert off.offloaded_groups == frozenset()
    with pytest.raises(ValueError, match="max_bytes must be an int >= 0 or None"):
        off.offload(max_bytes=-1)
    with pytest.raises(TypeError, match="max_bytes must be an int >= 0 or None"):
        off.start_offload(max_bytes=2.5)  # type: ignore[arg-type]


def test_a_partial_offload_in_flight_frees_only_its_storages(cpu_as_device: list[int]) -> None:
    model, optimizer = make_model()
    before = snapshot(model, optimizer)
    off = hm.Offloader(model, optimizer)
    flight = off.start_offload(max_bytes=optimizer_bytes(off))
    assert off.offloaded_groups == frozenset()  # nothing freed while the copies run
    flight.finish()
    assert off.offloaded_groups == {"optimizer"}
    off.reload()
    assert_bitwise_equal(before, snapshot(model, optimizer))


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    fraction=st.floats(0.0, 1.2),
    frees=st.sets(st.integers(1, 12), max_size=2),
    allocations=st.sets(st.integers(1, 12), max_size=2),
    keep_walk=st.booleans(),
)
def test_a_partial_offload_under_injected_faults_loses_nothing(
    cpu_as_device: list[int],
    monkeypatch: pytest.MonkeyPatch,
    fraction: float,
    frees: set[int],
    allocations: set[int],
    keep_walk: bool,
) -> None:
    model, optimizer = make_model()
    before = snapshot(model, optimizer)
    off = hm.Offloader(model, optimizer)
    total = sum(size for _, size in off.resident(keep_walk=keep_walk))
    with monkeypatch.context() as patched:
        fail_resizes(patched, frees=tuple(frees), allocations=tuple(allocations))
        with contextlib.suppress(hm.OffloadError, RuntimeError):
            off.offload(max_bytes=int(total * fraction))
        with contextlib.suppress(hm.OffloadError, RuntimeError):
            off.reload()
    off.reload()  # what a fault left offloaded comes back now, intact
    assert off.offloaded_groups == frozenset()
    assert_bitwise_equal(before, snapshot(model, optimizer))


def test_the_host_pool_is_as_long_as_what_a_partial_offload_moves(
    cpu_as_device: list[int],
) -> None:
    model, optimizer = make_model()
    before = snapshot(model, optimizer)
    off = hm.Offloader(model, optimizer)
    resident = off.resident()
    state = optimizer_bytes(off)
    optimizer_sizes = [size for group, size in resident if group == "optimizer"]
    off.offload(max_bytes=state)  # the optimizer state: a prefix of the pool
    assert off.offloaded_groups == {"optimizer"}
    assert off.host_bytes == sum(_place_bytes(size) for size in optimizer_sizes)
    off.reload()
    assert_bitwise_equal(before, snapshot(model, optimizer))
    off.offload()  # everything: the pool grows to the whole state
    assert off.host_bytes == sum(_place_bytes(size) for _, size in resident)
    off.reload()
    assert_bitwise_equal(before, snapshot(model, optimizer))


def test_a_second_partial_offload_grows_the_pool_keeping_the_first(
    cpu_as_device: list[int],
) -> None:
    model, optimizer = make_model()
    before = snapshot(model, optimizer)
    off = hm.Offloader(model, optimizer)
    off.offload(max_bytes=1)  # one optimizer storage
    first = off.host_bytes
    off.offload(max_bytes=optimizer_bytes(off) + 1)  # the rest of it, and a gradient
    assert off.offloaded_groups == {"optimizer", "gradients"}
    assert off.host_bytes > first
    off.reload()
    assert off.offloaded_groups == frozenset()
    assert_bitwise_equal(before, snapshot(model, optimizer))


def test_a_growing_plan_pins_only_the_difference_and_moves_nothing_already_there(
    cpu_as_device: list[int],
) -> None:
    """The pool grows by a chunk: cycle after cycle of a slightly larger deficit, only
    the new bytes are pinned, and bytes already offloaded are neither copied nor moved."""
    model, optimizer = make_model()
    before = snapshot(model, optimizer)
    off = hm.Offloader(model, optimizer)
    off.offload(max_bytes=1)  # one optimizer storage
    first = off.host_bytes
    assert cpu_as_device == [first]
    (chunk,) = off._host.chunks
    held = chunk.tensor.clone()  # the first part, as offloaded
    off.offload(max_bytes=optimizer_bytes(off) + 1)  # more, while the first is offloaded
    assert cpu_as_device == [first, off.host_bytes - first]  # the difference, pinned once
    assert off._host.chunks[0] is chunk  # the first chunk stays, with what it holds
    assert torch.equal(chunk.tensor, held)
    off.reload()
    assert_bitwise_equal(before, snapshot(model, optimizer))
    grown = off.host_bytes
    off.offload(max_bytes=1)  # a smaller part fits the pool: nothing pinned
    off.reload()
    off.offload()  # everything: one more chunk, up to the whole state
    assert cpu_as_device[:2] == [first, grown - first]
    assert cpu_as_device[2:] == [off.host_bytes - grown]
    off.reload()
    assert_bitwise_equal(before, snapshot(model, optimizer))


def test_new_targets_start_a_pool_of_their_own_places(cpu_as_device: list[int]) -> None:
    """After the targets change, a pool of several chunks is let go (its seams could
    cut a new place in two); the new layout gets one chunk."""
    model, optimizer = make_model()
    off = hm.Offloader(model, optimizer)
    off.offload(max_bytes=1)
    off.reload()
    off.offload(max_bytes=optimizer_bytes(off) + 1)
    off.reload()
    assert len(off._host.chunks) == 2
    first_layer: Any = next(iter(model.children()))
    first_layer.weight.data = torch.zeros(32, 16)  # a new storage: the layout changed
    before = snapshot(model, optimizer)
    off.offload()
    assert len(off._host.chunks) == 1
    assert cpu_as_device.count(-1) == 2  # both earlier chunks unpinned
    off.reload()
    assert_bitwise_equal(before, snapshot(model, optimizer))


def test_a_place_across_two_chunks_is_refused_not_copied_in_part() -> None:
    from hybridmem.memory.host_pool import HostPool

    pool = HostPool(pin_memory=False)
    pool.grow(100, None)
    pool.grow(300, None)
    straddling = SimpleNamespace(offset=64, nbytes=64)
    with pytest.raises(RuntimeError, match=r"no chunk holding bytes \[64, 128\)"):
        pool.place(straddling)  # type: ignore[arg-type]
    chunk, span = pool.place(SimpleNamespace(offset=100, nbytes=200))  # type: ignore[arg-type]
    assert (chunk.start, span) == (100, slice(0, 200))
    with pytest.raises(ValueError, match="max_host_bytes=400"):
        pool.grow(500, 400)
    assert pool.nbytes == 300  # refused before anything was allocated


def test_max_host_bytes_allows_a_partial_offload_that_fits_it(cpu_as_device: list[int]) -> None:
    model, optimizer = make_model()
    before = snapshot(model, optimizer)
    probe = hm.Offloader(model, optimizer)
    state = optimizer_bytes(probe)
    limit = sum(_place_bytes(size) for group, size in probe.resident() if group == "optimizer")
    off = hm.Offloader(model, optimizer, max_host_bytes=limit)
    off.offload(max_bytes=state)
    assert off.offloaded_groups == {"optimizer"}
    with pytest.raises(ValueError, match="max_host_bytes"):
        off.offload()  # the rest would need more host memory: refused before pinning
    assert off.offloaded_groups == {"optimizer"}  # what was offloaded stays retrievable
    off.reload()
    assert_bitwise_equal(before, snapshot(model, optimizer))
