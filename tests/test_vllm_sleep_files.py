"""Loading vLLM's sleep-mode allocator from its wheel's files: what is refused, and how."""

from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path

import pytest

from hybridmem.integrations.vllm import sleep_files


def _wheel(path: Path, names: tuple[str, ...]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name in names:
            archive.writestr(name, "# stand-in\n")
    return path


def test_extract_copies_the_six_files_and_names_a_missing_one(tmp_path: Path) -> None:
    whole = _wheel(tmp_path / "vllm-0.33.0-py3-none-any.whl", sleep_files.FILES)
    out = sleep_files.extract(whole, tmp_path / "files")
    assert all((out / name).is_file() for name in sleep_files.FILES)
    short = _wheel(tmp_path / "other.whl", sleep_files.FILES[1:])
    with pytest.raises(ValueError, match=r"has no vllm/cumem_allocator\.abi3\.so"):
        sleep_files.extract(short, tmp_path / "short")
    with pytest.raises(FileNotFoundError, match=r"pip download --no-deps vllm==0\.33\.0"):
        sleep_files.extract(tmp_path / "missing.whl", tmp_path / "x")


def test_a_folder_without_the_files_is_refused_naming_the_first_missing(tmp_path: Path) -> None:
    (tmp_path / "vllm").mkdir()
    with pytest.raises(FileNotFoundError, match=r"cumem_allocator\.abi3\.so: missing"):
        sleep_files.load_cumem(tmp_path)


def test_without_vllm_or_a_path_the_error_says_what_to_pass() -> None:
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    with pytest.raises(ModuleNotFoundError, match="pass its wheel or a folder of its files"):
        sleep_files.load_cumem()


def test_a_release_before_0_31_loads_without_alloc_conf_and_one_that_imports_it_needs_it(
    tmp_path: Path,
) -> None:
    older = tuple(n for n in sleep_files.FILES if n not in sleep_files.SINCE_0_31)
    out = sleep_files.extract(_wheel(tmp_path / "vllm-0.29.0.whl", older), tmp_path / "old")
    assert sleep_files.first_missing(out) is None  # 0.25 - 0.30: the toggle is in cumem.py
    cumem = out / "vllm/device_allocator/cumem.py"
    cumem.write_text("from vllm.device_allocator.alloc_conf import set_alloc_conf\n")
    assert sleep_files.first_missing(out) == "vllm/device_allocator/alloc_conf.py"
