"""The ``hybridmem`` command line."""

from __future__ import annotations

import json
import re
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import torch

import hybridmem as hm
from hybridmem import _version, cli
from hybridmem.cli import main
from hybridmem.ipc import capabilities
from hybridmem.observe import timeline
from hybridmem.scopes.allocator import _reset_state_for_tests
from tests.conftest import FakeTorch
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
    # The variable every torch reads (2.4 to 2.9 ignore PYTORCH_ALLOC_CONF).
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:yes")
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert re.search(
        r"ERROR: PYTORCH_CUDA_ALLOC_CONF='expandable_segments:yes': torch \d+\.\d+ refuses "
        r"expandable_segments:yes: expected True or False \(exactly\)",
        out,
    )
    assert "fix it or unset PYTORCH_CUDA_ALLOC_CONF" in out
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
    assert f"hybridmem {_version.__version__}" in capsys.readouterr().out


def test_the_version_is_one_and_the_distribution_says_it() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+", _version.__version__)
    assert metadata.version("hybridmem") == _version.__version__  # pyproject reads it


def test_installed_entry_point_runs_in_a_fresh_process() -> None:
    result = run_python("-m", "hybridmem.cli", "doctor", "--json", timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["ok"] is True


# --------------------------------------------------------------------------- #
# doctor: CUDA IPC and engines
# --------------------------------------------------------------------------- #


def fake_caps(monkeypatch: pytest.MonkeyPatch, **facts: Any) -> None:
    base: dict[str, Any] = {"self_fetch_errno": None, "producer_fetch_errno": None, "seccomp": 0}
    base.update(facts)
    caps = capabilities._interpret(0, base, 0.3)
    monkeypatch.setattr(cli, "ipc_capabilities", lambda: caps)


#: What the probe finds in a container that forbids pidfd_getfd (seccomp filter).
PIDFD_DENIED: dict[str, Any] = {
    "self_fetch_errno": "EPERM",
    "producer_fetch_errno": "EPERM",
    "seccomp": 2,
    "classic_ok": True,
    "expandable_ok": False,
    "classic_legacy_ipc": True,
    "expandable_legacy_ipc": False,
}


def test_doctor_reports_ipc_denial_in_a_container(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_caps(monkeypatch, **PIDFD_DENIED, expandable_handle="posix_fd")
    assert main(["doctor"]) == 0  # classic IPC works: nothing blocks
    out = capsys.readouterr().out
    assert "classic segments:      works" in out
    assert "expandable segments:   FAILS (handle posix_fd)" in out
    assert "pidfd_getfd:           denied (by seccomp)" in out
    assert "expandable toggle:     works" in out
    assert "tensors in expandable segments cannot be shared" in out
    assert main(["doctor", "--json"]) == 0
    ipc = json.loads(capsys.readouterr().out)["ipc"]
    assert ipc["denied_by"] == "seccomp"
    assert ipc["expandable_toggle_works"] is True


def test_doctor_fails_when_cuda_ipc_is_broken(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_caps(monkeypatch, classic_ok=False, classic_import_error="RuntimeError: bad handle")
    assert main(["doctor", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert any("CUDA IPC does not work here" in p for p in report["problems"])


def test_doctor_without_probe(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--json", "--no-probe"]) == 0
    assert "ipc" not in json.loads(capsys.readouterr().out)


def test_doctor_engine_versions_and_known_incompatibilities(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    installed = {"vllm": "0.10.1", "torch-memory-saver": "0.0.8"}

    def version(name: str) -> str:
        if name in installed:
            return installed[name]
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", version)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    # torch_memory_saver cannot start: blocking for SGLang, so the doctor fails
    assert main(["doctor", "--json", "--no-probe"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["engines"] == {
        "vllm": "0.10.1",
        "sglang": None,
        "torch_memory_saver": "0.0.8",
    }
    assert any("Expandable segments are not compatible" in n for n in report["notes"])
    installed["vllm"] = "0.33.0"  # toggles them off inside its pool by itself
    main(["doctor", "--json", "--no-probe"])
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert not any("not compatible" in n for n in notes)
    assert any(
        "vllm 0.33.0 with expandable_segments:True in the env: vLLM turns" in n for n in notes
    )
    installed["vllm"] = "0.10.1"
    assert any("torch_memory_saver 0.0.8: PYTORCH_CUDA_ALLOC_CONF" in p for p in report["problems"])
    saver = report["torch_memory_saver"]
    assert (saver["version"], saver["hook_mode"], saver["refuses_to_start"]) == (
        "0.0.8",
        "torch",
        True,
    )
    assert main(["doctor", "--no-probe"]) == 1
    assert (
        "torch_memory_saver 0.0.8: hook mode torch (none in LD_PRELOAD)" in capsys.readouterr().out
    )


# --------------------------------------------------------------------------- #
# plot
# --------------------------------------------------------------------------- #


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def synthetic_timeline(path: Path, cycles: int, ranks: int = 1) -> list[Path]:
    files = []
    for rank in range(ranks):
        lines = []
        t = 1000.0
        for cycle in range(cycles):
            for name, seconds, allocated in (
                ("train", 0.5, 20 + cycle * 0.01),
                ("wake_up", 0.1, 5),
                ("weight_sync", 0.05, 6),
                ("rollout", 0.8, 5),
                ("sleep", 0.1, 5),
            ):
                gib = 2**30
                lines.append(
                    json.dumps(
                        {
                            "name": f"phase:{name}",
                            "kind": "phase",
                            "backend": "vllm",
                            "start": t,
                            "duration": seconds,
                            "device": 0,
                            "rank": rank,
                            "pid": 1,
                            "thread": 1,
                            "before": {"allocated": 5 * gib, "reserved": 8 * gib, "used": 9 * gib},
                            "after": {
                                "allocated": int(allocated * gib),
                                "reserved": int((allocated + 3) * gib),
                                "used": int((allocated + 60 * (name == "rollout")) * gib),
                            },
                            "args": {},
                        }
                    )
                )
                t += seconds
        file = path / f"timeline.rank{rank}.jsonl"
        file.write_text("\n".join(lines) + "\n")
        files.append(file)
    return files


def image_spread(path: Path) -> float:
    import matplotlib.image

    pixels = matplotlib.image.imread(path)
    return float(pixels.std())


@pytest.mark.parametrize(("cycles", "ranks"), [(1, 1), (500, 2)])
def test_plot_writes_a_non_trivial_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cycles: int, ranks: int
) -> None:
    pytest.importorskip("matplotlib")
    files = synthetic_timeline(tmp_path, cycles, ranks)
    out = tmp_path / "plots" / "timeline.png"
    assert main(["plot", *map(str, files), "-o", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    width, height = png_size(out)
    assert width >= 1000
    assert height >= 300 * ranks
    assert out.stat().st_size > 20_000  # lines, shading and labels, not an empty canvas
    assert image_spread(out) > 0.05


def test_plot_view_follows_the_number_of_cycles() -> None:
    from hybridmem.observe.plot import MAX_TIME_CYCLES, view

    def spans(cycles: int, ranks: int = 1, names: tuple[str, ...] = ("a", "b")) -> list[Any]:
        return [
            {"name": f"phase:{n}", "rank": r}
            for r in range(ranks)
            for _ in range(cycles)
            for n in names
        ]

    assert view([]) == "time"
    assert view(spans(1)) == "time"
    # many phases a cycle (bench steps around hybridmem phases): still over time
    assert view(spans(MAX_TIME_CYCLES, names=tuple("abcdefghij"))) == "time"
    assert view(spans(MAX_TIME_CYCLES, ranks=4)) == "time"  # ranks do not add up
    assert view(spans(MAX_TIME_CYCLES + 1)) == "cycles"
    assert view(spans(500, ranks=2)) == "cycles"


def test_plot_from_a_real_recording(fake_gpu: FakeTorch, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    with hm.record(tmp_path / "t"):
        for _ in range(3):
            with hm.phase("train", backend="vllm"):
                fake_gpu.devices[0].allocated += 1 << 30
            with hm.phase("rollout", backend="vllm"):
                pass
    out = tmp_path / "t.png"
    assert main(["plot", str(tmp_path / "t.jsonl"), "-o", str(out), "--title", "test"]) == 0
    assert png_size(out)[0] >= 1000


def test_plot_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["plot", str(empty), "-o", str(tmp_path / "x.png")]) == 1
    assert "has no events" in capsys.readouterr().err
    assert main(["plot", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "x.png")]) == 1
    assert "cannot read timeline" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["plot", str(empty)])  # -o or --trace is required
    assert exit_info.value.code == 2


# --------------------------------------------------------------------------- #
# Issue #11: wrong files, unwritable paths, a bad HYBRIDMEM_TIMELINE: one line
# --------------------------------------------------------------------------- #


def _one_clear_line(capsys: pytest.CaptureFixture[str], *expected: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def _wrong_files(tmp_path: Path) -> dict[str, Path]:
    png = tmp_path / "picture.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    bench_json = tmp_path / "results.json"
    bench_json.write_text(json.dumps({"results": {"naive": {"summary": {}}}}, indent=2))
    not_events = tmp_path / "other.jsonl"
    not_events.write_text('{"a": 1}\n{"b": 2}\n')
    timeline = tmp_path / "timeline.jsonl"
    event = {"name": "phase:train", "start": 1.0, "duration": 0.5, "kind": "phase"}
    timeline.write_text(json.dumps(event) + "\n")
    return {
        "png": png,
        "bench_json": bench_json,
        "not_events": not_events,
        "timeline": timeline,
        "folder": tmp_path,
        "missing": tmp_path / "missing.jsonl",
    }


@pytest.mark.parametrize("kind", ["png", "bench_json", "not_events", "folder", "missing"])
def test_plot_on_the_wrong_kind_of_file_says_so_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    pytest.importorskip("matplotlib")
    files = _wrong_files(tmp_path)
    assert main(["plot", str(files[kind]), "-o", str(tmp_path / "out.png")]) == 1
    _one_clear_line(capsys, "hybridmem plot:", str(files[kind]))


@pytest.mark.parametrize("kind", ["png", "timeline", "not_events", "folder", "missing"])
def test_bench_from_json_on_the_wrong_kind_of_file_says_so_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    files = _wrong_files(tmp_path)
    assert main(["bench", "--from-json", str(files[kind])]) == 2
    _one_clear_line(capsys, "hybridmem bench:", str(files[kind]))


def test_unwritable_outputs_are_refused_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    unwritable = str(blocker / "out.png")  # its "folder" is a file: even root cannot
    files = _wrong_files(tmp_path)
    assert main(["plot", str(files["timeline"]), "-o", unwritable]) == 1
    _one_clear_line(capsys, "hybridmem plot:", "cannot make its folder")
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps({"results": {"hybridmem": {"summary": {"cycles": 2}}}}))
    for flag in ("--json", "--plot"):
        assert main(["bench", "--from-json", str(saved), flag, unwritable]) == 2
        _one_clear_line(capsys, "hybridmem bench:", flag, "cannot make its folder")
    assert main(["bench", "--quick", "--timeline", str(blocker / "t")]) == 2
    _one_clear_line(capsys, "--timeline", "cannot make its folder")
    assert main(["plot", str(files["timeline"]), "-o", str(tmp_path)]) == 1
    _one_clear_line(capsys, "is a folder")


def test_a_bad_timeline_env_path_is_one_line_at_the_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    monkeypatch.setenv("HYBRIDMEM_TIMELINE", str(blocker / "timeline"))
    assert main(["doctor", "--no-probe"]) == 2
    _one_clear_line(capsys, "HYBRIDMEM_TIMELINE=", "fix or unset HYBRIDMEM_TIMELINE")
    # a library user: checked when recording starts (at import), one warning, no traceback
    done = run_python(
        "-c",
        "import hybridmem.observe.timeline as t; print(t.recording())",
        env={"HYBRIDMEM_TIMELINE": str(blocker / "timeline")},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
    assert "Traceback" not in done.stderr
    assert "HybridMemWarning" in done.stderr
    assert "nothing is recorded" in done.stderr


def test_record_to_an_unwritable_path_fails_at_entry(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="cannot make its folder"), hm.record(blocker / "t"):
        pytest.fail("the block must not run")
    assert not timeline.recording()


def test_doctor_names_the_variable_torch_ignores(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    assert main(["doctor", "--no-probe"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"torch \d+\.\d+ reads: PYTORCH_CUDA_ALLOC_CONF", out)
    assert "IGNORED: PYTORCH_ALLOC_CONF is set, but this torch does not read it" in out
    assert "PYTORCH_ALLOC_CONF is set but torch" in out  # the warning, as a note
    assert main(["doctor", "--no-probe", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["allocator"]["ignored_env"] == ["PYTORCH_ALLOC_CONF"]
    assert report["allocator"]["settings"]["expandable_segments"]["value"] == "False"


def test_doctor_says_fd_passing_works_where_pidfd_is_denied(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_caps(monkeypatch, **PIDFD_DENIED, fd_ok=True)
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "fd passing:            works" in out
    assert "but fd passing can: hm.ipc_export" in out
    assert main(["doctor", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ipc"]["fd_passing"] is True


# --------------------------------------------------------------------------- #
# Issue #22: nothing silently accepted
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("env", "key", "hint"),
    [
        ("expandable_segment:True", "expandable_segment", "did you mean 'expandable_segments'?"),
        ("foo:bar", "foo", ""),
    ],
)
def test_doctor_on_a_cpu_build_fails_on_what_the_cuda_build_refuses(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    env: str,
    key: str,
    hint: str,
) -> None:
    monkeypatch.setattr("hybridmem._torch.cuda_built", lambda: False)
    monkeypatch.setattr("hybridmem._torch.torch_version", lambda: (2, 13))  # 2.10+ rules
    _reset_state_for_tests()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", env)
    assert main(["doctor", "--no-probe"]) == 1
    out = capsys.readouterr().out
    error = next(line for line in out.splitlines() if line.startswith("  ERROR: "))
    assert f"does not know the setting {key!r}" in error
    assert hint in error
    assert "fix it or unset PYTORCH_CUDA_ALLOC_CONF" in error
    assert "something blocks hybridmem" in out
    assert main(["doctor", "--no-probe", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    assert any(f"{key!r}" in problem for problem in report["problems"])


def test_doctor_shows_what_torch_reads_with_the_raw_value_beside_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(
        "PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:-3,garbage_collection_threshold:0.5x"
    )
    assert main(["doctor", "--no-probe"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"max_split_size_mb +unlimited \(written -3\)", out)
    assert re.search(r"garbage_collection_threshold +0\.5 \(written 0\.5x\)", out)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:25.5")
    _reset_state_for_tests()  # a fresh process: the env is read again
    assert main(["doctor", "--no-probe", "--json"]) == 0
    setting = json.loads(capsys.readouterr().out)["allocator"]["settings"]["max_split_size_mb"]
    assert setting == {
        "value": "25.5",
        "reads": "25",
        "shown": "25 (written 25.5)",
        "source": "env",
        "origin": "PYTORCH_CUDA_ALLOC_CONF",
    }


def test_plot_without_an_output_shows_the_plot_usage_and_the_missing_file_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(SystemExit) as exit_info:
        main(["plot", str(missing)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: hybridmem plot ")
    assert f"hybridmem plot: error: cannot read timeline {missing}: no such file" in err
    assert err.index(str(missing)) < err.index("nothing to write")
    present = tmp_path / "present.jsonl"
    present.write_text("")
    with pytest.raises(SystemExit):
        main(["plot", str(present)])
    err = capsys.readouterr().err
    assert "cannot read" not in err
    assert "nothing to write: pass -o FILE.png, --trace FILE.json, or both" in err


def test_plot_errors_carry_one_prefix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    timeline = tmp_path / "t.jsonl"
    event = {"name": "phase:train", "start": 1.0, "duration": 0.5, "kind": "phase"}
    timeline.write_text(json.dumps(event) + "\n")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert main(["plot", str(timeline), "-o", str(tmp_path / "x.png")]) == 1
    line = _one_clear_line(capsys, "needs matplotlib", "pip install matplotlib")
    assert line.count("hybridmem plot") == 1, line


_ABORTING_TORCH = """
import sys
from hybridmem import _version, cli
from hybridmem.allocator import import_check
import_check.installed_torch = lambda: ((2, 14), True)  # a CUDA build of 2.14, as pip installs it
code = cli.main(sys.argv[1:])
print("torch imported:", "torch" in sys.modules)
sys.exit(code)
"""


@pytest.mark.parametrize("value", ["expandable_segments", "expandable_segments:True,x:"])
def test_doctor_catches_an_env_that_aborts_torch_before_importing_it(value: str) -> None:
    result = run_python("-c", _ABORTING_TORCH, "doctor", env={"PYTORCH_CUDA_ALLOC_CONF": value})
    assert result.returncode == 1, result.stderr
    assert f"ERROR: PYTORCH_CUDA_ALLOC_CONF={value!r}: torch 2.14 (a CUDA build) aborts" in (
        result.stdout
    )
    assert "Fix: give every key a value" in result.stdout
    assert "torch imported: False" in result.stdout
    result = run_python(
        "-c", _ABORTING_TORCH, "doctor", "--json", env={"PYTORCH_CUDA_ALLOC_CONF": value}
    )
    report = json.loads(result.stdout.splitlines()[0])
    assert report["ok"] is False
    assert report["torch_aborts"] is True


def test_the_installed_torch_is_read_without_importing_it() -> None:
    code = (
        "import sys; from hybridmem.allocator.import_check import installed_torch; "
        "print(installed_torch(), 'torch' in sys.modules)"
    )
    result = run_python("-c", code)
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    assert result.stdout.strip() == f"({version}, {torch.version.cuda is not None}) False"


@pytest.mark.parametrize(
    ("version", "expected"),
    [((2, 13), "recorded: the model agrees"), ((2, 16), "newer than the recorded ones")],
)
def test_doctor_says_how_this_torchs_rules_are_known(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    version: tuple[int, int],
    expected: str,
) -> None:
    monkeypatch.setattr("hybridmem._torch.torch_version", lambda: version)
    _reset_state_for_tests()
    assert main(["doctor", "--no-probe", "--json"]) == 0
    assert expected in json.loads(capsys.readouterr().out)["allocator"]["rules"]


@pytest.mark.parametrize(("version", "suspend"), [(22809, False), (23007, True)])
def test_doctor_says_whether_nccl_can_suspend_communicators(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    version: int,
    suspend: bool,
) -> None:
    from hybridmem import _torch
    from tests.nccl_standin import StandInNccl

    nccl = StandInNccl(version=version, has_suspend=suspend)
    monkeypatch.setattr(_torch, "cuda_built", lambda: True)
    monkeypatch.setattr(_torch, "nccl_calls", lambda: nccl)
    monkeypatch.setattr(_torch, "nccl_version", lambda: nccl.version_text)
    assert main(["doctor", "--json", "--no-probe"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["nccl"]["version"] == nccl.version_text
    assert report["nccl"]["suspend"] is suspend
    said = [n for n in report["notes"] if "suspend communicators" in n]
    if suspend:
        assert said == []
    else:
        assert len(said) == 1
        assert "NCCL 2.28.9 cannot suspend communicators" in said[0]
        assert "2.29.7" in said[0]
