"""``benchmarks/first_copy.py``: its refusals, before anything runs."""

from __future__ import annotations

import pytest

from tests.helpers import run_python

NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}


def test_without_a_gpu_it_says_why_and_measures_nothing() -> None:
    done = run_python("benchmarks/first_copy.py", "--gib", "1", env=NO_GPU)
    assert done.returncode == 2
    assert "first_copy needs a CUDA device: it copies device memory" in done.stderr
    assert done.stdout == ""


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--gib", "0"], "--gib sizes are whole GiB >= 1, got 0"),
        (["--repeat", "0"], "--repeat is at least 1 (fresh processes per size), got 0"),
        (["--copies", "1"], "--copies is at least 2 (a first copy and others), got 1"),
        (["--pause-s", "-1"], "--pause-s is 0 or more seconds, got -1.0"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(argv: list[str], said: str) -> None:
    done = run_python("benchmarks/first_copy.py", *argv, env=NO_GPU)
    assert done.returncode == 2
    assert said in done.stderr
