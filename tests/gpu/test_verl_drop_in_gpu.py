"""verl's drop-in on a real GPU: batches as views of the bucket, intact under slow engines."""

from __future__ import annotations

import pytest

from tests.gpu.runner import run_scenario

pytestmark = pytest.mark.gpu
MODULE = "tests.gpu.group_scenarios"


def test_the_engine_gets_views_and_keeps_every_sync_intact_after_a_failed_one() -> None:
    facts = run_scenario("verl_views", MODULE)
    rows = facts["rows"]
    for row in rows:
        print(f"\nverl_views: {row}")
    assert facts["engine_exit"] == 0
    good = [row for row in rows if not row["failed_here"]]
    (failed,) = [row for row in rows if row["failed_here"]]
    # The engine reads the bucket itself, as verl's receiver hands out its buffer; only
    # the tensor larger than the bucket comes as a copy (pieced together).
    assert all(row["zero_copy"] for row in good)
    assert all(row["copies"] == 1 and row["views"] == facts["tensors"] - 13 for row in good)
    # Every sync delivers verl's callbacks (more than one: the bucket is 32 MiB), one last.
    assert all(row["calls"] > 3 and row["lasts"] == 1 for row in good)
    assert len({row["calls"] for row in good}) == 1
    # Slow device work queued before each copy: the sender waits for it, every sync.
    assert all(row["intact"] for row in good), [row["bad"] for row in good]
    # The last sync's weights were written on the trainer's own stream behind slow work:
    # intact only if the copies waited for that stream (checked with the others above).
    assert rows[-1]["own_stream"]
    # The failed sync: both sides say so; the syncs after it are intact (above).
    assert "the engine's loader failed" in (failed["sender_error"] or "")
    assert "the engine's loader failed" in (failed["engine_error"] or "")
    assert failed["calls"] == 3
    assert rows.index(failed) < len(rows) - 2
