"""Start CPU ranks of a test as processes, and wait for them with a bound.

What every multi-rank CPU test does (``tests/test_ranks_gloo.py``,
``tests/test_communicators_ranks.py``): ``world`` processes of ``python -m module``
with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set, then each waited
for; a rank that hangs kills them all and fails the test.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO, clean_env, free_port

HANG_S = 120.0  # a rank of these tests is done in seconds; one this late is stuck


def run_rank_processes(
    module: str,
    args: list[str],
    world: int,
    *,
    env: dict[int, dict[str, str]] | None = None,
    what: str = "",
) -> list[tuple[int, str]]:
    """Run ``python -m module *args`` as ``world`` ranks; each one's exit code and stderr.

    Args:
        env: more variables for a rank, by rank.
        what: what the ranks run, for the failure a hang gives.
    """
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=REPO,
            env=clean_env(
                RANK=str(rank),
                WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                **(env or {}).get(rank, {}),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    done = []
    for rank, proc in enumerate(procs):
        try:
            _, err = proc.communicate(timeout=HANG_S)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
                other.communicate()
            pytest.fail(f"rank {rank} hung{' in ' + what if what else ''}")
        done.append((proc.returncode, err))
    return done
