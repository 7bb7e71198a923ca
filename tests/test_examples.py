"""The examples run as documented (on the CPU here; on the GPU in the device run)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, run_python

EXAMPLES = sorted((REPO / "examples").glob("*.py"))


def test_quickstart_runs() -> None:
    result = run_python(str(REPO / "examples" / "quickstart.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 2: loss" in result.stdout
    assert "garbage_collection_threshold" in result.stdout
    assert "Traceback" not in result.stderr


def test_offload_example_runs() -> None:
    result = run_python(str(REPO / "examples" / "offload_rollout.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 2: loss" in result.stdout


def test_weight_sync_example_explains_itself_without_a_gpu() -> None:
    result = run_python(str(REPO / "examples" / "trainer_to_rollout.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "needs a CUDA GPU" in result.stdout


def test_sharding_manager_example_runs() -> None:
    result = run_python(str(REPO / "examples" / "sharding_manager.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 1: loss" in result.stdout
    assert "engine has the new weights: True" in result.stdout
    assert "in rollout: expandable=False" in result.stdout
    assert "in training: expandable=True" in result.stdout


def test_packed_forward_runs() -> None:
    result = run_python(str(REPO / "examples" / "packed_forward.py"))
    assert result.returncode == 0, result.stderr
    assert "unpacked output equals the padded computation" in result.stdout


def test_expandable_sharing_example_explains_itself_without_a_gpu() -> None:
    result = run_python(str(REPO / "examples" / "expandable_sharing.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "needs a CUDA GPU" in result.stdout


def test_planned_handback_example_explains_itself_without_a_gpu() -> None:
    result = run_python(str(REPO / "examples" / "planned_handback.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "needs a CUDA GPU: the plan is made from device memory" in result.stdout


def test_compact_example_explains_itself_without_a_gpu() -> None:
    result = run_python(str(REPO / "examples" / "compact_resident.py"))
    assert result.returncode == 0, result.stderr
    assert "needs a CUDA GPU" in result.stdout


def test_the_cards_example_runs_with_the_cards_names() -> None:
    source = (REPO / "examples" / "card.py").read_text()
    for line in (
        "@hm.expandable_segments(False)",
        "@hm.aggressive_cache_release()",
        "@hm.ipc_safe()",
    ):
        assert line in source
    result = run_python(str(REPO / "examples" / "card.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    for backend in ("vllm", "sglang"):
        assert f"[{backend}] rollout: expandable=False, engine tags ['weights', 'kv_cache']" in (
            result.stdout
        )
        assert f"[{backend}] after rollout: expandable=False, scopes ()" in result.stdout
    assert result.stdout.count("training: expandable=True") == 2
    assert result.stdout.count("engine output equals the trainer's: True") == 2


def test_verl_packing_example_runs() -> None:
    result = run_python(str(REPO / "examples" / "verl_packing.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "cu_seqlens_q [0, 48, 64, 256]" in result.stdout
    assert "postprocessed output equals the padded computation" in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without a GPU prints")
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda path: path.name)
def test_without_a_gpu_an_example_says_so_once_and_repeats_no_warning(example: Path) -> None:
    result = run_python(str(example))
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (result.stdout + result.stderr).splitlines()
    said = [line for line in lines if "no CUDA GPU here" in line or "needs a CUDA GPU" in line]
    assert len(said) == 1, lines
    noted = [line for line in lines if line.startswith(("hybridmem:", "Warning", "warn"))]
    assert len(noted) == len(set(noted)), noted  # a note or warning appears once at most
    assert "no CUDA device" not in result.stdout  # the memory figures say nothing here
