"""hybridmem beside the sleep-mode pools TRL's, OpenRLHF's and verl's users have (vLLM 0.22 - 0.31).

hybridmem's scopes nested with the pool both ways, each tag's pool entered once as vLLM
does (``each_tag_once``: these releases keep one pool per tag and free the replaced one
while the new one is in use, which torch 2.11 refuses), on older releases' own allocator
files (``HYBRIDMEM_VLLM_OLDER_FILES``: folders or wheels, comma-separated, e.g. vLLM
0.24.0's, 0.29.0's and 0.31.0's; ``sleep_files.extract`` makes a folder). vLLM 0.22 - 0.30 toggle
expandable segments with a bare string that resets every other setting; 0.31 keeps them
(docs/backends/vllm.md, "vLLM 0.22 to 0.31"). Whatever the release writes, hybridmem's
view must be what torch runs with.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.gpu.runner import run_scenario
from tests.gpu.vllm_sleep_scenarios import USER_ENV

OLDER_ENV = "HYBRIDMEM_VLLM_OLDER_FILES"
FOLDERS = [p for p in os.environ.get(OLDER_ENV, "").split(",") if p]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not FOLDERS,
        reason=f"needs older vLLM releases' allocator files: {OLDER_ENV}=<folder>,<folder> "
        "(pip download --no-deps vllm==0.29.0 vllm==0.31.0, then sleep_files.extract)",
    ),
]


def _says_what_sleeps(folder: str) -> bool:
    """Whether the pool's records carry ``is_asleep`` (vLLM 0.25+)."""
    return "is_asleep" in (Path(folder) / "vllm/device_allocator/cumem.py").read_text()


def _keeps(folder: str) -> bool:
    """Whether the release's pool keeps the other settings (it has alloc_conf.py: 0.31+)."""
    return (Path(folder) / "vllm/device_allocator/alloc_conf.py").is_file()


@pytest.mark.parametrize("folder", FOLDERS, ids=[Path(p).name for p in FOLDERS])
def test_an_older_pools_toggle_is_seen_as_torch_runs_it(folder: str) -> None:
    facts = run_scenario(
        "each_tag_once",
        "tests.gpu.vllm_sleep_scenarios",
        PYTORCH_CUDA_ALLOC_CONF=USER_ENV,
        HYBRIDMEM_VLLM_FILES=folder,
    )
    print("\n" + json.dumps(facts, indent=1))
    rows = {row["at"]: row for row in facts["rows"]}
    # never a value torch is not running with, whatever the release wrote
    assert all(row["agree"] for row in facts["rows"]), facts["rows"]
    # the pool turns expandable segments off inside itself, every release from 0.22
    assert rows["pool inside scope"]["torch"]["expandable_segments"] is False
    assert rows["pool inside scope"]["hm"]["source"] == "outside"
    gc_after_pool = rows["pool left"]["torch"]["garbage_collection_threshold"]
    if _keeps(folder):
        assert gc_after_pool == 0.6  # 0.31: the user's other settings kept
    else:
        assert gc_after_pool == 0.0  # 0.25 - 0.30: reset by the bare write, as read
        # hybridmem says which settings the write reset...
        reset = ["garbage_collection_threshold", "max_split_size_mb"]
        assert rows["pool left"]["hm"]["pending"] == reset
        # ...and its next change gives them back (its writes are whole strings)
        assert rows["scope inside pool"]["torch"]["garbage_collection_threshold"] == 0.6
        assert rows["end"]["torch"]["max_split_size_mb"] == 256
    assert rows["end"]["torch"]["expandable_segments"] is True
    assert facts["weights_intact_after_sleep"] is True
    if _says_what_sleeps(folder):
        assert facts["asleep"] == ["kv_cache", "weights"]  # is_asleep from 0.25
        assert facts["asleep_at_end"] == []
    else:
        assert facts["asleep"] == []  # before 0.25 nothing says what sleeps
    assert facts["kv_asleep_bytes"] == 64 << 20  # what waking the KV cache maps
