"""hm.one_segment on the CPU: the seam's block and memory readings faked.

What it asks of the allocator (one block of the right size, held with expandable
segments off, on entry), what it reports from the readings, and that the setting
comes back in every form and on error. The GPU test (tests/gpu/test_tms_gpu.py,
``packed``) checks the carving itself against the real allocator, in a
torch_memory_saver region.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

import hybridmem as hm
from hybridmem.memory.one_segment import SegmentReport, segment_bytes
from tests.conftest import FakeTorch, patch_seam

MiB = 1 << 20


class Blocks:
    """``hold_block`` faked: records each block and the setting it was held under."""

    def __init__(self, fake: FakeTorch, monkeypatch: pytest.MonkeyPatch) -> None:
        self.held: list[tuple[int, str | None]] = []
        self.no_room = False

        def hold_block(nbytes: int, device: torch.device) -> int:
            if self.no_room:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate (injected)")
            self.held.append((nbytes, fake.torch_state.get("expandable_segments")))
            return 1 << 40

        patch_seam(monkeypatch, "hold_block", hold_block)


@pytest.fixture
def blocks(fake_gpu: FakeTorch, monkeypatch: pytest.MonkeyPatch) -> Blocks:
    return Blocks(fake_gpu, monkeypatch)


def make(fake: FakeTorch, nbytes: int, *, rounding: int = 0) -> None:
    """Tensors of ``nbytes`` made inside: allocated and reserved grow."""
    fake.devices[0].allocated += nbytes
    fake.devices[0].reserved += nbytes + rounding


def test_segment_bytes_counts_the_large_tensors_as_the_allocator_rounds_them() -> None:
    meta = {
        "up": torch.empty(2731, 1024, device="meta"),  # 10.67 MiB, a multiple of 512
        "odd": torch.empty(MiB + 100, dtype=torch.uint8, device="meta"),  # rounded up
        "norm": torch.empty(1024, device="meta"),  # small pool: not in the block
        "edge": torch.empty(MiB, dtype=torch.uint8, device="meta"),  # 1 MiB: small pool
    }
    assert segment_bytes(meta) == 2731 * 1024 * 4 + (MiB + 512)
    assert segment_bytes(list(meta.values())) == segment_bytes(meta)
    assert segment_bytes(12345) == 12345
    assert segment_bytes([]) == 0


@pytest.mark.parametrize(
    ("sizes", "error", "match"),
    [
        (-1, ValueError, "byte count from 0 to 1 TiB, or tensors, got -1"),
        (True, TypeError, "got True"),
        (["w"], TypeError, "got a str"),
        ({"w": 3}, TypeError, "got a int"),
    ],
)
def test_bad_sizes_are_refused_at_the_call(sizes: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        hm.one_segment(sizes)  # type: ignore[arg-type]


def test_a_cpu_device_is_refused() -> None:
    with pytest.raises(ValueError, match="device cpu is not a CUDA device"):
        hm.one_segment(MiB * 4, device="cpu")


def test_holds_one_block_with_expandable_segments_off_and_restores(
    blocks: Blocks, fake_gpu: FakeTorch, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    meta = [torch.empty(3 * MiB, dtype=torch.uint8, device="meta")] * 2
    with hm.one_segment(meta) as packing:
        assert fake_gpu.torch_state.get("expandable_segments") == "False"
        make(fake_gpu, 6 * MiB, rounding=MiB)
    assert blocks.held == [(6 * MiB, "False")]
    assert fake_gpu.torch_state.get("expandable_segments") == "True"
    assert packing.report == SegmentReport(nbytes=6 * MiB, reserved=7 * MiB, allocated=6 * MiB)
    assert packing.report.cached == MiB
    assert str(packing.report) == (
        "one_segment of 6.00 MiB: 6.00 MiB of tensors in 7.00 MiB reserved, 1.00 MiB cached"
    )


def test_the_setting_comes_back_when_the_block_raises(
    blocks: Blocks, fake_gpu: FakeTorch, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    packing = hm.one_segment(4 * MiB)
    with pytest.raises(RuntimeError, match="model failed"), packing:
        raise RuntimeError("model failed")
    assert fake_gpu.torch_state.get("expandable_segments") == "True"
    assert packing.report is not None
    assert packing.report.nbytes == 4 * MiB


def test_each_decorated_call_holds_its_own_block(blocks: Blocks, fake_gpu: FakeTorch) -> None:
    @hm.one_segment(8 * MiB)
    def build() -> str:
        make(fake_gpu, 8 * MiB)
        return "built"

    assert build() == "built"
    assert build() == "built"
    assert [n for n, _ in blocks.held] == [8 * MiB, 8 * MiB]


def test_nested_blocks_each_hold_and_report(blocks: Blocks, fake_gpu: FakeTorch) -> None:
    with hm.one_segment(8 * MiB) as outer:
        make(fake_gpu, 2 * MiB)
        with hm.one_segment(4 * MiB) as inner:
            make(fake_gpu, 4 * MiB)
    assert [n for n, _ in blocks.held] == [8 * MiB, 4 * MiB]
    assert inner.report is not None
    assert inner.report.allocated == 4 * MiB
    assert outer.report is not None
    assert outer.report.allocated == 6 * MiB
    assert fake_gpu.torch_state.get("expandable_segments") != "True"


def test_no_room_warns_once_and_the_block_runs(
    blocks: Blocks, fake_gpu: FakeTorch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="hybridmem")
    blocks.no_room = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with hm.one_segment(64 * MiB) as packing:
            make(fake_gpu, 64 * MiB, rounding=3 * MiB)
    messages = [str(w.message) for w in caught if issubclass(w.category, hm.HybridMemWarning)]
    assert len(messages) == 1
    assert "could not hold one block of 64.00 MiB" in messages[0]
    assert "go where the allocator puts them" in messages[0]
    assert packing.report is not None
    assert packing.report.nbytes == 0
    assert packing.report.cached == 3 * MiB  # the rounding it could not spare
    assert "no block (no room" in str(packing.report)
    assert "no block" in caplog.text


def test_nothing_large_to_make_holds_nothing(blocks: Blocks) -> None:
    with hm.one_segment([torch.empty(16, device="meta")]) as packing:
        pass
    assert blocks.held == []
    assert packing.report is not None
    assert "no tensor over 1 MiB" in packing.report.reason


def test_disabled_holds_nothing(
    blocks: Blocks, fake_gpu: FakeTorch, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HYBRIDMEM_DISABLE", "1")
    with hm.one_segment(8 * MiB) as packing:
        pass
    assert blocks.held == []
    assert packing.report is None
    assert fake_gpu.set_strings() == []


def test_a_failed_reading_leaves_the_setting_as_it_was(
    blocks: Blocks, fake_gpu: FakeTorch, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

    def broken(index: int) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    patch_seam(monkeypatch, "synchronize", broken)
    with pytest.raises(RuntimeError, match="illegal memory access"), hm.one_segment(8 * MiB):
        pass
    assert blocks.held == []
    assert fake_gpu.torch_state.get("expandable_segments") == "True"
