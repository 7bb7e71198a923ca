"""The ``hybridmem`` command line."""

from __future__ import annotations

import json

import pytest

from hybridmem.cli import main
from tests.helpers import run_python


def test_doctor_human(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:256")
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "torch APIs:" in out
    assert "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:256" in out
    assert "[env: PYTORCH_CUDA_ALLOC_CONF]" in out
    assert "verdict: ok" in out


def test_doctor_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True
    assert report["problems"] == []
    assert report["torch"]["version"]
    assert report["allocator"]["settings"]["expandable_segments"]["source"] == "default"
    assert "torch._C._accelerator_setAllocatorSettings" in report["torch_apis"]
    assert report["torch"]["cuda_initialized"] is False


def test_doctor_fails_on_a_malformed_env(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:yes")
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "ERROR: PYTORCH_ALLOC_CONF: invalid value for expandable_segments" in out
    assert "something blocks hybridmem" in out
    assert main(["doctor", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["ok"] is False


def test_doctor_reports_the_kill_switch(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HYBRIDMEM_DISABLE", "1")
    assert main(["doctor"]) == 0
    assert "HYBRIDMEM_DISABLE is on" in capsys.readouterr().out


def test_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    with pytest.raises(SystemExit) as exit_info:
        main(["nonsense"])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert "hybridmem 0.1.0" in capsys.readouterr().out


def test_installed_entry_point_runs_in_a_fresh_process() -> None:
    result = run_python("-m", "hybridmem.cli", "doctor", "--json", timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["ok"] is True
