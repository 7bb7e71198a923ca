"""hm.compact on the CPU: CPU tensors stand in for device tensors, the seam says which are classic.

The whole data path runs for real (staging, freeing and reallocating storages in
place, batches, the allocator scope around it, every failure path); the fake seam
records the allocator settings each reallocation ran under. The GPU test
(tests/gpu/test_compact_gpu.py) checks that the cache really goes on an H200.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hybridmem as hm
from hybridmem import _torch
from hybridmem.memory.compact import CompactError
from tests.conftest import FakeTorch, fail_resizes, patch_seam


def make_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(64, 16),
        torch.nn.Linear(16, 32),
        torch.nn.BatchNorm1d(32),
        torch.nn.Linear(32, 64, bias=False),
    )


def contents(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class Allocator:
    """Records each reallocation with the expandable setting it ran under.

    A storage is "in a classic segment" until it is reallocated while expandable
    segments are on (``classic`` holds the keys of those that start elsewhere).
    """

    def __init__(self, fake: FakeTorch, monkeypatch: pytest.MonkeyPatch) -> None:
        self.fake = fake
        self.calls: list[tuple[int, str | None]] = []
        self.expandable: set[int] = set()  # storages now in expandable segments
        self.fail_at: int | None = None  # the index of a call that raises
        self.error: BaseException = torch.OutOfMemoryError("CUDA out of memory (injected)")
        self.fail_classic = False  # reallocations outside expandable segments fail too
        self.fail_calls: set[int] = set()  # indices of calls (frees too) that raise
        real = _torch.resize_storage

        def resize(storage: torch.UntypedStorage, nbytes: int) -> None:
            mode = fake.torch_state.get("expandable_segments")
            index = len(self.calls)
            self.calls.append((nbytes, mode))
            if index in self.fail_calls or (
                nbytes and (index == self.fail_at or (self.fail_classic and mode != "True"))
            ):
                raise self.error
            real(storage, nbytes)
            if nbytes:
                key = _torch.storage_key(storage)
                (self.expandable.add if mode == "True" else self.expandable.discard)(key)

        patch_seam(monkeypatch, "resize_storage", resize)
        patch_seam(
            monkeypatch,
            "is_legacy_ipc_capable",
            lambda t: _torch.storage_key(t.untyped_storage()) not in self.expandable,
        )

    def reallocations(self) -> list[str | None]:
        return [mode for nbytes, mode in self.calls if nbytes]


@pytest.fixture
def alloc(fake: FakeTorch, cpu_as_device: list[int], monkeypatch: pytest.MonkeyPatch) -> Allocator:
    return Allocator(fake, monkeypatch)  # every CPU storage starts "in a classic segment"


def compact_under_faults(alloc: Allocator, compact: Callable[[], object]) -> None:
    """Run ``compact`` with ``alloc``'s faults; take back what a CompactError holds."""
    try:
        compact()
    except CompactError as exc:  # nowhere to go: the pool has it all
        alloc.fail_at = None
        alloc.fail_calls = set()
        alloc.fail_classic = False
        exc.offloader.reload()
        exc.offloader.close()
    except hm.OffloadError as exc:  # refused while taking them off: all in place
        refused = str(exc)
        assert "every target is as it was" in refused


def assert_same(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict()
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert torch.equal(after[key], value), key


def test_moves_in_place_under_expandable_segments(alloc: Allocator, fake: FakeTorch) -> None:
    model = make_model()
    params = list(model.parameters())
    storages = [_torch.storage_key(p.untyped_storage()) for p in params]
    linear = model[1]
    assert isinstance(linear, torch.nn.Linear)
    view = linear.weight[2:5]  # a view a user kept: it must see the moved bytes
    before = contents(model)
    report = hm.compact(model)
    assert report.moved == len(
        {*storages, *(_torch.storage_key(b.untyped_storage()) for b in model.buffers())}
    )
    assert report.nbytes == sum(p.untyped_storage().nbytes() for p in params) + sum(
        b.untyped_storage().nbytes() for b in model.buffers()
    )
    assert report.kept == 0
    assert report.reason == ""
    assert list(model.parameters()) == params  # the same Parameter objects
    assert [_torch.storage_key(p.untyped_storage()) for p in params] == storages
    assert alloc.reallocations()
    assert set(alloc.reallocations()) == {"True"}
    assert fake.torch_state.get("expandable_segments") != "True"  # the scope was left
    assert_same(model, before)
    assert torch.equal(view, before["1.weight"][2:5])
    assert "empty_cache" in fake.events
    assert "moved" in str(report)
    assert "expandable" in str(report)


def test_tied_weights_move_once_and_stay_tied(alloc: Allocator) -> None:
    embed = torch.nn.Embedding(32, 8)
    head = torch.nn.Linear(8, 32, bias=False)
    head.weight = embed.weight
    model = torch.nn.ModuleList([embed, head])
    before = embed.weight.detach().clone()
    report = hm.compact(model)
    assert report.moved == 1
    assert head.weight is embed.weight
    assert torch.equal(embed.weight, before)


def test_only_classic_storages_move(alloc: Allocator) -> None:
    model = make_model()
    linear = model[1]
    assert isinstance(linear, torch.nn.Linear)
    moved = linear.weight.untyped_storage()
    alloc.expandable = {
        _torch.storage_key(t.untyped_storage())
        for t in [*model.parameters(), *model.buffers()]
        if t.untyped_storage().data_ptr() != moved.data_ptr()
    }
    before = contents(model)
    report = hm.compact(model)
    assert (report.moved, report.nbytes) == (1, moved.nbytes())
    assert report.kept == len(list(model.parameters())) + len(list(model.buffers())) - 1
    assert alloc.reallocations() == ["True"]
    assert_same(model, before)


def test_a_second_compact_moves_nothing(alloc: Allocator) -> None:
    model = make_model()
    first = hm.compact(model)
    again = hm.compact(model)
    assert first.moved > 0
    assert (again.moved, again.kept) == (0, first.moved)


def test_foreign_storage_is_kept(alloc: Allocator, monkeypatch: pytest.MonkeyPatch) -> None:
    model = torch.nn.Linear(4, 4)
    foreign = _torch.storage_key(model.weight.untyped_storage())
    real = _torch.storage_resizable
    patch_seam(
        monkeypatch,
        "storage_resizable",
        lambda s: _torch.storage_key(s) != foreign and real(s),
    )
    report = hm.compact(model)
    assert (report.moved, report.kept) == (1, 1)  # the bias moved, the imported weight stayed


def test_groups_select(alloc: Allocator) -> None:
    model = make_model()
    report = hm.compact(model, groups="buffers")
    assert report.moved == len(list(model.buffers()))
    with pytest.raises(ValueError, match="unknown group 'weights'; groups are parameters"):
        hm.compact(model, groups="weights")


def test_everything_leaves_before_anything_comes_back(alloc: Allocator, fake: FakeTorch) -> None:
    # Otherwise a storage reallocated early lands in the classic segment of one not
    # moved yet (the allocator's best fit ignores the setting).
    model = make_model()
    hm.compact(model)
    frees = [i for i, (nbytes, _) in enumerate(alloc.calls) if nbytes == 0]
    reallocations = [i for i, (nbytes, _) in enumerate(alloc.calls) if nbytes]
    assert max(frees) < min(reallocations)
    # and the emptied segments went back to the driver in between (workspaces first)
    assert fake.events.index("empty_cache") < len(fake.events)
    assert "set:expandable_segments:True" in fake.events


def test_bad_arguments(alloc: Allocator) -> None:
    with pytest.raises(TypeError, match=r"targets\[0\] is a str"):
        hm.compact("model")
    with pytest.raises(TypeError, match="release_cache"):
        hm.compact(torch.nn.Linear(2, 2), release_cache="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unexpected keyword"):
        hm.compact(torch.nn.Linear(2, 2), staging_bytes=1)  # type: ignore[call-arg]


def test_several_devices_refused_before_anything_moves(alloc: Allocator) -> None:
    tensors = [torch.ones(4), torch.empty(4, device="meta")]
    with pytest.raises(ValueError, match="span several devices"):
        hm.compact(tensors)
    assert alloc.calls == []


@pytest.mark.parametrize("why", ["disabled", "async", "env", "no gpu"])
def test_nothing_moves_and_the_report_says_why(
    why: str, fake: FakeTorch, monkeypatch: pytest.MonkeyPatch, cpu_as_device: list[int]
) -> None:
    resized: list[int] = []
    patch_seam(monkeypatch, "resize_storage", lambda s, n: resized.append(n))
    patch_seam(monkeypatch, "is_legacy_ipc_capable", lambda t: True)
    expected = {
        "disabled": "HYBRIDMEM_DISABLE",
        "async": "cudaMallocAsync",
        "env": "expandable_segments:False",
        "no gpu": "no target tensor is on a GPU",
    }[why]
    if why == "disabled":
        monkeypatch.setenv("HYBRIDMEM_DISABLE", "1")
    elif why == "async":
        fake.backend = "cudaMallocAsync"
    elif why == "env":
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    else:
        patch_seam(monkeypatch, "is_device_tensor", lambda t: False)
    report = hm.compact(torch.nn.Linear(3, 3))
    assert report.moved == 0
    assert expected in report.reason
    assert expected in str(report)
    assert resized == []


def test_no_room_in_expandable_goes_back_classic_intact(
    alloc: Allocator, fake: FakeTorch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="hybridmem")
    model = make_model()
    before = contents(model)
    count = len(list(model.parameters())) + len(list(model.buffers()))
    alloc.fail_at = count + 1  # the second reallocation, after every free
    report = hm.compact(model)
    assert (report.moved, report.stuck) == (0, count)
    assert "back in classic segments" in str(report)
    assert "no room in expandable ones" in caplog.text
    assert alloc.reallocations()[-count:] == ["False"] * count
    assert_same(model, before)
    assert fake.torch_state.get("expandable_segments") != "True"


def test_interrupt_puts_everything_back_and_raises(
    alloc: Allocator, fake: FakeTorch, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hybridmem.memory.compact as compact_module

    def interrupted(index: int | None) -> None:  # where the emptied segments go back
        raise KeyboardInterrupt

    monkeypatch.setattr(compact_module, "_release_classic", interrupted)
    model = make_model()
    before = contents(model)
    with pytest.raises(KeyboardInterrupt):
        hm.compact(model)
    assert_same(model, before)
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())
    assert fake.torch_state.get("expandable_segments") != "True"


def test_fits_nowhere_keeps_the_bytes_retrievable(alloc: Allocator) -> None:
    model = torch.nn.Linear(8, 8)
    before = contents(model)
    alloc.fail_classic = True
    alloc.fail_at = 2  # the first reallocation, in expandable segments
    with pytest.raises(CompactError, match=r"error\.offloader\.reload\(\)") as info:
        hm.compact(model)
    assert isinstance(info.value, hm.OffloadError)
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    alloc.fail_classic = False
    alloc.fail_at = None
    info.value.offloader.reload()  # once there is room: nothing was lost
    info.value.offloader.close()
    assert_same(model, before)


def test_taking_them_off_fails_with_everything_in_place(
    alloc: Allocator, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make_model()
    before = contents(model)
    alloc.fail_at = -1
    fail_resizes(monkeypatch, frees=(3,))
    with pytest.raises(hm.OffloadError, match="every target is as it was"):
        hm.compact(model)
    assert_same(model, before)


def test_a_failed_free_whose_put_back_fails_is_brought_back(alloc: Allocator) -> None:
    # Freeing fails at the third storage, and reallocating the two freed before it
    # fails too: the Offloader keeps them offloaded, and compact brings them back
    # before it unpins the pool (their only copy).
    model = make_model()
    before = contents(model)
    alloc.error = RuntimeError("device refused (injected)")
    alloc.fail_calls = {2, 3}  # frees 0 and 1 succeed; free 2 and re-allocation 3 fail
    with pytest.raises(hm.OffloadError, match="every target is as it was") as info:
        hm.compact(model)
    assert not isinstance(info.value, CompactError)
    assert isinstance(info.value.__cause__, hm.OffloadError)
    assert info.value.__cause__.offloaded == {"tensors"}  # compact moves byte views
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())
    assert_same(model, before)


def test_a_failed_free_that_fits_nowhere_after_keeps_the_bytes(alloc: Allocator) -> None:
    model = make_model()
    before = contents(model)
    alloc.error = RuntimeError("device refused (injected)")
    alloc.fail_calls = {2, 3}
    alloc.fail_classic = True  # and no room to bring them back either
    with pytest.raises(CompactError, match=r"error\.offloader\.reload\(\)") as info:
        hm.compact(model)
    alloc.fail_calls.clear()
    alloc.fail_classic = False
    info.value.offloader.reload()
    info.value.offloader.close()
    assert_same(model, before)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    fail_at=st.one_of(st.none(), st.integers(0, 30)),
    fail_calls=st.sets(st.integers(0, 30), max_size=3),  # frees too: double faults
    classic_fails=st.booleans(),
    interrupt=st.booleans(),
)
def test_injected_faults_never_lose_data(
    alloc: Allocator,
    fake: FakeTorch,
    fail_at: int | None,
    fail_calls: set[int],
    classic_fails: bool,
    interrupt: bool,
) -> None:
    alloc.calls.clear()
    alloc.expandable.clear()
    alloc.fail_at = fail_at
    alloc.fail_calls = fail_calls
    alloc.fail_classic = classic_fails and fail_at is not None
    alloc.error = KeyboardInterrupt() if interrupt else torch.OutOfMemoryError("injected")
    model = make_model()
    before = contents(model)
    compact_under_faults(alloc, lambda: hm.compact(model))
    assert_same(model, before)
    assert fake.torch_state.get("expandable_segments") != "True"
    alloc.fail_at = None
    alloc.fail_classic = False
