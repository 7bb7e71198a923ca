"""ipc_capabilities: interpretation of the probe's facts, caching, and the real probe."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

import hybridmem as hm
from hybridmem import _torch
from hybridmem._platform import linux as _linux
from hybridmem.ipc import _launch as _probe_launch
from hybridmem.ipc import capabilities
from hybridmem.ipc.capabilities import IpcCapabilities
from tests.helpers import run_python

OK = {"self_fetch_errno": None, "producer_fetch_errno": None, "seccomp": 0}


def interpret(**facts: Any) -> IpcCapabilities:
    return capabilities._interpret(0, facts, 0.5)


def test_everything_works() -> None:
    caps = interpret(**OK, classic_ok=True, expandable_ok=True, expandable_handle="posix_fd")
    assert (caps.classic_ipc, caps.expandable_ipc, caps.pidfd_getfd) == (True, True, "allowed")
    assert caps.reason is None
    assert "nothing to do" in caps.advice
    assert not caps.blocking
    assert json.loads(json.dumps(caps.as_dict()))["expandable_handle"] == "posix_fd"


def test_seccomp_denial() -> None:
    caps = interpret(
        self_fetch_errno="EPERM",
        producer_fetch_errno="EPERM",
        seccomp=2,
        classic_ok=True,
        expandable_ok=False,
        expandable_import_error="RuntimeError: pidfd_getfd: Operation not permitted",
    )
    assert (caps.pidfd_getfd, caps.denied_by) == ("denied", "seccomp")
    assert caps.reason is not None
    assert "seccomp filter" in caps.reason
    assert "ipc_safe" in caps.advice
    assert "seccomp profile" in caps.advice
    assert "pidfd_getfd:         denied (by seccomp)" in str(caps)


def test_ptrace_denial(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_linux, "yama_ptrace_scope", lambda: 1)
    caps = interpret(
        self_fetch_errno=None,
        producer_fetch_errno="EPERM",
        classic_ok=True,
        expandable_ok=False,
    )
    assert (caps.pidfd_getfd, caps.denied_by, caps.ptrace_scope) == ("denied", "ptrace", 1)
    assert caps.reason is not None
    assert "ptrace_scope=1" in caps.reason
    assert "allow_ptrace_from_any" in caps.advice


def test_no_kernel_support() -> None:
    caps = interpret(self_fetch_errno="ENOSYS", classic_ok=True, expandable_ok=False)
    assert caps.pidfd_getfd == "unsupported"
    assert caps.reason is not None
    assert "5.6" in caps.reason


def test_ipc_handles_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC", "0")
    caps = interpret(
        **OK,
        classic_ok=True,
        expandable_export_error="RuntimeError: Tensors allocated with expandable_segments:True "
        "cannot be shared between processes",
    )
    assert caps.expandable_ipc is False
    assert caps.reason is not None
    assert caps.reason.startswith("TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC=0")


def test_torch_too_old() -> None:
    caps = interpret(**OK, classic_ok=True, expandable_export_error="RuntimeError: cannot share")
    assert caps.reason is not None
    assert "cannot export tensors from expandable" in caps.reason


def test_classic_ipc_broken_is_blocking() -> None:
    caps = interpret(**OK, classic_ok=False, classic_import_error="RuntimeError: invalid handle")
    assert caps.blocking
    assert caps.reason == "RuntimeError: invalid handle"
    assert "fallback='host'" in caps.advice


def test_no_cuda() -> None:
    caps = interpret(**OK, cuda_error="no CUDA device is visible to the probe")
    assert not caps.cuda
    assert caps.classic_ipc is None
    assert caps.expandable_ipc is None
    assert not caps.blocking
    assert caps.pidfd_getfd == "allowed"
    assert "not probed" in str(caps)


def test_probe_failure_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    caps = interpret(cuda_error="the IPC probe failed (exit 1): boom")
    assert caps.pidfd_getfd == "unknown"
    assert caps.reason is not None
    assert "boom" in caps.reason


def test_probed_once_per_device_and_refresh(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, bool]] = []

    def fake_probe(device: int, cuda: bool) -> dict[str, Any]:
        calls.append((device, cuda))
        return dict(OK)

    monkeypatch.setattr(capabilities, "_run_probe", fake_probe)
    first = hm.ipc_capabilities()
    assert hm.ipc_capabilities(0) is first
    assert capabilities.cached_capabilities(0) is first
    hm.ipc_capabilities(refresh=True)
    assert len(calls) == 2
    with pytest.raises(TypeError, match="refresh must be True or False"):
        hm.ipc_capabilities(refresh=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be >= 0"):
        hm.ipc_capabilities(-1)


PROBE = """
import json, sys
sys.path.insert(0, ".")
if sys.argv[1] == "deny":
    from tests.seccomp import deny_pidfd_getfd
    deny_pidfd_getfd()
import hybridmem as hm
print(json.dumps(hm.ipc_capabilities().as_dict()))
"""


@pytest.mark.skipif(not _linux.is_linux(), reason="pidfd is Linux only")
@pytest.mark.parametrize("mode", ["open", "deny"])
def test_real_probe_in_fresh_process(mode: str) -> None:
    done = run_python("-c", PROBE, mode, timeout=120)
    assert done.returncode == 0, done.stderr
    caps = json.loads(done.stdout.strip().splitlines()[-1])
    if mode == "deny":
        assert caps["pidfd_getfd"] == "denied"
        assert caps["denied_by"] == "seccomp"
        assert caps["seccomp"] == 2
    else:
        assert caps["pidfd_getfd"] in ("allowed", "denied")  # ptrace rules vary by host
        assert caps["denied_by"] != "seccomp"
    if not caps["cuda"]:
        assert caps["classic_ipc"] is None


# --------------------------------------------------------------------------- #
# A probe started early (what `hybridmem doctor` does before importing torch)
# --------------------------------------------------------------------------- #


@pytest.mark.skipif(not _linux.is_linux(), reason="pidfd is Linux only")
def test_early_probe_is_taken_once_and_only_when_it_fits() -> None:
    _probe_launch.start_early(0, cuda=False)
    assert _probe_launch.take(0, cuda=True) is None  # torch sees a GPU: not good enough
    assert _probe_launch.take(0, cuda=False) is None  # and it was dropped
    run = _probe_launch.start_early(0, cuda=False)
    assert _probe_launch.take(1, cuda=False) is None  # another device
    assert _probe_launch.take(0, cuda=False) is run
    assert _probe_launch.take(0, cuda=False) is None  # taken once
    facts = run.facts()
    assert facts["elapsed_s"] >= 0
    assert "self_fetch_errno" in facts  # the syscall checks ran, without torch
    _probe_launch.start_early(2, cuda=False)
    _probe_launch.discard_pending()
    assert _probe_launch.take(2, cuda=False) is None


def test_probe_that_cannot_start_is_an_error_fact(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    facts = _probe_launch.ProbeRun(0, cuda=False).facts()
    assert facts["cuda_error"].startswith("could not start the IPC probe")
    caps = capabilities._interpret(0, facts, 0.0)
    assert caps.cuda is False
    assert caps.reason is not None
    assert "could not start" in caps.reason


def test_ipc_capabilities_adopts_the_early_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[tuple[int, bool]] = []

    class FakeRun:
        def __init__(self, device: int, cuda: bool) -> None:
            made.append((device, cuda))
            self.cuda = cuda

        def facts(self) -> dict[str, Any]:
            return {**OK, "elapsed_s": 4.25}

        def discard(self) -> None:
            pass

    monkeypatch.setattr(_probe_launch, "ProbeRun", FakeRun)
    monkeypatch.setattr(_torch, "cuda_available", lambda: True)
    _probe_launch.start_early(0, cuda=True)
    caps = hm.ipc_capabilities(0)
    assert made == [(0, True)]  # adopted, not started twice
    assert caps.elapsed_s == 4.25  # the probe's own time, from its start
    assert "elapsed_s" not in caps.details


def test_doctor_starts_its_probe_before_importing_torch() -> None:
    code = """
import json, sys
from hybridmem.ipc import _launch as _probe_launch
started = []
original = _probe_launch.start_early
def spy(device, cuda=None):
    started.append((device, "torch" in sys.modules))
    return original(device, cuda)
_probe_launch.start_early = spy
from hybridmem.cli import main
code = main(["doctor", "--json"])
print(json.dumps({"code": code, "started": started}))
"""
    done = run_python("-c", code, timeout=120)
    assert done.returncode == 0, done.stderr
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert facts == {"code": 0, "started": [[0, False]]}


def fake_probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> None:
    """Put a stand-in program where the launcher looks for the probe."""
    script = tmp_path / "fake_probe.py"
    script.write_text(body)
    monkeypatch.setattr(_probe_launch, "PROBE", script)


def test_the_answer_is_taken_without_waiting_for_the_exit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Answers, closes its output, then never exits (as a CUDA teardown that takes long).
    fake_probe(
        tmp_path,
        monkeypatch,
        "import json, os, sys, threading\n"
        "sys.stdout.write(json.dumps({'classic_ipc': True}))\n"
        "sys.stdout.flush()\n"
        "os.dup2(os.open(os.devnull, os.O_WRONLY), 1)\n"
        "threading.Event().wait()\n",
    )
    run = _probe_launch.ProbeRun(0, cuda=False)
    try:
        facts = run.facts()
        assert facts["classic_ipc"] is True
        assert run._process is not None
        assert run._process.poll() is None  # still running: its exit was not awaited
    finally:
        run.discard()
    assert run._process.poll() is not None


def test_a_failing_probe_says_how_it_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_probe(
        tmp_path,
        monkeypatch,
        "import sys\nprint('half an answer')\nprint('boom: no driver', file=sys.stderr)\n"
        "sys.exit(3)\n",
    )
    facts = _probe_launch.ProbeRun(0, cuda=False).facts()
    assert facts["cuda_error"] == "the IPC probe failed (exit 3): boom: no driver"
    fake_probe(tmp_path, monkeypatch, "print('[1, 2]')\n")
    facts = _probe_launch.ProbeRun(0, cuda=False).facts()
    assert facts["cuda_error"] == "the IPC probe said nothing"


@pytest.mark.skipif(not _linux.is_linux(), reason="pidfd is Linux only")
def test_the_real_probe_reports_when_each_side_got_where() -> None:
    run = _probe_launch.ProbeRun(0, cuda=False)
    facts = run.facts()
    timings = facts["timings"]
    assert {"producer_start", "exported", "consumer_start", "consumer_done", "answered"} <= set(
        timings
    )
    assert timings["producer_start"] <= timings["exported"] <= timings["answered"]
    assert timings["consumer_start"] <= timings["consumer_done"] <= timings["answered"]
