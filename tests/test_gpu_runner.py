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
