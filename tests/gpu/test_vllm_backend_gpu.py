"""hybridmem as vLLM 0.33's sleep-mode backend, on vLLM's own pool and factory (the GPU at hand).

Each scenario runs in a fresh interpreter (:mod:`tests.gpu.vllm_backend_scenarios`) with
vLLM 0.33's files: its ``CuMemAllocator`` and C extension, its ``sleep_mode_backend.py``
(the factory and the ``cumem`` backend), hybridmem's plugin registering ``hybridmem``.
The timings beside the ``cumem`` backend are ``benchmarks/vllm_level1.py`` and
``hybridmem bench --engine vllm --sleep-backend hybridmem`` (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.runner import run_scenario, window_drift
from tests.gpu.vllm_backend_scenarios import PYNCCL_FILES
from tests.gpu.vllm_sleep_scenarios import FILES_ENV, USER_ENV

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not os.environ.get(FILES_ENV),
        reason=f"needs vLLM 0.33's files: {FILES_ENV}=<vllm wheel or folder> "
        "(pip download --no-deps vllm==0.33.0; docs/backends/vllm.md says how)",
    ),
]
MODULE = "tests.gpu.vllm_backend_scenarios"
MiB = 1 << 20


def _run(name: str, **env: str) -> dict[str, Any]:
    facts = run_scenario(name, MODULE, HYBRIDMEM_VLLM_FILES=os.environ[FILES_ENV], **env)
    print("\n" + json.dumps(facts, indent=1))
    return facts


def test_vllms_factory_resolves_hybridmem_after_the_plugin_ran() -> None:
    facts = _run("factory")
    assert facts["class"] == ("hybridmem.integrations.vllm.sleep_backend.HybridmemSleepModeBackend")
    assert facts["subclass"] is True
    assert facts["made"] == "HybridmemSleepModeBackend"
    assert facts["state"] == "RUNNING"
    assert facts["registered"] == ["cumem", "hybridmem"]
    assert facts["again"] is False  # a second registration is a no-op
    assert facts["supported"] is True
    assert facts["flags"] == {
        "preserves_communicators": True,
        "preserves_compiled_artifacts": True,
        "preserves_graphs_with_communicators": True,
        "supports_durable_storage": False,
    }
    assert facts["cumem"] == "CuMemBackend"


def test_the_workers_calls_in_and_out_of_order_and_failures_leave_an_exact_state() -> None:
    facts = _run("lifecycle")
    steps = facts["steps"]
    assert isinstance(steps, list)
    at: dict[str, list[dict[str, Any]]] = {}
    for row in steps:
        at.setdefault(row["at"], []).append(row)
    first = at["suspend 1"][0]
    # the whole pool goes back to the device
    assert first["state"] == "SUSPENDED"
    assert first["error"] is None
    assert first["freed"] >= 0.99 * float(facts["mapped"])
    # weights, runtime and cudagraph kept (pinned at load), bit-exact after the wake
    assert facts["reserved"] == 512 * MiB + 2 * 16 * MiB
    assert facts["update refused asleep"] is True
    assert at["resume weights"][0]["weights"] is True
    assert at["resume weights"][0]["state"] == "SUSPENDED"  # the KV cache still sleeps
    assert facts["kept after weights wake"] is True
    assert facts["update refused after weights wake"] is False
    assert at["resume kv_cache"][0]["state"] == "RUNNING"
    assert at["resume running"][0] == {**at["resume running"][0], "state": "RUNNING", "error": None}
    assert at["suspend 1 again"][0]["freed"] < 2 * MiB
    assert at["suspend 1 again"][0]["error"] is None
    assert at["resume kv_cache first"][0]["state"] == "SUSPENDED"
    assert at["resume weights"][1]["state"] == "RUNNING"
    assert at["resume weights"][1]["weights"] is True
    assert at["discard kv_cache"][0]["state"] == "SUSPENDED"
    assert at["discard kv_cache"][0]["freed"] >= 1000 * MiB
    assert facts["kept at level 2"] is True  # runtime and cudagraph kept at level 2 too
    # hybridmem's sleep, vLLM's wake; vLLM's sleep, hybridmem's wake
    assert at["vLLM's own wake_up"][0]["weights"] is True
    assert at["resume (hybridmem) after cumem"][0]["weights"] is True
    failed = at["resume with a failing mapping"][0]
    assert failed["error"].startswith("SleepPoolError: the wake failed")
    assert "injected at the third mapping" in failed["error"]
    assert "kept in host memory" in failed["error"]
    assert failed["state"] == "SUSPENDED"
    after = at["resume after the failure"][0]
    assert after["error"] is None
    assert after["state"] == "RUNNING"
    assert after["weights"] is True
    # 100 cycles: bytes back, host memory flat, no drift of device memory
    assert facts["cycles_intact"] is True
    host = facts["host_first_last"]
    assert isinstance(host, list)
    assert host[0] == host[1]
    drift = window_drift([{"free": f} for f in facts["free_samples"]])["free"]
    assert abs(drift) <= 2 * MiB, drift


def test_the_backend_composes_with_vllms_toggle_hybridmems_scopes_and_communicators() -> None:
    facts = _run("composition", PYTORCH_CUDA_ALLOC_CONF=USER_ENV)
    rows = {row["at"]: row for row in facts["rows"]}
    assert all(row["agree"] for row in rows.values()), rows
    # hybridmem's scope in force around the backend's sleep and wake (it writes no setting)
    for at in ("asleep inside scope", "awake inside scope"):
        assert rows[at]["torch"]["expandable_segments"] is True, rows[at]
    # the user's settings at the end, the other ones throughout
    assert rows["end"]["torch"]["expandable_segments"] is True
    assert all(row["torch"]["garbage_collection_threshold"] == 0.6 for row in rows.values())
    assert facts["asleep_in_comm_scope"] == "SUSPENDED"
    assert facts["allreduce"] == 1.0
    assert facts["weights"] is True


LIBRARY_ENV = "HM_NCCL_LIBRARY"  # not HYBRIDMEM_*: clean_env keeps it for the child


@pytest.mark.skipif(
    not os.environ.get(LIBRARY_ENV),
    reason=f"needs an NCCL with ncclCommSuspend (2.29.7+): {LIBRARY_ENV}=<libnccl.so.2> "
    "(benchmarks/build_nccl.sh builds one from NVIDIA/nccl's source)",
)
def test_vllms_own_communicator_suspend_composes_with_the_backend_and_hybridmems() -> None:
    missing = [name for name in PYNCCL_FILES if not (Path(os.environ[FILES_ENV]) / name).is_file()]
    if missing:
        pytest.skip(
            f"{FILES_ENV} has no {missing[0]}: unzip -o vllm-0.33.0-*.whl "
            "'vllm/distributed/device_communicators/pynccl*.py' -d <that folder>"
        )
    facts = _run("composition_nccl", LD_PRELOAD=os.environ[LIBRARY_ENV])
    assert facts["has_suspend"] is True
    assert facts["vllm_suspendable"] > 0
    # the rollout: the trainer's group suspended, vLLM's communicator untouched and working
    assert facts["rollout_freed"] > 0
    assert facts["vllm_all_reduce_before"] is True
    assert facts["vllm_all_reduce_in_rollout"] is True
    assert facts["trainer_collective_in_rollout"] == "refused: CommunicatorSuspendedError"
    # the training step: the backend's sleep, then vLLM's own suspend, each giving back its own
    assert facts["sleep_freed_backend"] >= 0.99 * (128 + 256 + 32 + 32) * MiB
    assert facts["sleep_freed_vllm_comm"] >= 0.95 * facts["vllm_suspendable"]
    assert facts["vllm_suspended_in_training"] == 1
    assert facts["state_in_training"] == "SUSPENDED"
    assert facts["trainer_all_reduce"] == 1.0
    # hybridmem's scope leaves vLLM's suspended communicator to vLLM
    assert facts["vllm_suspended_inside_scope"] == 1
    assert facts["vllm_suspended_after_scope"] == 1
    # the wake: vLLM's resume after the backend's, bit-exact collectives and weights
    assert facts["vllm_suspended_after_wake"] == 0
    assert facts["vllm_all_reduce_after_wake"] is True
    assert facts["state_after_wake"] == "RUNNING"
    assert facts["weights"] is True
    assert facts["kept"] is True
