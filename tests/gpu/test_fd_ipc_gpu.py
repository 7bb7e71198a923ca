"""Expandable-segment tensors across processes by fd passing, consumer denied pidfd_getfd (H200).

Each test runs one scenario of :mod:`tests.gpu.fd_scenarios` in fresh ``spawn``
processes; every consumer has the seccomp filter that makes ``pidfd_getfd`` fail
with EPERM, and says so (``pidfd_getfd == "EPERM"``).
"""

from __future__ import annotations

import pytest

from tests.gpu.runner import run_alone, run_scenario
from tests.helpers import REPO

pytestmark = pytest.mark.gpu
MiB = 1 << 20
GiB = 1 << 30
MODULE = "tests.gpu.fd_scenarios"


def test_a_b_a_256_mib_expandable_tensor_is_the_same_memory_in_the_consumer() -> None:
    facts = run_scenario("basic", MODULE)
    consumer = facts["consumer"]
    print(f"\nbasic: {facts}")
    assert facts["legacy_ipc"] is False  # really in an expandable segment
    assert consumer["pidfd_getfd"] == "EPERM"  # really restricted
    assert consumer["kind"] == "fd"
    assert consumer["pages"] >= 13  # 256 MiB over 20 MiB pages
    # (a) equal bytes, and no copy: neither side's device memory grew by the tensor
    assert consumer["checksum"] == facts["checksum"]
    assert consumer["shape"] == [64 * MiB]
    assert facts["allocated_growth"] == 0
    assert consumer["used_growth"] < 64 * MiB  # mapping shares the producer's pages
    # (b) the consumer's write is the producer's memory
    assert facts["producer_sees_write"]
    assert facts["rest_untouched"]
    # lifetimes: leased while open, released when the consumer dropped it
    assert facts["leases_open"] == 1
    assert facts["leases_after_drop"] == 0
    assert facts["consumer_after"]["open_handles_after"] == 0
    assert facts["consumer_after"]["fds_after"] <= consumer["fds_while_open"] - 1
    # nothing listens once the export was opened
    assert facts["listening_before_open"] == 1
    assert facts["listening_after_open"] == 0
    assert facts["repr_hides_token"]
    assert facts["consumer_exit"] == 0


def test_c_200_cycles_leak_no_memory_and_no_fds() -> None:
    facts = run_scenario("cycles", MODULE)
    consumer = facts["consumer"]
    print(
        f"\ncycles: {facts['cycles']} x 64 MiB; open first {consumer['opens_first_s'] * 1e3:.2f} "
        f"ms, median {consumer['opens_median_s'] * 1e3:.2f} ms; export median "
        f"{facts['export_median_s'] * 1e3:.2f} ms; fds producer {facts['fds_10']}->"
        f"{facts['fds_last']}, consumer {consumer['fds_10']}->{consumer['fds_last']}; "
        f"consumer used {consumer['used_10'] / MiB:.0f}->{consumer['used_last'] / MiB:.0f} MiB"
    )
    assert consumer["pidfd_getfd"] == "EPERM"
    assert facts["cycles"] == 200
    assert consumer["bad"] == 0
    assert facts["fds_last"] == facts["fds_10"]
    assert consumer["fds_last"] == consumer["fds_10"]
    assert facts["allocated_last"] == facts["allocated_10"]
    assert facts["reserved_last"] == facts["reserved_10"]
    assert consumer["used_last"] - consumer["used_10"] <= 2 * MiB
    assert consumer["open_handles"] == 0
    assert consumer["live_external"] == 0
    assert facts["stats"] == {"pending": 0, "leases": 0, "listening": False, "leased_bytes": 0}
    assert facts["listening"] == 0
    assert facts["consumer_exit"] == 0


def test_d_a_torch_multiprocessing_queue_under_ipc_fd_sharing() -> None:
    facts = run_scenario("queue", MODULE)
    consumer = facts["consumer"]
    print(f"\nqueue: {facts}")
    assert consumer["pidfd_getfd"] == "EPERM"
    assert facts["legacy"] == {"flat": False, "view": False, "param": False, "classic": True}
    got = consumer["got"]
    assert not [k for k in got if k.startswith("error_")]
    for name, checksum in facts["sent"].items():
        assert got[name]["checksum"] == list(checksum), name
    assert got["view"]["shape"] == [4096, 16]
    assert got["view"]["dtype"] == "torch.bfloat16"
    assert got["param"]["type"] == "Parameter"
    assert got["param"]["requires_grad"] is True
    assert facts["leases_after"] == 0
    assert facts["consumer_exit"] == 0
    # The control: outside the scope torch's reducer is back, and the restricted
    # consumer cannot import the same tensor.
    outside = facts["outside_scope"]["got"]
    errors = [v for k, v in outside.items() if k.startswith("error_")]
    assert len(errors) == 1
    assert "pidfd_getfd" in errors[0]


def test_e_an_expandable_weight_bucket_syncs_1_gib_to_a_restricted_consumer() -> None:
    facts = run_scenario("bucket", MODULE)
    print(
        f"\nbucket: {facts['model_bytes'] / MiB:.0f} MiB over {facts['transport']}, "
        f"GB/s per sync {facts['gbps']}"
    )
    assert facts["transport"] == "fd"
    assert facts["buffers_legacy_ipc"] == [False, False]  # buffers in expandable segments
    assert facts["consumer"]["pidfd_getfd"] == "EPERM"
    assert facts["model_bytes"] >= GiB - 64 * MiB
    assert facts["equal"]
    used = [v for k, v in sorted(facts["consumer"].items()) if k.startswith("used_after_")]
    assert max(used) - min(used) <= 64 * MiB  # flat across syncs
    assert facts["leases_after"] == 0  # closing both sides let go of the buffers
    assert facts["consumer_exit"] == 0


def test_f_strangers_get_no_fd_and_are_logged() -> None:
    facts = run_scenario("strangers", MODULE)
    print(f"\nstrangers: {facts}")
    for name in ("no_token", "wrong_token", "wrong_pid"):
        assert facts[name].get("fds", 0) == 0, name
        assert facts[name].get("data", "") == "", name
    if facts["is_root"]:
        assert facts["other_uid"].get("fds", 0) == 0
        assert any("only this user" in w for w in facts["warnings"])
    assert sum("no valid token" in w for w in facts["warnings"]) == 2
    assert any("is for pid 1 only" in w for w in facts["warnings"])
    assert facts["still_pending"] == 1  # strangers did not use up the export
    assert facts["withdrawn"]
    assert facts["consumer"] == {"value": 3, "numel": 8 * MiB}
    assert "already opened" in facts["second_open"]
    assert facts["listening_after"] == 0


def test_the_example_runs_on_the_gpu() -> None:
    result = run_alone(str(REPO / "examples" / "expandable_sharing.py"))
    print(result.stdout)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rollout read ('handle', 1048576.0)" in result.stdout
    assert "trainer sees the rollout's write: 42.0" in result.stdout
    assert "rollout read ('bias', 1024.0)" in result.stdout
    assert "over fd" in result.stdout
    assert "rollout got ('bucket', ['bias', 'weight'])" in result.stdout
