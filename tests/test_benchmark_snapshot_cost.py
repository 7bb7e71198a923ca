"""``benchmarks/snapshot_cost.py``: its refusals, before anything runs."""

from __future__ import annotations

import pytest

from tests.helpers import run_python


def test_without_a_gpu_it_says_why_and_measures_nothing() -> None:
    done = run_python("benchmarks/snapshot_cost.py", env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2
    assert "snapshot_cost needs a CUDA device: it reads the allocator" in done.stderr


@pytest.mark.parametrize("argv", [["--gib", "0"], ["--repeats", "0"]])
def test_bad_arguments_are_refused_before_anything_runs(argv: list[str]) -> None:
    done = run_python("benchmarks/snapshot_cost.py", *argv, env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2
    assert "--gib must be > 0 and --repeats >= 1" in done.stderr
