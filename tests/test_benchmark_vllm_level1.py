"""``benchmarks/vllm_level1.py``: its refusals, before anything runs."""

from __future__ import annotations

import pytest

from tests.helpers import run_python

NO_GPU = {"CUDA_VISIBLE_DEVICES": "", "HYBRIDMEM_VLLM_FILES": "/files"}


def test_without_a_gpu_it_says_why_and_measures_nothing() -> None:
    done = run_python("benchmarks/vllm_level1.py", env=NO_GPU)
    assert done.returncode == 2
    assert "vllm_level1 needs a CUDA device: it sleeps vLLM's pool" in done.stderr


@pytest.mark.parametrize(
    ("argv", "env", "said"),
    [
        (["--gib", "0"], NO_GPU, "--gib sizes are whole GiB >= 1, got 0"),
        ([], {"CUDA_VISIBLE_DEVICES": ""}, "needs vLLM's allocator files: --vllm-files PATH"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(
    argv: list[str], env: dict[str, str], said: str
) -> None:
    done = run_python("benchmarks/vllm_level1.py", *argv, env=env)
    assert done.returncode == 2
    assert said in done.stderr
