"""``benchmarks/alloc_scatter.py``: how it spreads what it keeps, and its refusals."""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path

import pytest

from tests.helpers import run_python

_spec = importlib.util.spec_from_file_location(
    "alloc_scatter", Path(__file__).resolve().parents[1] / "benchmarks" / "alloc_scatter.py"
)
assert _spec is not None
assert _spec.loader is not None
alloc_scatter = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(alloc_scatter)


@pytest.mark.parametrize(("count", "keep"), [(10, 3), (409, 409), (4096, 409), (7, 1), (3, 0)])
def test_the_kept_chunks_are_distinct_and_spread_over_the_whole_range(
    count: int, keep: int
) -> None:
    kept = alloc_scatter.kept_indices(count, keep)
    assert len(kept) == keep == len(set(kept))
    assert all(0 <= i < count for i in kept)
    if keep > 1:  # evenly: no gap more than one wider than another
        gaps = {b - a for a, b in itertools.pairwise(kept)}
        assert max(gaps) - min(gaps) <= 1
        assert kept[-1] >= count - count // keep - 1  # reaches the end of the range


def test_keeping_more_chunks_than_there_are_is_refused() -> None:
    with pytest.raises(ValueError, match="keep=5 must be between 0 and count=4"):
        alloc_scatter.kept_indices(4, 5)


def test_without_a_gpu_it_says_why_and_measures_nothing() -> None:
    done = run_python("benchmarks/alloc_scatter.py", env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2
    assert "alloc_scatter needs a CUDA device: it times cudaMalloc" in done.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gaps", "-1"], "--gaps are milliseconds >= 0, got [-1.0]"),
        (["--pieces", "0"], "--held and --chunk must be > 0, --pieces and --repeats >= 1"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(argv: list[str], message: str) -> None:
    done = run_python("benchmarks/alloc_scatter.py", *argv, env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2
    assert message in done.stderr
