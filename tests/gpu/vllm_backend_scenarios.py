"""GPU scenarios: hybridmem as vLLM 0.33's sleep-mode backend, on vLLM's own pool and factory.

Usage: ``HYBRIDMEM_VLLM_FILES=<wheel or folder> python -m tests.gpu.vllm_backend_scenarios
NAME``; the last line printed is a JSON object of facts. vLLM's files (its
``CuMemAllocator``, its C extension and its ``sleep_mode_backend.py``) are loaded by
:func:`hybridmem.integrations.vllm.sleep_files.load_sleep_backends`; hybridmem's plugin
registers its backend in vLLM's factory, and the backends are driven as vLLM 0.33's GPU
worker drives them (``suspend(level)`` in ``sleep``, ``resume(tags)`` in ``wake_up``,
``discard(tags)``).
"""

from __future__ import annotations

import json
import os
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

import hybridmem as hm
from hybridmem.integrations.vllm.plugin import register
from hybridmem.integrations.vllm.sleep_files import load_cumem, load_sleep_backends
from hybridmem.integrations.vllm.sleep_state import EngineAsleepError, refuse_while_asleep
from tests.gpu.vllm_sleep_scenarios import FILES_ENV, USER_ENV, _row

MiB, GiB = 1 << 20, 1 << 30


def _factory() -> Any:
    backends = load_sleep_backends(os.environ[FILES_ENV])
    register()
    return backends.SleepModeBackendFactory


def _free() -> int:
    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


class _Pool:
    """Memory of every tag vLLM 0.33's worker makes, filled with known bytes."""

    def __init__(self, weights_mib: int = 512, kv_mib: int = 1024) -> None:
        self.alloc = load_cumem(os.environ[FILES_ENV]).CuMemAllocator.get_instance()
        with self.alloc.use_memory_pool(tag="weights"):
            self.weights = [
                torch.full((64 * MiB,), i + 1, dtype=torch.uint8, device="cuda")
                for i in range(weights_mib // 64)
            ]
        with self.alloc.use_memory_pool(tag="kv_cache"):
            self.kv = torch.full((kv_mib * MiB,), 9, dtype=torch.uint8, device="cuda")
        with self.alloc.use_memory_pool(tag="runtime"):
            self.runtime = torch.full((16 * MiB,), 11, dtype=torch.uint8, device="cuda")
        with self.alloc.use_memory_pool(tag="cudagraph"):
            self.graph = torch.full((16 * MiB,), 12, dtype=torch.uint8, device="cuda")
        with self.alloc.use_memory_pool(tag="workspace"):
            self.workspace = torch.zeros(32 * MiB, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()

    def weights_intact(self) -> bool:
        return all(bool((w[:: 4 * MiB] == i + 1).all()) for i, w in enumerate(self.weights))

    def weights_awake(self) -> bool:
        """Whether every weight is mapped (reading one that sleeps is an illegal access)."""
        return not any(
            d.is_asleep for d in self.alloc.pointer_to_data.values() if d.tag == "weights"
        )

    def kept_intact(self) -> bool:
        return bool((self.runtime == 11).all()) and bool((self.graph == 12).all())

    def mapped(self) -> int:
        return sum(int(d.handle[1]) for d in self.alloc.pointer_to_data.values())


def factory() -> dict[str, Any]:
    """vLLM's factory resolves ``hybridmem`` after hybridmem's plugin ran; the flags it says."""
    torch.zeros(1, device="cuda")
    factory = _factory()
    cls = factory.get_backend_class("hybridmem")
    made = factory.create_backend(types.SimpleNamespace(sleep_mode_backend="hybridmem"))
    again = register()
    base = load_sleep_backends(os.environ[FILES_ENV]).SleepModeBackend

    return {
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "subclass": issubclass(cls, base),
        "made": type(made).__name__,
        "state": made.state(),
        "registered": sorted(factory._registry),
        "again": again,
        "supported": cls.is_supported(),
        "flags": {
            name: getattr(cls, name)()
            for name in (
                "preserves_communicators",
                "preserves_compiled_artifacts",
                "preserves_graphs_with_communicators",
                "supports_durable_storage",
            )
        },
        "cumem": factory.get_backend_class("cumem").__name__,
    }


def lifecycle() -> dict[str, Any]:
    """The worker's calls in order and out of order, failures inside, and 100 level-1 cycles."""
    torch.zeros(1, device="cuda")
    factory = _factory()
    from hybridmem.integrations.vllm.sleep_backend import reserve_sleep_backup

    pool = _Pool()
    ours = factory.create_backend(types.SimpleNamespace(sleep_mode_backend="hybridmem"))
    cumem = factory.create_backend(types.SimpleNamespace(sleep_mode_backend="cumem"))
    facts: dict[str, Any] = {"mapped": pool.mapped()}
    facts["reserved"] = reserve_sleep_backup(None, level=1)
    steps: list[dict[str, Any]] = []

    def step(label: str, call: Callable[[], Any]) -> None:
        before = _free()
        error = None
        try:
            call()
        except Exception as exc:  # recorded: the test asserts on it
            error = f"{type(exc).__name__}: {exc}"
        steps.append(
            {
                "at": label,
                "state": ours.state(),
                "freed": _free() - before,
                "weights": pool.weights_intact() if pool.weights_awake() else None,
                "error": error,
            }
        )

    def update_refused() -> bool:
        try:
            refuse_while_asleep("weights", "a weight update")
        except EngineAsleepError:
            return True
        return False

    step("suspend 1", lambda: ours.suspend(1))
    facts["update refused asleep"] = update_refused()
    step("resume weights", lambda: ours.resume(["weights"]))
    facts["kept after weights wake"] = pool.kept_intact()
    facts["update refused after weights wake"] = update_refused()
    step("resume kv_cache", lambda: ours.resume(["kv_cache"]))
    step("resume running", lambda: ours.resume(None))
    step("suspend 1", lambda: ours.suspend(1))
    step("suspend 1 again", lambda: ours.suspend(1))
    step("resume kv_cache first", lambda: ours.resume(["kv_cache"]))
    step("resume weights", lambda: ours.resume(["weights"]))
    step("discard kv_cache", lambda: ours.discard(("kv_cache",)))
    step("resume all", lambda: ours.resume(None))
    step("suspend 2", lambda: ours.suspend(2))
    facts["kept at level 2"] = None
    step("resume all", lambda: ours.resume(None))
    facts["kept at level 2"] = pool.kept_intact()
    for w in pool.weights:  # level 2 discarded them: the trainer's sync
        w.fill_(0)
    for i, w in enumerate(pool.weights):
        w.fill_(i + 1)
    # each backend's sleep, the other's wake
    step("suspend 1 (hybridmem)", lambda: ours.suspend(1))
    step("vLLM's own wake_up", lambda: pool.alloc.wake_up(None))
    step("suspend 1 (cumem)", lambda: cumem.suspend(1))
    step("resume (hybridmem) after cumem", lambda: ours.resume(None))
    # a mapping that fails part way, then the next wake
    step("suspend 1", lambda: ours.suspend(1))
    real_map, calls = ours.pool._map, [0]

    def failing(handle: Any) -> None:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("CUDA Error: injected at the third mapping")
        real_map(handle)

    ours.pool._map = failing
    step("resume with a failing mapping", lambda: ours.resume(None))
    ours.pool._map = real_map
    step("resume after the failure", lambda: ours.resume(None))
    facts["steps"] = steps
    # 100 cycles at level 1, as verl wakes
    host = []
    free_awake = []
    ok = True
    for cycle in range(100):
        ours.suspend(1)
        ours.resume(["weights"])
        ours.resume(["kv_cache"])
        if cycle % 10 == 0:
            ok = ok and pool.weights_intact() and pool.kept_intact()
        host.append(ours.pool.host_bytes)
        free_awake.append(_free())
    facts["cycles_intact"] = ok
    facts["host_first_last"] = [host[0], host[-1]]
    facts["free_samples"] = free_awake
    return facts


def composition() -> dict[str, Any]:
    """The backend beside vLLM's pool toggle, hybridmem's scopes and suspend_communicators."""
    assert os.environ.get("PYTORCH_CUDA_ALLOC_CONF") == USER_ENV, "run with the user's env"
    torch.zeros(1, device="cuda")
    factory = _factory()
    rows: list[dict[str, Any]] = []
    _row("start", rows)
    with hm.expandable_segments(True):
        pool = _Pool(weights_mib=128, kv_mib=256)  # vLLM turns them off inside its pool
        _row("pool made inside scope", rows)
        ours = factory.create_backend(types.SimpleNamespace(sleep_mode_backend="hybridmem"))
        ours.suspend(1)
        _row("asleep inside scope", rows)
        ours.resume(["weights"])
        ours.resume(["kv_cache"])
        _row("awake inside scope", rows)
    _row("scope left", rows)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29600 + os.getpid() % 1000))
    import torch.distributed as dist

    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    t = torch.ones(1024, device="cuda")
    dist.all_reduce(t)
    with hm.suspend_communicators() as held:
        ours.suspend(1)
        asleep = ours.state()
        ours.resume(None)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    dist.destroy_process_group()
    _row("end", rows)
    return {
        "rows": rows,
        "asleep_in_comm_scope": asleep,
        "comm_report": str(getattr(held, "report", held)),
        "allreduce": float(t[0]),
        "weights": pool.weights_intact(),
    }


#: vLLM's own NCCL wrapper and its communicator's suspend flag, in the files' folder.
PYNCCL_FILES = (
    "vllm/distributed/device_communicators/pynccl_wrapper.py",
    "vllm/distributed/device_communicators/pynccl.py",
)


def _vllm_nccl(library: str) -> tuple[Any, int]:
    """vLLM's ``pynccl_wrapper`` module over ``library``, and ``_NCCL_SUSPEND_MEM``.

    The wrapper is the wheel's file, loaded with the allocator's stand-ins and one more
    (``vllm.utils.nccl.find_nccl_library``: ``library``); the flag is read from the
    wheel's ``pynccl.py`` (``PyNcclCommunicator.suspend`` passes it), not imported:
    that module pulls in vLLM's process groups.
    """
    import ast
    import importlib
    from pathlib import Path

    root = Path(os.environ[FILES_ENV])
    nccl_utils = types.ModuleType("vllm.utils.nccl")
    nccl_utils.find_nccl_library = lambda: library  # type: ignore[attr-defined]
    sys.modules["vllm.utils.nccl"] = nccl_utils
    sys.modules["vllm.envs"].VLLM_USE_NCCL_SYMM_MEM = False  # type: ignore[attr-defined]
    platform = sys.modules["vllm.platforms"].current_platform
    platform.fp8_dtype = lambda: torch.float8_e4m3fn
    wrapper = importlib.import_module("vllm.distributed.device_communicators.pynccl_wrapper")
    flags = [
        ast.literal_eval(node.value)
        for node in ast.parse((root / PYNCCL_FILES[1]).read_text()).body
        if isinstance(node, ast.Assign)
        and any(getattr(t, "id", None) == "_NCCL_SUSPEND_MEM" for t in node.targets)
    ]
    assert len(flags) == 1, "vLLM's pynccl.py has no _NCCL_SUSPEND_MEM"
    return wrapper, int(flags[0])


def composition_nccl() -> dict[str, Any]:
    """vLLM's own communicator suspend beside the backend and hybridmem's, in one process.

    As a colocated run holds them: a trainer's torch process group, which hybridmem's
    ``suspend_communicators`` suspends through the rollout, and vLLM's own
    communicator (its wheel's ``pynccl_wrapper``: ``ncclCommInitRank``,
    ``ncclAllReduce``), which vLLM's GPU worker suspends after the backend's
    ``suspend(level)`` when ``enable_nccl_comm_suspend`` is set
    (``ncclCommSuspend(comm, _NCCL_SUSPEND_MEM)``, as ``PyNcclCommunicator.suspend``)
    and resumes after the backend's ``resume(tags)``. One NCCL (2.29.7+, preloaded)
    serves both, as in a real run.
    """
    library = os.environ["LD_PRELOAD"]
    torch.zeros(1, device="cuda")
    factory = _factory()
    wrapper, flag = _vllm_nccl(library)
    from hybridmem._platform.nccl import MemStat
    from hybridmem._torch.nccl import nccl_calls
    from hybridmem.scopes.communicators import held_communicators

    lib = wrapper.NCCLLibrary(library)
    calls = nccl_calls()
    assert calls is not None
    pool = _Pool(weights_mib=128, kv_mib=256)
    ours = factory.create_backend(types.SimpleNamespace(sleep_mode_backend="hybridmem"))
    vllm_comm = lib.ncclCommInitRank(1, lib.ncclGetUniqueId(), 0)
    data = torch.arange(1 << 20, dtype=torch.float32, device="cuda")

    def vllm_all_reduce() -> bool:
        out = torch.empty_like(data)
        lib.ncclAllReduce(
            wrapper.buffer_type(data.data_ptr()),
            wrapper.buffer_type(out.data_ptr()),
            data.numel(),
            wrapper.ncclDataTypeEnum.from_torch(data.dtype),
            wrapper.ncclRedOpTypeEnum.from_torch(torch.distributed.ReduceOp.SUM),
            vllm_comm,
            wrapper.cudaStream_t(torch.cuda.current_stream().cuda_stream),
        )
        torch.cuda.synchronize()
        return bool(torch.equal(out, data))  # one rank: the sum is the input

    def vllm_suspended() -> int:
        return calls.mem_stat(int(vllm_comm.value), MemStat.SUSPENDED)

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29700 + os.getpid() % 1000))
    import torch.distributed as dist

    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    trainer = torch.ones(1024, device="cuda")
    dist.all_reduce(trainer)
    facts: dict[str, Any] = {
        "nccl": lib.ncclGetVersion(),
        "has_suspend": lib.has_symbol("ncclCommSuspend"),
        "flag": flag,
        "vllm_suspendable": calls.mem_stat(int(vllm_comm.value), MemStat.SUSPENDABLE),
        "vllm_all_reduce_before": vllm_all_reduce(),
    }
    # the rollout: the trainer's group suspended by hybridmem, vLLM's in use
    before = _free()
    with hm.suspend_communicators() as held:
        facts["rollout_freed"] = _free() - before
        facts["held_in_rollout"] = held_communicators()
        facts["vllm_all_reduce_in_rollout"] = vllm_all_reduce()
        try:
            dist.all_reduce(trainer)
            facts["trainer_collective_in_rollout"] = "ran"
        except hm.CommunicatorSuspendedError as exc:
            facts["trainer_collective_in_rollout"] = f"refused: {type(exc).__name__}"
    facts["rollout_report"] = str(getattr(held, "report", held))
    # the training step: vLLM's worker.sleep(1) with enable_nccl_comm_suspend
    before = _free()
    ours.suspend(1)
    after_backend = _free()
    lib.ncclCommSuspend(vllm_comm, flag)
    facts["sleep_freed_backend"] = after_backend - before
    facts["sleep_freed_vllm_comm"] = _free() - after_backend
    facts["vllm_suspended_in_training"] = vllm_suspended()
    facts["state_in_training"] = ours.state()
    dist.all_reduce(trainer)  # the trainer's group, resumed by hybridmem's scope exit
    torch.cuda.synchronize()
    facts["trainer_all_reduce"] = float(trainer[0])
    # hybridmem's scope in the training step meets vLLM's suspended communicator
    with hm.suspend_communicators():
        facts["held_beside_vllms"] = held_communicators()
        facts["vllm_suspended_inside_scope"] = vllm_suspended()
    facts["vllm_suspended_after_scope"] = vllm_suspended()
    # vLLM's worker.wake_up(["weights"]), then wake_up(["kv_cache"]), as verl wakes
    ours.resume(["weights"])
    lib.ncclCommResume(vllm_comm)
    ours.resume(["kv_cache"])
    facts["vllm_suspended_after_wake"] = vllm_suspended()
    facts["vllm_all_reduce_after_wake"] = vllm_all_reduce()
    facts["state_after_wake"] = ours.state()
    facts["weights"] = pool.weights_intact()
    facts["kept"] = pool.kept_intact()
    lib.ncclCommDestroy(vllm_comm)
    dist.destroy_process_group()
    return facts


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    "factory": factory,
    "lifecycle": lifecycle,
    "composition": composition,
    "composition_nccl": composition_nccl,
}

if __name__ == "__main__":
    print(json.dumps(SCENARIOS[sys.argv[1]](), default=str))
