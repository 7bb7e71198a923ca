"""benchmarks/vllm_transfer.py's memory growth: a leak counts, one outside step does not.

Its GPU test (``tests/gpu/test_vllm_link_gpu.py``) bounds the growth per sync; this
checks the measure itself, on numbers, so that neither a leak slips through nor a
step of someone else's memory fails (or passes) the GPU test.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

MiB = 1 << 20
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def vllm_transfer() -> ModuleType:
    sys.path.insert(0, str(BENCHMARKS))  # it imports its sibling weight_sync
    try:
        spec = importlib.util.spec_from_file_location(
            "vllm_transfer", BENCHMARKS / "vllm_transfer.py"
        )
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


def test_a_leak_in_every_sync_is_its_growth(vllm_transfer: ModuleType) -> None:
    frees = [100 * 1024 * MiB - i * 64 * MiB for i in range(4)]
    assert vllm_transfer.growth_per_sync(frees) == 64 * MiB


@pytest.mark.parametrize("step", [636 * MiB, -636 * MiB])
@pytest.mark.parametrize("at", [1, 2, 3])
def test_one_step_of_outside_memory_is_not_growth(
    vllm_transfer: ModuleType, step: int, at: int
) -> None:
    # Issue #25, the GPU suite's second pass: free memory rose 636 MiB during three
    # syncs (the old measure: -212 MiB per sync). A step the other way (another
    # process taking memory) would have failed the test's 64 MiB bound.
    frees = [100 * 1024 * MiB + (step if i >= at else 0) for i in range(4)]
    assert vllm_transfer.growth_per_sync(frees) == 0


def test_a_leak_beside_a_step_is_still_found(vllm_transfer: ModuleType) -> None:
    frees = [100 * 1024 * MiB - i * 64 * MiB + (636 * MiB if i >= 2 else 0) for i in range(4)]
    assert vllm_transfer.growth_per_sync(frees) == 64 * MiB


def test_no_sync_is_refused(vllm_transfer: ModuleType) -> None:
    with pytest.raises(ValueError, match="before and after a sync"):
        vllm_transfer.growth_per_sync([100 * MiB])
