"""The GPU runner's wait: a marked process holding the GPU is waited for, then let go."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu import runner

HOLD = "import sys; f = open(sys.argv[1]); print('holding', flush=True); sys.stdin.read()"


def _holder(node: Path, *, marked: bool) -> subprocess.Popen[str]:
    env = dict(os.environ)
    if not marked:
        env.pop(runner.MARK)
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(node)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert child.stdout is not None
    assert child.stdout.readline() == "holding\n"
    return child


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs Linux /proc")
def test_a_marked_process_holding_the_gpu_is_waited_for_and_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = tmp_path / "nvidia0"  # stands for /dev/nvidia0
    node.write_text("")
    monkeypatch.setattr(runner, "_GPU_NODE", re.compile(re.escape(str(node)) + "$"))
    # Only the marked and the unmarked holder here: any process of this user exiting
    # meanwhile (a parallel worker's child) would be named too (tested below).
    monkeypatch.setattr(runner, "_exiting", lambda pid: False)
    ours = _holder(node, marked=True)
    stranger = _holder(node, marked=False)  # not started by this test run: ignored
    try:
        holders = runner.gpu_holders()
        assert list(holders) == [ours.pid]
        assert str(node) in holders[ours.pid]
        assert runner.gpu_holders(allowed=[ours.pid]) == {}
        with pytest.raises(AssertionError, match=rf"still hold the GPU after 0.2 s: {{{ours.pid}"):
            runner.wait_until_alone(timeout=0.2)
        assert ours.stdin is not None
        ours.stdin.close()  # it exits: the wait ends on its pidfd, well within the bound
        runner.wait_until_alone(timeout=30)
        assert runner.gpu_holders() == {}
    finally:
        for child in (ours, stranger):
            child.kill()
            child.wait(30)
            for stream in (child.stdin, child.stdout):
                if stream is not None:
                    stream.close()


MiB = 1 << 20
BASE = 147_228_393_472  # device free bytes at a stage boundary (pass 2's, H200)


def _run(cycles: int, leak_from: int | None = None, leak: int = 0) -> list[dict[str, int]]:
    """Boundaries of ``cycles`` cycles, flat but for ``leak`` bytes from ``leak_from`` on."""
    return [
        {
            "to_rollout:offload": BASE - (leak if leak_from is not None and i >= leak_from else 0),
            "to_trainer:reload": BASE + 2 * MiB * (i % 2),  # the 2 MiB the H200 runs wobble by
        }
        for i in range(cycles)
    ]


def test_window_drift_ignores_a_moment_of_memory_held_and_names_it() -> None:
    """Pass 2 of 2026-12-02: 651.6 MiB held in one cycle only; last minus first called it drift."""
    samples = _run(49)
    samples[0]["to_rollout:offload"] -= 683_212_800
    assert samples[-1]["to_rollout:offload"] - samples[0]["to_rollout:offload"] == 683_212_800
    drift = runner.window_drift(samples)
    assert drift == {"to_rollout:offload": 0, "to_trainer:reload": 0}
    assert runner.off_the_median(samples, 16 * MiB) == [(0, "to_rollout:offload", -683_212_800)]


@pytest.mark.parametrize(
    ("leak_from", "leak"),
    [(0, 0), (20, 100 * MiB), (38, 65 * MiB)],  # flat; a step mid-run; a late step
)
def test_window_drift_catches_memory_that_stays_gone(leak_from: int, leak: int) -> None:
    drift = runner.window_drift(_run(49, leak_from, leak))
    assert drift["to_rollout:offload"] == -leak
    assert drift["to_trainer:reload"] == 0


def test_window_drift_catches_a_slow_leak() -> None:
    samples = [{"stage": BASE - 2 * MiB * i} for i in range(49)]  # 2 MiB per cycle
    assert (
        runner.window_drift(samples)["stage"] == -2 * MiB * 39
    )  # the medians: cycle 44 against cycle 5
    assert abs(runner.window_drift(samples)["stage"]) > 64 * MiB  # the test's bound fails it


def test_window_drift_needs_two_windows() -> None:
    with pytest.raises(ValueError, match="at least 20 samples, got 19"):
        runner.window_drift(_run(19))


def test_stat_lines_are_read_past_a_command_with_parentheses() -> None:
    line = "4242 (a) b (c)) D 1 4242 4242 0 -1 4194564 10 0 0 0 0 0 0 0 20 0 1 0 99 0 0"
    assert runner._parse_stat(line) == ("D", 4194564)


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="needs Linux /proc")
def test_only_a_process_in_its_exit_counts_as_exiting() -> None:
    assert not runner._exiting(str(os.getpid()))  # running
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        # Exited, not reaped: a zombie, whose driver teardown (if any) is done.
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
        assert Path(f"/proc/{child.pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
        assert not runner._exiting(str(child.pid))
    finally:
        child.wait(30)
    assert not runner._exiting(str(child.pid))  # gone


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs Linux /proc")
def test_an_exiting_process_is_waited_for_even_unmarked_and_without_gpu_fds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # In do_exit a process loses its environment (its mark) and then its fds before
    # the driver's teardown ends; the runner must not take that for "gone".
    stranger = _holder(Path(os.devnull), marked=False)
    try:
        monkeypatch.setattr(runner, "_exiting", lambda pid: False)  # nobody else's exit
        assert runner.gpu_holders() == {}
        monkeypatch.setattr(runner, "_exiting", lambda pid: pid == str(stranger.pid))
        assert "exiting" in runner.gpu_holders()[stranger.pid]
        with pytest.raises(AssertionError, match=rf"{stranger.pid}: '\(exiting"):
            runner.wait_until_alone(timeout=0.2)
    finally:
        stranger.kill()
        stranger.wait(30)
        for stream in (stranger.stdin, stranger.stdout):
            if stream is not None:
                stream.close()
