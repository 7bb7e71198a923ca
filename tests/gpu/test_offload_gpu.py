"""Offload on a real GPU (run on the H200: ``pytest -m gpu tests/gpu``)."""

from __future__ import annotations

import pytest

from tests.gpu.runner import run_scenario

pytestmark = pytest.mark.gpu
MiB = 1 << 20


def test_cycles_are_bitwise_exact_and_free_the_device() -> None:
    facts = run_scenario("offload_cycles")
    print(
        f"\\noffload_cycles: state {facts['state_bytes'] / MiB:.0f} MiB, pool "
        f"{facts['host_bytes'] / MiB:.0f} MiB, after offload {facts['after_offload'][-1]}, "
        f"live elsewhere {facts['live_elsewhere'] / MiB:.1f} MiB, offload GB/s "
        f"{max(facts['offload_gbps']):.1f}, reload GB/s {max(facts['reload_gbps']):.1f}"
    )
    assert facts["bitwise_equal"]
    assert facts["same_parameters"]
    assert facts["pool_pinned"]
    assert facts["device"] == "cuda:0"
    assert facts["host_bytes"] <= 1.05 * facts["state_bytes"]
    for memory in facts["after_offload"]:
        # within 64 MiB of what stays live elsewhere, allocated and reserved alike
        assert memory["allocated"] - facts["live_elsewhere"] <= 64 * MiB
        assert memory["reserved"] - facts["live_elsewhere"] <= 64 * MiB
    assert facts["non_blocking_equal"]


def test_training_with_offload_between_steps_matches() -> None:
    facts = run_scenario("offload_training")
    print(f"\\nlosses plain {facts['plain'][-1]!r} offloaded {facts['offloaded'][-1]!r}")
    assert facts["offloaded"] == facts["plain"]  # every step's loss, bit for bit


def test_fsdp2_local_shards() -> None:
    facts = run_scenario("offload_fsdp2")
    assert facts["kinds"] == ["DTensor"]
    assert facts["freed"]
    assert facts["equal"]
    assert facts["bytes"] > 0


def test_faults_lose_nothing_on_the_gpu() -> None:
    """Issue #11: refused before anything is freed; a reload out of memory is retryable."""
    facts = run_scenario("offload_faults")
    print(f"\noffload faults: {facts}")
    assert "its memory is not this process's to free" in facts["unfreeable"]
    assert facts["unfreeable_intact"]
    assert facts["forward_after_refusal"]
    assert "nothing was reloaded" in facts["reload_oom"]
    assert facts["reload_oom_cause"] == "OutOfMemoryError"
    assert facts["still_offloaded"] == ["gradients", "optimizer", "parameters"]  # no buffers
    assert facts["retry_equal"]
    assert facts["sparse_freed"]
    assert facts["sparse_equal"]


def test_compact_returns_the_cache_resident_weights_keep() -> None:
    """Issue #12: the trainer's cache kept by weights in classic segments goes."""
    facts = run_scenario("compact")
    print(
        f"\ncompact: {facts['report']}; cache after release {facts['cached_before'] / MiB:.1f} "
        f"-> {facts['cached_after'] / MiB:.1f} MiB; segments {facts['kinds_before']} -> "
        f"{facts['kinds_after']}"
    )
    assert facts["cached_before"] > 64 * MiB  # the problem is real here
    # what is left: the free end of the last page of each expandable segment
    assert facts["cached_after"] <= 48 * MiB
    assert facts["cached_after"] < facts["cached_before"] / 2
    # every weight over 1 MiB now in an expandable segment; the small ones (LayerNorm)
    # may come back into a 2 MiB small-pool segment that the input still holds
    assert facts["kinds_before"] == ["False"]
    assert facts["kinds_after"] == ["True"]
    assert facts["moved"] + facts["stuck"] == facts["param_count"]
    assert facts["moved"] >= facts["large_count"]
    assert facts["same_parameters"]
    assert facts["bits_equal"]
    assert facts["forward_equal"]
    assert facts["again_moved"] == 0
    assert facts["stepped"]


def test_side_streams_cost_no_stream_pool() -> None:
    """Issue #25: torch's stream pool grew the context by 70 MiB; a driver stream does not."""
    facts = run_scenario("side_streams")
    print(
        f"\nside streams: Offloader + 3 streams grew the context "
        f"{facts['ours'] / MiB:.1f} MiB; torch's pool then {facts['pool'] / MiB:.1f} MiB"
    )
    assert facts["kinds"] == ["ExternalStream"]
    assert facts["reused"]  # and the process exited cleanly (run_scenario checks)
    assert facts["equal"]
    assert facts["copied"]
    assert facts["ours"] <= 8 * MiB
    assert facts["pool"] >= 4 * max(facts["ours"], 2 * MiB)  # what was avoided


def test_a_reload_by_kernel_is_exact_and_reads_the_pools_mapping() -> None:
    """Decision 80: kernels read the pinned pool through its device mapping."""
    facts = run_scenario("offload_by_kernel", "tests.gpu.kernel_scenarios")
    print(f"\noffload_by_kernel: {facts}")
    assert facts["has_view"]  # the pool is pinned and mapped: kernels did the reloads
    assert facts["view_is_the_pool"]  # the mapping reads the pool's bytes
    assert facts["exact"] == [True] * 6  # by kernel and by copy engine, before and after a peer
    assert facts["non_blocking_exact"]
    assert facts["head_then_tail_exact"] == [True, True]  # the switch's early reload
    assert facts["peer_exit"] == 0


def test_a_growing_partial_offload_pins_chunks_and_reloads_across_them() -> None:
    """A larger part adds a pinned, mapped chunk; reloads by kernel read every chunk."""
    facts = run_scenario("growing_pool", "tests.gpu.kernel_scenarios")
    print(f"\ngrowing_pool: {facts}")
    assert facts["chunks"] == [1, 2, 3, 3]  # a chunk per larger part; none when it fits
    first, second, whole, again = facts["host_bytes"]
    assert first < second < whole == again
    assert facts["exact"] == [True] * 4
    assert facts["all_pinned"]
    assert facts["all_mapped"]


def test_a_reload_feed_stops_early_and_keeps_every_bit() -> None:
    """Decision 94: fed a chunk at a time; stopped, or finished by kernel after a free."""
    facts = run_scenario("reload_feed", "tests.gpu.kernel_scenarios")
    print(f"\nreload_feed: {facts}")
    assert facts["stopped_exact"]
    assert facts["stopped_left"]  # stopped at once: the rest stayed offloaded
    assert facts["stopped_fed"] < facts["total"]
    assert facts["through_free_all"]
    assert facts["through_free_exact"]
    assert facts["fed_exact"]
    # Paced two chunks ahead, the copy engines still run at about a plain reload's rate.
    assert facts["fed_s"] <= 1.5 * facts["plain_s"]
    assert facts["peer_exit"] == 0


def test_an_offload_releases_as_its_copies_land() -> None:
    """Decision 83: each 512 MiB is freed and released while the later copies run."""
    facts = run_scenario("offload_lands_by_chunks", "tests.gpu.landing_scenarios")
    print(f"\noffload_lands_by_chunks: {facts}")
    chunks = -(-facts["state"] // facts["chunk"])
    for label in ("planned", "streamed"):
        assert facts[f"{label}_exact"]
        assert facts[f"{label}_releases"] == chunks  # one release per landing
        # everything offloaded went back to the driver (within one 20 MiB block)
        assert facts[f"{label}_returned"] >= facts["state"] - 20 * MiB
        assert facts[f"{label}_reserved_drop"] >= facts["state"] - 20 * MiB
    assert "freed in earlier chunks were reloaded" in facts["fault"]
    assert facts["fault_offloaded"] == []
    assert facts["fault_exact"]
    assert facts["after_fault_exact"]
    assert facts["final_exact"]
    # decision 90: timed on the device, the copies alone, not the work beside them
    assert 0 < facts["beside_copy_seconds"] < facts["beside_seconds"]
    assert facts["beside_seconds"] >= facts["beside_s"]
    assert facts["beside_copy_gbps"] > facts["beside_gbps"]
