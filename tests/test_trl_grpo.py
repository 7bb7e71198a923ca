"""TRL 1.16.0's own GRPOTrainer, a real accelerate loop on the CPU, with the drop-in around it.

Runs where trl is installed (CI's ``trl`` job installs ``trl==1.16.0`` on torch's CPU
build; ``HYBRIDMEM_REQUIRE_TRL_INSTALLED=1`` there turns a missing trl into a failure).
vLLM is a recording stand-in (:mod:`tests.trl_grpo_run`): the engine calls are TRL's.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import run_python

_NEEDED = ("trl", "transformers", "accelerate", "datasets")
_MISSING = [name for name in _NEEDED if importlib.util.find_spec(name) is None]
if _MISSING:
    if os.environ.get("HYBRIDMEM_REQUIRE_TRL_INSTALLED") == "1":
        raise RuntimeError(
            f"HYBRIDMEM_REQUIRE_TRL_INSTALLED=1 but {', '.join(_MISSING)} is not installed: "
            "pip install trl==1.16.0"
        )
    pytest.skip(
        f"TRL's trainer is not installed ({', '.join(_MISSING)} missing): pip install trl==1.16.0",
        allow_module_level=True,
    )

STEP = [
    ["wake_up", ["weights"]],
    ["reset_prefix_cache"],
    ["wake_up", ["kv_cache"]],
    ["generate", 2],
    ["sleep", 2],
]


def _run(tmp_path: Path, scenario: str) -> dict[str, Any]:
    done = run_python("tests/trl_grpo_run.py", str(tmp_path / "fake"), scenario, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_two_grpo_steps_make_trls_engine_calls_inside_the_drop_in(tmp_path: Path) -> None:
    result = _run(tmp_path, "train")
    assert result["started_asleep"]
    assert result["global_step"] == 2
    assert result["calls"] == STEP * 2
    assert result["loads"] == 24  # the model's 12 tensors, synced in full each step
    assert result["awake"] == []
    # the optimizer's step pre-hook is on accelerate's inner torch optimizer, which stepped
    assert result["optimizer"] == "AdamW"
    assert result["hooked"]
    assert result["state_tensors"] > 0


def test_a_failed_generation_leaves_the_engine_asleep_where_trl_alone_leaves_it_awake(
    tmp_path: Path,
) -> None:
    bare = _run(tmp_path / "bare", "fail-bare")
    assert bare["raised"] == "stand-in: generate failed"
    assert bare["calls"][-1] == ["generate", 2]  # TRL alone: awake, holding its KV cache
    assert bare["weights_stale"] is False  # and its weights taken for synced

    ours = _run(tmp_path / "ours", "fail")
    assert ours["raised"] == "stand-in: generate failed"
    assert ours["calls"] == STEP + STEP  # the failed generate, then the sleep put back
    assert ours["awake"] == []
    assert ours["weights_stale"] is True
    if sys.version_info >= (3, 11):  # exceptions carry notes from 3.11
        assert any("was put back to sleep (level 2)" in note for note in ours["notes"])


def test_the_docs_block_runs_as_written_on_trls_trainer(tmp_path: Path) -> None:
    result = _run(tmp_path, "docs")
    # the trainer built by the block sleeps its engine at start-up, then two steps
    assert result["calls"] == [["LLM", True], ["sleep", 2], *STEP * 2]
