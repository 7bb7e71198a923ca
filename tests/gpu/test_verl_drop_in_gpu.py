"""verl's drop-in on a real GPU: batches as views of the bucket, intact under slow engines."""

from __future__ import annotations

import pytest

from tests import wheels
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


def test_after_default_syncs_the_drop_in_holds_what_verls_own_pair_holds() -> None:
    # verl's pair frees its buffer and empties the cache on both sides after every sync;
    # by default the drop-in leaves the same: read after ten syncs of each, in both
    # processes and on the device, within one 2 MiB page. The kept bucket (the opt-in)
    # holds its buffers on the trainer, which the same readings see.
    found = wheels.find_wheel("verl")
    if found is None:
        pytest.skip(wheels.missing_reason("verl"))
    facts = run_scenario(
        "verl_holds", "tests.gpu.verl_memory_scenarios", HYBRIDMEM_VERL_WHEEL=str(found)
    )
    for row in facts["rows"]:
        print(f"\nverl_holds: {row}")
    assert facts["engine_exit"] == 0
    verls = [row for row in facts["rows"] if row["kind"] == "verl"]
    (drop_in,) = [row for row in facts["rows"] if row["kind"] == "drop-in"]
    (kept_row,) = [row for row in facts["rows"] if row["kind"] == "drop-in-kept"]
    after = verls[-1]  # verl's pair in the device state the drop-in left
    page = 2 << 20
    for key in ("trainer_reserved", "engine_reserved"):  # each process's own, every round
        for verl in verls:
            assert abs(drop_in[key] - verl[key]) <= page, (key, drop_in, verl)
    # The device: what verl's pair leaves right after the drop-in, and never less free
    # than verl's pair left in any round (the drop-in holds no more than verl's pair).
    assert abs(drop_in["device_free"] - after["device_free"]) <= page, (drop_in, after)
    for verl in verls:
        assert drop_in["device_free"] >= verl["device_free"] - page, (drop_in, verl)
    kept = facts["kept_buffers"] * facts["bucket_bytes"]
    assert kept_row["trainer_reserved"] - after["trainer_reserved"] >= kept
    assert after["device_free"] - kept_row["device_free"] >= kept
