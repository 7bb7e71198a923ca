"""hybridmem beside vLLM's own sleep-mode allocator (vLLM 0.33's files, on the GPU at hand).

Composition: what torch runs with (its snapshot) against what ``hm.allocator_state()``
says, at every step of hybridmem's scopes nested with vLLM's ``use_memory_pool`` in
both orders, with an exception inside each and vLLM's pool in another thread. Level-1
sleep: vLLM's own, hybridmem's PoolBackup and copies into host memory pinned once
(``benchmarks/vllm_level1.py``). vLLM's lifecycle out of order through hybridmem, with a
stand-in worker on vLLM's pool.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.gpu.runner import artifacts_dir, run_alone, run_scenario
from tests.gpu.vllm_sleep_scenarios import FILES_ENV, USER_ENV

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not os.environ.get(FILES_ENV),
        reason=f"needs vLLM 0.33's allocator files: {FILES_ENV}=<vllm wheel or folder> "
        "(pip download --no-deps vllm==0.33.0; docs/backends/vllm.md says how)",
    ),
]
MODULE = "tests.gpu.vllm_sleep_scenarios"


def test_hybridmem_composes_with_vllms_pool_toggle() -> None:
    facts = run_scenario(
        "composition",
        MODULE,
        PYTORCH_CUDA_ALLOC_CONF=USER_ENV,
        HYBRIDMEM_VLLM_FILES=os.environ[FILES_ENV],
    )
    print("\n" + json.dumps(facts, indent=1))
    rows = {row["at"]: row for row in facts["rows"]}
    # never a value torch is not running with
    assert all(row["agree"] for row in facts["rows"]), facts["rows"]
    # vLLM's pool turned expandable segments off inside hybridmem's scope: seen...
    assert rows["pool inside scope"]["torch"]["expandable_segments"] is False
    assert rows["pool inside scope"]["hm"]["source"] == "outside"
    # ...and a scope that exits inside the pool leaves the pool's setting in force
    assert rows["scope left inside pool"]["torch"]["expandable_segments"] is False
    # a scope entered inside the pool applies, and gives the pool its setting back
    assert rows["scope inside pool (on)"]["torch"]["expandable_segments"] is True
    assert rows["scope left inside pool (on)"]["torch"]["expandable_segments"] is False
    # the other thread's pool stays in force as this thread's scope exits
    assert (
        rows["scope left under a pool of another thread"]["torch"]["expandable_segments"] is False
    )
    # the user's other settings throughout, and the env's settings at the end
    for row in facts["rows"]:
        assert row["torch"]["garbage_collection_threshold"] == 0.6, row
    assert rows["end"]["torch"]["expandable_segments"] is True
    assert facts["weights_intact_after_sleep"] is True
    # vLLM's own pool, asleep: a weight update is refused before anything is touched
    assert facts["asleep"] == ["kv_cache", "weights"]
    assert "a weight update came while vLLM's 'weights' memory sleeps" in facts["refused"]
    assert facts["asleep_after_weights"] == ["kv_cache"]
    assert facts["asleep_at_end"] == []
    # torch 2.10 - 2.11 have no getter: hybridmem saw vLLM's writes where torch's setter is
    # called (no snapshot per scope), and the rows above agree with torch's own snapshot
    if (2, 10) <= tuple(int(p) for p in facts["torch"].split(".")[:2]) < (2, 12):
        assert facts["watched"] is True


def test_level1_sleep_beside_hybridmems_backup_and_pinned_copies(tmp_path: Path) -> None:
    """``benchmarks/vllm_level1.py`` at 1, 4 and 16 GiB: the bytes come back every way."""
    out = artifacts_dir(tmp_path) / "vllm_level1.json"
    done = run_alone(
        "benchmarks/vllm_level1.py", "--gib", "1", "4", "16", "--json", str(out),
        "--vllm-files", os.environ[FILES_ENV], timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    print("\n" + "\n".join(done.stdout.splitlines()[:-1]))
    for row in json.loads(out.read_text())["rows"]:
        # the weights come back byte for byte after every sleep, vLLM's way and ours
        assert row["vllm"]["intact"] is True, row["gib"]
        assert row["hybridmem"]["intact"] is True, row["gib"]
        # hybridmem pins exactly the weights' bytes, once, before the first sleep
        assert row["hybridmem"]["host_pinned_gib"] == row["gib"]
        for way in ("vllm", "hybridmem", "discard"):
            assert row[way]["sleep_first_s"] > 0, (row["gib"], way)


@pytest.mark.parametrize("level", [1, 2])
def test_vllms_lifecycle_out_of_order_is_refused_or_ignored_never_a_crash(level: int) -> None:
    """Through hm.VLLMEngine and the backend's worker steps, against vLLM's own pool."""
    facts = run_scenario(
        "lifecycle",
        "tests.gpu.vllm_lifecycle_scenarios",
        SLEEP_LEVEL=str(level),
        HYBRIDMEM_VLLM_FILES=os.environ[FILES_ENV],
    )
    print("\n" + json.dumps(facts, indent=1))
    assert facts["in_order"] is True  # verl's step: the synced weights generate
    assert facts["asleep"] == ["kv_cache", "weights"]
    assert facts["second_sleep"] is True  # no second call reached vLLM's pool
    assert facts["second_wake"] is True
    # weights sent while they sleep: refused by the worker before anything was sent
    assert "EngineAsleepError" in facts["sync_asleep"]
    assert "llm.wake_up(tags=['weights'])" in facts["sync_asleep"]
    # generate while asleep: refused by the adapter, and by the worker past it
    assert facts["generate_asleep_adapter"].startswith("EngineAsleepError: generate came")
    assert (
        "generation came while vLLM's 'weights' memory sleeps" in (facts["generate_asleep_worker"])
    )
    assert "kv_cache sleeps" in facts["generate_half_awake"]
    assert facts["after_refusals"] is True  # nothing of the refused steps was applied
    # a trainer that died between the wake and the sync: the link closes on its own,
    # an update through it is refused at once, the engine serves a new trainer
    assert facts["dying_exit"] == 3
    assert facts["engine_after_death"]["link_closed"] is True
    assert facts["link_closed_s"] < 10
    assert "is closed" in facts["update_after_death"]
    assert "level-2" in facts["update_after_death"]
    assert facts["after_death"] is True
    assert facts["engine_alive"] is True
