"""Ranks fail together: two real processes over gloo (CPU; runs in CI).

When one rank's switch fails, every rank's switch for that cycle fails at its next
sync point and recovers; no rank wakes its KV cache while another is still waking
weights or syncing; the next cycle succeeds everywhere; nothing hangs.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.gloo_teardown import DONE_ENV
from tests.ranks import run_rank_processes

CYCLES = 4


#: Why a rank's abort inside gloo's own teardown is not this suite's failure: it came
#: after the rank wrote its results and met every peer at the last barrier
#: (tests/gloo_teardown.py), and every peer marked itself done too. The results are
#: still judged. Any other non-zero exit fails the test, with the rank's stderr.
TEARDOWN = (
    "a rank may abort in gloo's teardown (destroy_process_group, process exit) after it "
    "wrote its results and met every peer; what the test checks is in those results"
)


def start_ranks(
    module: str, args: list[str], world: int = 2, *, teardown_abort: str | None = TEARDOWN
) -> None:
    """Run ``python -m module *args`` as ``world`` gloo ranks; fail on a hang or an error.

    Args:
        teardown_abort: why an abort after every rank marked itself done is not a
            failure here (None: it is one). Nothing is retried.
    """
    with tempfile.TemporaryDirectory() as marks_dir:
        marks = [Path(marks_dir) / f"rank{rank}.done" for rank in range(world)]
        done = run_rank_processes(
            module, args, world, env={r: {DONE_ENV: str(m)} for r, m in enumerate(marks)}
        )
        all_done = all(mark.exists() for mark in marks)
    where = "after every rank was done" if all_done else "before every rank was done"
    failed = [
        f"rank {rank} exited {code} {where}:\n{err[-2000:]}"
        for rank, (code, err) in enumerate(done)
        if code != 0
    ]
    if failed and not (all_done and teardown_abort is not None):  # TEARDOWN says why
        pytest.fail("\n".join(failed))


def run_ranks(tmp_path: Path, fail: str, world: int = 2) -> list[list[dict[str, Any]]]:
    start_ranks("tests.gloo_ranks", [str(tmp_path), fail], world)
    return [
        [json.loads(line) for line in (tmp_path / f"rank{r}.jsonl").read_text().splitlines()]
        for r in range(world)
    ]


def _outcomes(events: list[dict[str, Any]]) -> list[str]:
    return [e["outcome"] for e in events if e["event"] == "outcome"]


def test_a_failed_weight_sync_fails_the_cycle_on_both_ranks(tmp_path: Path) -> None:
    ranks = run_ranks(tmp_path, "1:1:sync")
    rank0, rank1 = ranks
    assert _outcomes(rank1) == ["ok", "Boom: weight sync lost a batch", "ok", "ok"]
    outcomes0 = _outcomes(rank0)
    assert outcomes0[0] == outcomes0[2] == outcomes0[3] == "ok"
    assert outcomes0[1].startswith("HybridSwitchError: rank 0: the switch rank 1 failed at stage")
    assert "'weight_sync' (Boom: weight sync lost a batch)" in outcomes0[1]
    cycle1 = [e["event"] for e in rank0 if e["cycle"] == 1]
    assert "wake:kv_cache" not in cycle1  # rank 0 never woke KV while rank 1 was syncing
    assert "generate" not in cycle1
    assert cycle1.count("sleep") == 1  # its weights had woken: put back to sleep
    # and in every cycle, KV woke only after every rank's sync ended
    for cycle in (0, 2, 3):
        sync_end = max(
            e["t"] for r in ranks for e in r if e["cycle"] == cycle and e["event"] == "sync:end"
        )
        kv = min(
            e["t"]
            for r in ranks
            for e in r
            if e["cycle"] == cycle and e["event"] == "wake:kv_cache"
        )
        assert sync_end <= kv


@pytest.mark.parametrize("fail", ["0:2:wake_kv_cache", "1:0:generate"])
def test_a_failure_after_the_last_barrier_still_fails_every_rank(tmp_path: Path, fail: str) -> None:
    ranks = run_ranks(tmp_path, fail)
    failing, cycle = int(fail.split(":")[0]), int(fail.split(":")[1])
    for rank, events in enumerate(ranks):
        outcomes = _outcomes(events)
        assert len(outcomes) == CYCLES
        for c, outcome in enumerate(outcomes):
            if c != cycle:
                assert outcome == "ok", (rank, c, outcome)
            elif rank == failing:
                assert outcome.startswith("Boom"), outcome
            else:
                assert outcome.startswith(
                    f"HybridSwitchError: rank {rank}: the switch rank {failing}"
                )


@pytest.mark.parametrize("world", [2, 3])
def test_context_parallel_unpack_gathers_through_the_group(tmp_path: Path, world: int) -> None:
    """Each rank packs its chunks; unpack(group=) gathers them; gradients come back."""
    start_ranks("tests.gloo_packing", [str(tmp_path)], world)
    for rank in range(world):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert found == {"equal": True, "grad": True}, (rank, found)


@pytest.mark.parametrize("world", [2, 3])
def test_the_verl_pair_gathers_through_the_group_as_verls_own(tmp_path: Path, world: int) -> None:
    """Each rank is a cp rank; postprocess gathers over gloo; outputs and gradients = verl's."""
    from tests import verl_oracle, wheels

    found = wheels.find_wheel("verl")
    wheel = str(found) if found is not None else "-"
    if wheel == "-" and verl_oracle.required():
        pytest.fail(verl_oracle.missing_reason() + " (HYBRIDMEM_REQUIRE_VERL=1)")
    start_ranks("tests.gloo_packing_verl", [str(tmp_path), wheel], world)
    for rank in range(world):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["equal"] is True, (rank, result)
        if wheel != "-":
            assert result == {"equal": True, "verl": True, "verl_grad": True}, (rank, result)


def test_the_runner_hides_no_failure_before_the_ranks_are_done() -> None:
    with pytest.raises(pytest.fail.Exception, match="rank 1 exited 3 before every rank was done"):
        start_ranks("tests.gloo_abort", ["before"])


def test_an_abort_after_every_rank_is_done_needs_a_reason() -> None:
    start_ranks("tests.gloo_abort", ["after"])  # TEARDOWN says why it is not a failure
    with pytest.raises(pytest.fail.Exception, match="rank 1 exited -6 after every rank was done"):
        start_ranks("tests.gloo_abort", ["after"], teardown_abort=None)


def _planned(tmp_path: Path, case: str, world: int) -> list[dict[str, Any]]:
    start_ranks("tests.gloo_planned", [str(tmp_path), case], world)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("world", [2, 3])
def test_planned_ranks_agree_over_the_group_on_the_largest_deficit(
    tmp_path: Path, world: int
) -> None:
    """Rank 0 lacks nothing, the others their optimizer state: every rank moves it."""
    for rank, result in enumerate(_planned(tmp_path, "agree", world)):
        state = result["optimizer_bytes"]
        for cycle in result["cycles"]:
            assert cycle["outcome"] == "ok", (rank, cycle)
            assert cycle["plan"] == {"deficit": state, "moved": {"optimizer": state}}, rank
            assert cycle["groups"] == ["optimizer"], rank
        assert result["left"] == [], rank
        assert result["bitwise"] is True, rank


def test_one_planned_ranks_unmeetable_need_fails_every_rank_before_anything_moves(
    tmp_path: Path,
) -> None:
    world = 2
    for rank, result in enumerate(_planned(tmp_path, "unmeetable", world)):
        for cycle in result["cycles"]:
            assert cycle["groups"] is None, rank  # no rollout ran
            if rank == world - 1:
                assert cycle["outcome"].startswith("HybridSwitchError"), cycle
                assert "short" in cycle["outcome"], cycle
            else:
                assert cycle["outcome"].startswith(
                    f"HybridSwitchError: rank {rank}: the switch rank {world - 1} failed at "
                ), cycle
                assert "stage 'plan'" in cycle["outcome"], cycle
        assert result["left"] == [], rank  # nothing was offloaded, nothing left behind
        assert result["bitwise"] is True, rank
