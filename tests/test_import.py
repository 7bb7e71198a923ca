"""``import hybridmem`` initialises no CUDA, imports no inference engine, and no torch."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import run_python

CHECK = r"""
import json, sys
import hybridmem as hm
torch_on_import = "torch" in sys.modules
names = sorted(set(dir(hm)) & set(hm.__all__)) == sorted(hm.__all__)
import torch
with hm.expandable_segments(True):
    pass
hm.allocator_state()
hm.memory_info()
hm.release_cache()
print(json.dumps({
    "cuda_initialized": torch.cuda.is_initialized(),
    "engines": sorted(m for m in ("vllm", "sglang", "torch_memory_saver") if m in sys.modules),
    # isort-style, as ruff's RUF022 keeps it: CONSTANTS, then Classes, then functions
    "all_sorted": hm.__all__ == sorted(
        hm.__all__, key=lambda n: (0 if n.isupper() else 1 if n[0].isupper() else 2, n)
    ),
    "all_exists": all(hasattr(hm, name) for name in hm.__all__),
    "torch_on_import": torch_on_import,
    "dir_lists_all": names,
    "unknown_name": not hasattr(hm, "no_such_name"),
}))
"""


def test_import_and_use_touch_neither_cuda_nor_engines(tmp_path: Path) -> None:
    # Poisoned engines on the path: importing one would fail loudly.
    for name in ("vllm", "sglang", "torch_memory_saver"):
        (tmp_path / f"{name}.py").write_text("raise ImportError('hybridmem imported me')\n")
    repo = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-c", CHECK],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        env={"PYTHONPATH": f"{tmp_path}:{repo}", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    facts = json.loads(result.stdout.strip().splitlines()[-1])
    assert facts == {
        "cuda_initialized": False,
        "engines": [],
        "all_sorted": True,
        "all_exists": True,
        # names load on first use: `hybridmem doctor` starts its probe before torch loads
        "torch_on_import": False,
        "dir_lists_all": True,
        "unknown_name": True,
    }


def test_py_typed_is_shipped() -> None:
    import hybridmem

    assert (Path(hybridmem.__file__).parent / "py.typed").exists()


def test_the_face_is_one_table_written_three_ways_that_cannot_drift() -> None:
    """``__all__``, the lazy map and the ``TYPE_CHECKING`` imports name the same things.

    The map is what loads a name; the ``TYPE_CHECKING`` block is what type checkers
    see (they cannot follow ``__getattr__``); ``__all__`` is what is exported (a
    literal, as type checkers need it). A name added to one but not the others would
    load but not type-check, or type-check but not load (issue #27).
    """
    import ast

    import hybridmem

    source = Path(hybridmem.__file__).read_text()
    typed: dict[str, str] = {}
    for statement in ast.parse(source).body:
        if isinstance(statement, ast.If) and ast.unparse(statement.test) == "TYPE_CHECKING":
            for node in ast.walk(statement):
                if isinstance(node, ast.ImportFrom) and node.module:
                    typed.update({alias.name: node.module for alias in node.names})
    lazy = vars(hybridmem)["_LAZY"]
    assert typed == lazy  # the same names, each from the same module
    assert sorted(hybridmem.__all__) == hybridmem.__all__  # sorted, as the style asks
    assert set(hybridmem.__all__) == {*lazy, "__version__"}
    for name, module in lazy.items():  # and each loads from where the map says
        assert getattr(hybridmem, name) is getattr(__import__(module, fromlist=[name]), name)


_ABORTING_ENV = """
import sys
from hybridmem.allocator import import_check
import_check.installed_torch = lambda: ((2, 14), True)  # a CUDA build of 2.14, as pip installs it
import hybridmem as hm
try:
    hm.allocator_state()
except hm.AllocatorSettingsError as exc:
    print("refused:", exc)
print("torch imported:", "torch" in sys.modules)
"""


@pytest.mark.parametrize("name", ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"])
def test_an_env_that_aborts_import_torch_is_an_error_not_a_dead_process(name: str) -> None:
    result = run_python("-c", _ABORTING_ENV, env={name: "bogus"})
    assert result.returncode == 0, result.stderr
    assert f"refused: {name}='bogus': torch 2.14 (a CUDA build) aborts" in result.stdout
    assert "Fix: give every key a value" in result.stdout
    assert "torch imported: False" in result.stdout


def test_the_face_shows_its_public_names_only() -> None:
    import hybridmem as hm

    assert dir(hm) == sorted(hm.__all__)
    for private in ("Any", "TYPE_CHECKING", "importlib", "sys", "annotations"):
        assert private not in dir(hm)


@pytest.mark.parametrize(
    ("guess", "wanted"),
    [
        ("backends", "did you mean hm.list_backends()"),
        ("allocator_stat", "did you mean hm.allocator_state?"),
        ("empty_cache", "did you mean hm.release_cache()?"),
        ("no_such_name", "the public names are in hm.__all__"),
    ],
)
def test_a_guessed_name_points_at_what_the_user_wanted(guess: str, wanted: str) -> None:
    import hybridmem as hm

    with pytest.raises(AttributeError, match=re.escape(wanted)):
        getattr(hm, guess)


@pytest.mark.skipif(
    os.environ.get("HYBRIDMEM_TEST_INSTALLED") != "1",
    reason="judges an installed wheel: set HYBRIDMEM_TEST_INSTALLED=1 where one is tested",
)
def test_the_tests_judge_the_installed_wheel_not_a_checkout() -> None:
    import sysconfig

    from tests.helpers import PACKAGE, REPO

    assert not (REPO / "hybridmem").exists(), "the checkout's package would shadow the wheel"
    assert PACKAGE.is_relative_to(Path(sysconfig.get_paths()["purelib"]).resolve())
    assert not list(PACKAGE.parent.glob("__editable__*hybridmem*")), "an editable install"
