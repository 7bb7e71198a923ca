"""What the doctor knows about torch_memory_saver, from the environment and metadata."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridmem.engine import memory_saver
from hybridmem.engine.memory_saver import memory_saver_facts


@pytest.fixture
def library(tmp_path: Path) -> str:
    path = tmp_path / "torch_memory_saver_hook_mode_preload_cu13.abi3.so"
    path.write_bytes(b"\x7fELF")
    return str(path)


def test_not_installed_says_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory_saver, "_installed_version", lambda: None)
    assert memory_saver_facts(expandable_effective=True, env={}) is None


def test_preload_mode_from_ld_preload(library: str) -> None:
    facts = memory_saver_facts(
        expandable_effective=False, env={"LD_PRELOAD": f"/lib/x.so:{library}"}, version="0.0.10"
    )
    assert facts is not None
    assert (facts.hook_mode, facts.preload_library, facts.preload_library_exists) == (
        "preload",
        library,
        True,
    )
    assert facts.problems == ()
    assert facts.notes == ()
    assert facts.as_dict()["hook_mode"] == "preload"


def test_without_a_preload_library_only_torch_mode_works() -> None:
    facts = memory_saver_facts(expandable_effective=False, env={}, version="0.0.10")
    assert facts is not None
    assert facts.hook_mode == "torch"
    assert facts.problems == ()
    assert any("hook_mode='torch'" in n for n in facts.notes)


@pytest.mark.parametrize(
    "value", ["expandable_segments:True", "max_split_size_mb:64, expandable_segments: True"]
)
def test_expandable_in_pytorch_cuda_alloc_conf_blocks_it(library: str, value: str) -> None:
    facts = memory_saver_facts(
        expandable_effective=True,
        env={"LD_PRELOAD": library, "PYTORCH_CUDA_ALLOC_CONF": value},
        version="0.0.10",
    )
    assert facts is not None
    assert facts.refuses_to_start
    assert not facts.regions_not_pausable  # it does not get that far
    (problem,) = facts.problems
    assert "refuses to start" in problem
    assert "hm.phase('train', backend='sglang')" in problem


def test_expandable_from_the_other_variable_leaves_regions_unpausable(library: str) -> None:
    # torch 2.9+ reads PYTORCH_ALLOC_CONF too; TMS's check looks at the old name only
    facts = memory_saver_facts(
        expandable_effective=True,
        env={"LD_PRELOAD": library, "PYTORCH_ALLOC_CONF": "expandable_segments:True"},
        version="0.0.10",
    )
    assert facts is not None
    assert not facts.refuses_to_start
    assert facts.regions_not_pausable
    (problem,) = facts.problems
    assert "pause() does not free" in problem
    assert "0 of 1280 MiB" in problem


def test_torch_mode_ignores_the_toggle() -> None:
    facts = memory_saver_facts(
        expandable_effective=True,
        env={"PYTORCH_ALLOC_CONF": "expandable_segments:True"},
        version="0.0.10",
    )
    assert facts is not None
    assert not facts.regions_not_pausable
    assert facts.problems == ()


def test_broken_ld_preload_is_named(library: str) -> None:
    missing = memory_saver_facts(
        expandable_effective=False,
        env={"LD_PRELOAD": "/nowhere/torch_memory_saver_hook_mode_preload_cu13.abi3.so"},
        version="0.0.10",
    )
    assert missing is not None
    assert not missing.preload_library_exists
    assert any("does not exist" in p for p in missing.problems)
    twice = memory_saver_facts(
        expandable_effective=False, env={"LD_PRELOAD": f"{library}:{library}"}, version="0.0.10"
    )
    assert twice is not None
    assert any("asserts exactly one" in p for p in twice.problems)
