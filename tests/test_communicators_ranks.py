"""suspend_communicators across CPU ranks: they agree first, and a misbehaving rank is named.

Each case starts real processes over gloo (``tests/gloo_communicators.py``) whose NCCL
is the stand-in: it waits for every rank in the store as NCCL's bootstrap barrier
does, so a rank that called NCCL without its peers would hang the test, not pass it.
What ran on real NCCL, and what did not: docs/communicators.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.ranks import run_rank_processes

WORLD = 3


def run_case(tmp_path: Path, case: str, world: int = WORLD) -> dict[int, dict[str, Any]]:
    """Run the ranks; return each rank's record. A hang fails the test; a rank that
    dies on purpose (``dies:R``) exits 3, every other exit must be 0."""
    done = run_rank_processes(
        "tests.gloo_communicators", [str(tmp_path), case], world, what=f"case {case}"
    )
    errors = [
        f"rank {rank} exited {code}:\n{err[-3000:]}"
        for rank, (code, err) in enumerate(done)
        if code != (3 if case == f"dies:{rank}" else 0)
    ]
    if errors:
        pytest.fail("\n".join(errors))
    return {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)}


def _events(record: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [e for e in record["events"] if e["event"] == kind]


def test_every_rank_suspends_inside_and_resumes_after(tmp_path: Path) -> None:
    ranks = run_case(tmp_path, "all")
    for record in ranks.values():
        inside = _events(record, "inside")
        assert len(inside) == 2
        assert all(len(e["suspended"]) == 1 for e in inside)
        assert not _events(record, "error")
        assert record["suspended_at_end"] == []
        assert _events(record, "all_reduce after")[0]["value"] == [WORLD, WORLD]
        assert [c for c, _ in record["calls"]] == ["suspend", "resume"] * 2


def test_ranks_that_disagree_leave_the_group_alone_on_every_rank(tmp_path: Path) -> None:
    ranks = run_case(tmp_path, "old:1")
    for record in ranks.values():
        assert _events(record, "inside")[0]["suspended"] == []
        assert record["calls"] == []  # no rank called NCCL
        left = _events(record, "left")[0]
        assert any("ranks disagree" in w and "1: NCCL 2.28.9" in w for w in left["warnings"])


def test_a_rank_that_never_enters_is_named_and_nothing_is_suspended(tmp_path: Path) -> None:
    ranks = run_case(tmp_path, "absent:2")
    for rank in (0, 1):
        error = _events(ranks[rank], "error")[0]
        assert "ranks [2] did not come" in error["message"]
        assert "nothing was suspended" in error["message"]
        assert error["seconds"] < 60  # the scope's bound, not NCCL's hang
        assert ranks[rank]["calls"] == []
        assert ranks[rank]["suspended_at_end"] == []


def test_a_rank_whose_suspend_fails_is_named_on_every_rank(tmp_path: Path) -> None:
    ranks = run_case(tmp_path, "fail_suspend:1")
    for rank, record in ranks.items():
        error = _events(record, "error")[0]
        assert "failed on rank(s) 1 (failed: ncclCommSuspend returned 1" in error["message"]
        assert error["suspended_ranks"] == [0, 2]
        assert not _events(record, "inside")  # the block did not run
        assert len(record["suspended_at_end"]) == (0 if rank == 1 else 1)


def test_a_rank_whose_resume_fails_is_named_and_its_state_said(tmp_path: Path) -> None:
    ranks = run_case(tmp_path, "fail_resume:0")
    for rank, record in ranks.items():
        error = _events(record, "error")[0]
        assert "resuming group" in error["message"]
        assert "rank(s) 0" in error["message"]
        assert error["suspended_ranks"] == [0]
        assert len(record["suspended_at_end"]) == (1 if rank == 0 else 0)


def test_a_rank_that_dies_while_suspended_is_named_at_exit(tmp_path: Path) -> None:
    ranks = run_case(tmp_path, "dies:1")
    for rank in (0, 2):
        error = _events(ranks[rank], "error")[0]
        assert "ranks [1] did not come" in error["message"]
        assert "stays suspended" in error["message"]
        assert ranks[rank]["suspended_at_end"] != []  # said, not hidden
        assert error["seconds"] < 60
