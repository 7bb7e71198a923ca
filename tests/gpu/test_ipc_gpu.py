"""CUDA IPC on a real GPU, consumer denied pidfd_getfd (run on the H200)."""

from __future__ import annotations

import pytest

from tests.gpu.runner import run_alone, run_scenario
from tests.helpers import REPO

pytestmark = pytest.mark.gpu
MiB = 1 << 20
MODULE = "tests.gpu.ipc_scenarios"


def test_a_plain_sharing_fails_and_b_safe_sharing_works() -> None:
    facts = run_scenario("sharing", MODULE)
    consumer = facts["consumer"]
    print(f"\nsharing: {facts}")
    # (a) the scenario is real: the restricted consumer cannot import the tensor
    assert facts["weight_legacy_ipc"] is False
    errors = [v for k, v in consumer.items() if k.startswith("error_")]
    assert len(errors) == 1
    assert "pidfd_getfd" in errors[0]
    assert "Operation not permitted" in errors[0]
    assert "plain" not in consumer
    # (b) through ipc_shareable and from inside ipc_safe: intact
    assert facts["shareable_is_copy"]
    assert facts["shareable_legacy_ipc"] is True
    assert consumer["shareable"] == facts["checksum"]
    assert facts["transport"] == "cuda"
    assert facts["staged_legacy_ipc"] is True
    assert consumer["ipc_safe"] == facts["checksum"]
    assert facts["classic_returned_itself"]
    assert facts["expandable_after"] is True  # the scopes restored the trainer's mode
    # (d) in the same restricted consumer
    caps = consumer["capabilities"]
    assert caps["classic_ipc"] is True
    assert caps["expandable_ipc"] is False
    assert (caps["pidfd_getfd"], caps["denied_by"]) == ("denied", "seccomp")
    assert "seccomp" in caps["reason"]
    assert caps["fd_passing"] is True  # but fd passing gets the tensor there
    assert "hm.ipc_export" in caps["advice"]
    assert facts["consumer_exit"] == 0


def test_c_bucket_syncs_keep_memory_flat_and_data_intact() -> None:
    facts = run_scenario("bucket_syncs", MODULE)
    print(
        f"\nbucket_syncs: {facts['syncs']} syncs of {facts['model_bytes'] / MiB:.0f} MiB "
        f"({facts['tensors']} tensors), drift {facts['drift_bytes'] / MiB:.1f} MiB, "
        f"checked {facts['checked']}, bad {facts['bad']}, median {facts['median_gbps']:.1f} GB/s"
    )
    assert facts["syncs"] == 200
    assert facts["transport"] == "cuda"
    assert facts["device_handoff"]  # hand-offs through interprocess events
    assert abs(facts["free_first"] - facts["free_last"]) <= 64 * MiB
    assert facts["free_first"] - facts["free_min"] <= 64 * MiB
    assert facts["bad"] == 0
    assert facts["checked"] >= 12
    assert facts["consumer_exit"] == 0


def test_d_capabilities_report_the_denial() -> None:
    facts = run_scenario("capabilities", MODULE)
    print(f"\ncapabilities: {facts}")
    restricted = facts["restricted"]
    assert restricted["cuda"] is True
    assert restricted["classic_ipc"] is True
    assert restricted["expandable_ipc"] is False
    assert restricted["pidfd_getfd"] == "denied"
    assert restricted["denied_by"] == "seccomp"
    assert "pidfd_getfd fails with EPERM" in restricted["reason"]
    unrestricted = facts["unrestricted"]
    assert unrestricted["classic_ipc"] is True
    assert unrestricted["expandable_ipc"] is True  # root with CAP_SYS_PTRACE, no filter
    assert unrestricted["expandable_handle"] in ("posix_fd", "fabric", "posix_fd+fabric")
    assert facts["cuda_initialized_here"] is False  # the probe ran in children


def test_host_fallback_round_trip() -> None:
    facts = run_scenario("host_fallback", MODULE)
    print(f"\nhost_fallback: {facts}")
    assert facts["transport"] == "host"
    assert facts["bad"] == 0
    assert facts["exit"] == 0


@pytest.mark.multi_gpu
def test_receiver_finds_the_gpu_by_uuid_not_index() -> None:
    facts = run_scenario("uuid_mapping", MODULE)
    print(f"\nuuid_mapping: {facts}")
    assert facts["bucket_device"] == "cuda:1"
    assert facts["consumer_device"] == 0  # the same GPU, under another index
    assert facts["bad"] == 0
    assert facts["context_on_0"] is False
    assert facts["exit"] == 0


def test_bucket_faults_never_hang_and_odd_offsets_ship() -> None:
    """Issue #11: a consumer dying mid-sync (its pipe end still open here) fails the send
    quickly; the bucket carries on; bf16 views at odd offsets arrive exactly."""
    facts = run_scenario("bucket_faults", MODULE)
    print(f"\nbucket faults: {facts}")
    assert facts["transport"] == "cuda"
    assert "died" in facts["dying"]
    assert facts["dying_exit"] == 3
    assert facts["next_sync_intact"]
    assert facts["next_exit"] == 0


def test_the_weight_sync_example_runs_on_the_gpu() -> None:
    """examples/trainer_to_rollout.py as the README shows it: three syncs, same weights,
    and its waits on the rollout process bounded (tests/test_bounded_waits.py)."""
    result = run_alone(str(REPO / "examples" / "trainer_to_rollout.py"))
    print(result.stdout)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("same weights: True") == 3
    assert "same weights: False" not in result.stdout
