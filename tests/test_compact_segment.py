"""hm.compact(into="segment") and private pools on the CPU: the allocator's carving faked.

CPU tensors stand in for device tensors (as in tests/test_compact.py). The fake
block (:class:`Carver`) hands each reallocation made while it is held the next
addresses of the block, as the caching allocator's best fit does, so the tests
check what compact asks of the allocator and how it reads the outcome; the GPU test
(tests/gpu/test_compact_gpu.py) checks the real allocator and torch_memory_saver.
"""

from __future__ import annotations

import itertools
import logging

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hybridmem as hm
from hybridmem import _torch
from tests.conftest import FakeDevice, FakeTorch, patch_seam
from tests.test_compact import Allocator, compact_under_faults

MiB = 1 << 20
START = 1 << 40  # the fake block's address: far from any CPU pointer


class Carver:
    """The one held block: reallocations under classic settings are carved from it."""

    def __init__(self, alloc: Allocator, fake: FakeTorch, monkeypatch: pytest.MonkeyPatch):
        self.fake = fake
        self.held: list[tuple[int, str | None]] = []  # (bytes, expandable setting) per call
        self.no_room = False
        self.cursor = self.end = 0
        self.address: dict[int, int] = {}
        resize = _torch.resize_storage  # the Allocator's: it records and injects faults

        def hold_block(nbytes: int, device: torch.device) -> int:
            self.held.append((nbytes, fake.torch_state.get("expandable_segments")))
            if self.no_room:
                raise torch.OutOfMemoryError("CUDA out of memory (injected: no one block)")
            self.cursor, self.end = START, START + nbytes
            return START

        def carving_resize(storage: torch.UntypedStorage, nbytes: int) -> None:
            resize(storage, nbytes)
            key = _torch.storage_key(storage)
            self.address.pop(key, None)
            size = _torch.block_bytes(nbytes)
            expandable = fake.torch_state.get("expandable_segments") == "True"
            if nbytes and not expandable and self.cursor + size <= self.end:
                self.address[key] = self.cursor
                self.cursor += size

        patch_seam(monkeypatch, "hold_block", hold_block)
        patch_seam(monkeypatch, "resize_storage", carving_resize)
        patch_seam(
            monkeypatch,
            "storage_address",
            lambda s: self.address.get(_torch.storage_key(s), s.data_ptr()),
        )


@pytest.fixture
def carver(alloc: Allocator, fake: FakeTorch, monkeypatch: pytest.MonkeyPatch) -> Carver:
    return Carver(alloc, fake, monkeypatch)


@pytest.fixture
def alloc(fake: FakeTorch, cpu_as_device: list[int], monkeypatch: pytest.MonkeyPatch) -> Allocator:
    return Allocator(fake, monkeypatch)


def weights() -> dict[str, torch.Tensor]:
    """Three storages over 1 MiB (one not a multiple of 512 bytes) and a small one."""
    torch.manual_seed(0)
    return {
        "embed": torch.randn(2 * MiB // 4),
        "proj": torch.randint(0, 255, (3 * MiB + 100,), dtype=torch.uint8),
        "norm": torch.randn(256),
        "head": torch.randn(3 * MiB // 4, dtype=torch.float16),
    }


def large(tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [t for t in tensors.values() if t.untyped_storage().nbytes() > MiB]


def test_large_storages_land_back_to_back_in_one_block(
    carver: Carver, alloc: Allocator, fake: FakeTorch
) -> None:
    tensors = weights()
    before = {k: v.clone() for k, v in tensors.items()}
    kept_view = tensors["embed"][10:20]  # a view a user kept: it sees the moved bytes
    big = large(tensors)
    total = sum(_torch.block_bytes(t.untyped_storage().nbytes()) for t in big)
    report = hm.compact(tensors, into="segment")
    assert (report.moved, report.kept, report.stuck) == (3, 1, 0)
    assert report.nbytes == sum(t.untyped_storage().nbytes() for t in big)
    assert report.into == "segment"
    assert "into one segment" in str(report)
    # One block as large as all of them, held with expandable segments off.
    assert [nbytes for nbytes, _ in carver.held] == [total]
    assert [setting for _, setting in carver.held] != ["True"]
    assert min(_torch.storage_address(t.untyped_storage()) for t in big) == START
    assert carver.cursor == START + total  # nothing of the block is left over
    for key, value in before.items():
        assert torch.equal(tensors[key], value), key
    assert torch.equal(kept_view, before["embed"][10:20])
    assert fake.torch_state.get("expandable_segments") != "True"
    assert "empty_cache" in fake.events


def test_back_to_back_means_each_starts_where_the_last_ended(carver: Carver) -> None:
    tensors = weights()
    hm.compact(tensors, into="segment")
    spans = sorted(
        (
            _torch.storage_address(t.untyped_storage()),
            _torch.block_bytes(t.untyped_storage().nbytes()),
        )
        for t in large(tensors)
    )
    for (start, size), (following, _) in itertools.pairwise(spans):
        assert following == start + size


def test_an_explicit_classic_env_does_not_stop_it(
    carver: Carver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    report = hm.compact(weights(), into="segment")
    assert (report.moved, report.reason) == (3, "")


def test_no_room_for_one_block_brings_them_back_intact(
    carver: Carver, alloc: Allocator, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="hybridmem")
    carver.no_room = True
    tensors = weights()
    before = {k: v.clone() for k, v in tensors.items()}
    report = hm.compact(tensors, into="segment")
    assert (report.moved, report.stuck) == (0, 3)
    assert "3 outside it" in str(report)
    assert "no room in one segment" in caplog.text
    assert "True" not in alloc.reallocations()
    for key, value in before.items():
        assert torch.equal(tensors[key], value), key


def test_a_reload_that_fails_in_the_block_comes_back_classic(
    carver: Carver, alloc: Allocator
) -> None:
    tensors = weights()
    before = {k: v.clone() for k, v in tensors.items()}
    alloc.fail_at = 4  # three frees, then the first reallocation into the block
    report = hm.compact(tensors, into="segment")
    assert (report.moved, report.stuck) == (0, 3)
    for key, value in before.items():
        assert torch.equal(tensors[key], value), key


@pytest.mark.parametrize("into", ["expandable", "segment"])
def test_a_private_pools_storage_is_kept(
    into: str, carver: Carver, alloc: Allocator, fake: FakeTorch
) -> None:
    tensors = weights()
    pooled = tensors["proj"].untyped_storage()
    fake.private_pools = [(pooled.data_ptr(), pooled.nbytes())]
    fake.initialized, fake.devices[0] = True, FakeDevice()  # the allocator has segments
    report = hm.compact(tensors, into=into)
    assert report.kept == (2 if into == "segment" else 1)  # segment keeps "norm" too
    assert report.moved == 3 - (into == "segment")
    assert pooled.nbytes() > 0


def test_a_private_pools_storage_is_never_freed(
    carver: Carver, alloc: Allocator, fake: FakeTorch, monkeypatch: pytest.MonkeyPatch
) -> None:
    tensors = weights()
    pooled = tensors["proj"].untyped_storage()
    fake.private_pools = [(pooled.data_ptr(), pooled.nbytes())]
    fake.initialized, fake.devices[0] = True, FakeDevice()
    freed: list[int] = []
    resize = _torch.resize_storage

    def watching(storage: torch.UntypedStorage, nbytes: int) -> None:
        if nbytes == 0:
            freed.append(_torch.storage_key(storage))
        resize(storage, nbytes)

    patch_seam(monkeypatch, "resize_storage", watching)
    hm.compact(tensors, into="segment")
    assert _torch.storage_key(pooled) not in freed
    assert len(freed) == 2


def test_into_is_checked_before_anything_moves(alloc: Allocator) -> None:
    with pytest.raises(ValueError, match=r"'expandable', 'segment', got 'one'"):
        hm.compact(weights(), into="one")
    assert alloc.calls == []


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    fail_at=st.one_of(st.none(), st.integers(0, 12)),
    fail_calls=st.sets(st.integers(0, 12), max_size=3),
    classic_fails=st.booleans(),
    no_room=st.booleans(),
    interrupt=st.booleans(),
)
def test_injected_faults_never_lose_data(
    carver: Carver,
    alloc: Allocator,
    fake: FakeTorch,
    fail_at: int | None,
    fail_calls: set[int],
    classic_fails: bool,
    no_room: bool,
    interrupt: bool,
) -> None:
    alloc.calls.clear()
    alloc.fail_at = fail_at
    alloc.fail_calls = fail_calls
    alloc.fail_classic = classic_fails and fail_at is not None
    alloc.error = KeyboardInterrupt() if interrupt else torch.OutOfMemoryError("injected")
    carver.no_room = no_room
    tensors = weights()
    before = {k: v.clone() for k, v in tensors.items()}
    compact_under_faults(alloc, lambda: hm.compact(tensors, into="segment"))
    for key, value in before.items():
        assert torch.equal(tensors[key], value), key
    assert fake.torch_state.get("expandable_segments") != "True"
