"""The ways of switching the bench compares, on the same trainer and engine.

- ``naive``: torch defaults; ``.to("cpu")`` offload of the optimizer state; one
  ``empty_cache``; weights shared tensor by tensor over CUDA IPC.
- ``handrolled``: what RL frameworks write: an expandable-segments toggle through
  torch's raw setter (which drops the user's other settings), a 3-round
  ``gc.collect()`` + ``empty_cache`` loop around each step, ``non_blocking`` ``.to``
  offload, a fresh exported buffer for every weight-sync batch.
- ``tms``: what slime and AReaL do: the optimizer state lives in a torch_memory_saver
  region with CPU backup (``enable_cpu_backup=True``, TMS's ``pinned`` backend;
  the trainer runs with TMS's ``LD_PRELOAD``), ``pause`` before rollout and
  ``resume`` after; one ``gc.collect`` + ``empty_cache``; weights shared tensor by
  tensor over CUDA IPC. Runs only where torch_memory_saver is installed.
- ``hybridmem``: :func:`~hybridmem.compact` of model and optimizer once,
  ``phase("train", backend="sglang")``, an
  :class:`~hybridmem.Offloader`, a :class:`~hybridmem.WeightBucket` and a
  :class:`~hybridmem.HybridSwitch` with the ``sglang`` backend.
- ``planned`` (``--need`` runs): ``hybridmem`` with the switch told what the rollout
  needs (``rollout_need``): it offloads only what is short.
- ``fraction`` (``--need`` runs): ``hybridmem`` offloading a fixed half of the
  optimizer state whatever is short, as NeMo-RL's fractional optimizer offload does.
- ``suspended`` (``--communicators`` runs): ``hybridmem`` with the trainer's NCCL
  communicators suspended through the rollout (:func:`hybridmem.suspend_communicators`,
  entered before the switch to the rollout, left after the switch back); ``hybridmem``
  holds them.

Every strategy drives the engine through :class:`hybridmem.SGLangEngine`: the bench's
engine speaks SGLang's memory API and keeps its memory as SGLang does (see
:mod:`hybridmem.bench.engine_memory`).
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridmem import _torch
from hybridmem.bench.engine import EngineClient
from hybridmem.bench.engine_memory import memory_saver
from hybridmem.bench.plan import FIXED_FRACTION, BenchPlan
from hybridmem.engine.reports import SwitchReport
from hybridmem.engine.switch import HybridSwitch
from hybridmem.engine.switch_offload import RolloutNeed
from hybridmem.ipc._plan import plan_batches
from hybridmem.ipc.bucket import WeightBucket
from hybridmem.memory.compact import compact
from hybridmem.memory.offload import Offloader
from hybridmem.scopes.communicators import SuspendCommunicators
from hybridmem.scopes.engines import EngineAdapter, SGLangEngine
from hybridmem.scopes.phases import phase
from hybridmem.scopes.release import release_seconds

__all__ = ["TMS_TAG", "Moved", "Strategy", "fixed_share", "make_strategy", "strategy_classes"]


@dataclass
class Moved:
    """What one direction of a switch did: its offload/reload, weight-sync and release time."""

    copy_s: float = 0.0
    copy_bytes: int = 0
    sync_s: float = 0.0
    #: seconds the switch spent releasing the trainer's cache (every
    #: :func:`~hybridmem.scopes.release.release_cache` of this direction; 0 where a
    #: strategy does not say): the need target allows them beside the copies.
    release_s: float = 0.0
    #: seconds of each stage of the switch, by stage name, in its order (empty where
    #: the strategy is not a :class:`~hybridmem.HybridSwitch`): where its time went.
    stages: dict[str, float] = field(default_factory=dict)


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterator[tuple[dict[str, Any], str]]:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.numel() > 1:
                yield state, key


class Strategy:
    """The trainer's side of one way of switching."""

    name = ""

    def __init__(
        self,
        plan: BenchPlan,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        engine: EngineClient,
    ) -> None:
        self.plan = plan
        self.model = model
        self.optimizer = optimizer
        self.engine = engine
        self.adapter = SGLangEngine(engine)  # the engine speaks SGLang's memory API

    @staticmethod
    def state_scope() -> contextlib.AbstractContextManager[Any]:
        """Where the optimizer's state is first allocated (the warm-up's first step)."""
        return contextlib.nullcontext()

    def train_scope(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def to_rollout(self) -> Moved:
        raise NotImplementedError

    def to_trainer(self) -> Moved:
        raise NotImplementedError

    # shared pieces -------------------------------------------------------
    def _move_optimizer(self, device: str, *, non_blocking: bool) -> Moved:
        torch.cuda.synchronize()
        started = time.perf_counter()
        moved = 0
        for state, key in _optimizer_tensors(self.optimizer):
            state[key] = state[key].to(device, non_blocking=non_blocking)
            moved += state[key].nbytes
        torch.cuda.synchronize()
        return Moved(copy_s=time.perf_counter() - started, copy_bytes=moved)

    def _sync_per_tensor(self) -> float:
        started = time.perf_counter()
        exports = {
            name: _torch.export_cuda_tensor(t.detach())
            for name, t in self.model.state_dict().items()
        }
        self.engine.call("sync_tensors", exports)
        return time.perf_counter() - started

    def _sync_fresh_buffers(self) -> float:
        started = time.perf_counter()
        items = list(self.model.state_dict().items())
        conn = self.engine.conn
        conn.send(("sync_fresh",))
        bucket = self.plan.bucket_bytes
        for batch in plan_batches([t.nbytes for _, t in items], bucket):
            buffer = torch.empty(bucket, dtype=torch.uint8, device="cuda")
            entries = []
            for piece in batch.pieces:
                name, tensor = items[piece.index]
                flat = tensor.detach().reshape(-1).view(torch.uint8)
                buffer[piece.offset : piece.offset + piece.nbytes].copy_(
                    flat[piece.start : piece.start + piece.nbytes]
                )
                entries.append((name, piece.start, piece.nbytes, piece.offset))
            torch.cuda.synchronize()
            conn.send(("batch", _torch.export_cuda_tensor(buffer), entries))
            del buffer  # dropped at once, no ipc_collect: as written in the wild
        conn.send(("end",))
        if conn.recv() != ("ok",):
            raise RuntimeError("engine did not take the weights")
        return time.perf_counter() - started


class Naive(Strategy):
    name = "naive"

    def to_rollout(self) -> Moved:
        moved = self._move_optimizer("cpu", non_blocking=False)
        torch.cuda.empty_cache()
        self.adapter.wake_up(["weights"])
        moved.sync_s = self._sync_per_tensor()
        self.adapter.wake_up(["kv_cache"])
        return moved

    def to_trainer(self) -> Moved:
        self.adapter.sleep()
        return self._move_optimizer("cuda", non_blocking=False)


def _aggressive_empty_cache() -> None:
    for _ in range(3):
        gc.collect()
        torch.cuda.empty_cache()


class Handrolled(Strategy):
    name = "handrolled"

    def train_scope(self) -> contextlib.AbstractContextManager[Any]:
        _torch.set_allocator_settings("expandable_segments:True")  # drops other settings
        return contextlib.nullcontext()

    def to_rollout(self) -> Moved:
        _torch.set_allocator_settings("expandable_segments:False")
        moved = self._move_optimizer("cpu", non_blocking=True)
        _aggressive_empty_cache()
        self.adapter.wake_up(["weights"])
        moved.sync_s = self._sync_fresh_buffers()
        _aggressive_empty_cache()
        self.adapter.wake_up(["kv_cache"])
        return moved

    def to_trainer(self) -> Moved:
        self.adapter.sleep()
        _aggressive_empty_cache()
        return self._move_optimizer("cuda", non_blocking=True)


#: The torch_memory_saver tag of the trainer's optimizer state (the ``tms`` strategy).
TMS_TAG = "optimizer"


class TmsOffload(Strategy):
    """slime's and AReaL's way: the trainer state paused through torch_memory_saver."""

    name = "tms"

    @staticmethod
    def state_scope() -> contextlib.AbstractContextManager[Any]:
        region: contextlib.AbstractContextManager[Any] = memory_saver().region(
            tag=TMS_TAG, enable_cpu_backup=True
        )
        return region

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.saver = memory_saver()
        # What torch counted for the region when the state was made (run_strategy).
        self.counted = self.engine.trainer_region
        self.state_bytes = self.counted[0]

    def to_rollout(self) -> Moved:
        torch.cuda.synchronize()
        started = time.perf_counter()
        self.saver.pause(TMS_TAG)  # copies to its CPU backup, unmaps the pages
        copy_s = time.perf_counter() - started
        # torch still counts the paused region as allocated: tell the hand-back.
        self.engine.trainer_hidden = self.counted
        gc.collect()
        torch.cuda.empty_cache()
        self.adapter.wake_up(["weights"])
        sync_s = self._sync_per_tensor()
        self.adapter.wake_up(["kv_cache"])
        return Moved(copy_s=copy_s, copy_bytes=self.state_bytes, sync_s=sync_s)

    def to_trainer(self) -> Moved:
        self.adapter.sleep()
        gc.collect()
        torch.cuda.empty_cache()
        started = time.perf_counter()
        self.saver.resume(TMS_TAG)
        torch.cuda.synchronize()
        self.engine.trainer_hidden = (0, 0)
        return Moved(copy_s=time.perf_counter() - started, copy_bytes=self.state_bytes)


class Hybridmem(Strategy):
    name = "hybridmem"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        # Model and optimizer state were made before any expandable-segments scope: in
        # classic segments, each weight rounded up to 2 MiB (~100 MiB of cache no
        # release returns), the state partly inside the warm-up's 852 MiB logits
        # segment. Both, once, before the first switch (docs/benchmarks.md).
        compact(self.model, self.optimizer)
        # The engine's weights likewise, when it makes them (hm.one_segment): in a
        # torch_memory_saver region no later move could take their rounding back.
        self.engine.call("pack_weights")
        self.offloader = self._offloader()
        self.bucket = WeightBucket(self.plan.bucket_bytes, fallback="raise")
        self.engine.call("bucket", self.bucket.handle)
        self.switch = HybridSwitch(
            self.adapter,
            "sglang",
            self.offloader,
            sync_weights=self._sync,
            barrier=None,
            reload_early=True,  # the engine's KV cache leaves room: reload while it sleeps
            rollout_need=self._rollout_need(),
        )
        self._sync_s = 0.0
        self._moved = 0  # the bytes the last switch to rollout offloaded

    def _offloader(self) -> Offloader:
        """What the switch offloads: the whole optimizer state."""
        return Offloader(self.optimizer)

    def _rollout_need(self) -> RolloutNeed:
        """What the switch is told the rollout needs: nothing (it offloads everything)."""
        return None

    def _sync(self, engine: EngineAdapter) -> None:
        started = time.perf_counter()
        conn = self.engine.conn
        conn.send(("sync_bucket",))
        self.bucket.send(self.model.state_dict(), conn)
        if conn.recv() != ("ok",):
            raise RuntimeError("engine did not take the weights")
        self._sync_s = time.perf_counter() - started

    def train_scope(self) -> contextlib.AbstractContextManager[Any]:
        return phase("train", backend="sglang")

    def to_rollout(self) -> Moved:
        released = release_seconds()
        report = self.switch.to_rollout()
        release = release_seconds() - released
        # The copies' own time: the stage only queued them, the weights and the KV
        # cache woke under them, and their report's wall time runs to their late landing.
        offloaded, planned = self.switch.offload_report, self.switch.plan
        if offloaded is not None:
            copy_s, nbytes = offloaded.copy_or_wall_seconds, offloaded.nbytes
        elif planned is not None and planned.deficit == 0:
            copy_s, nbytes = 0.0, 0  # nothing was short: nothing moved
        else:
            copy_s, nbytes = report.stage("offload").seconds, self.offloader.host_bytes
        self._moved = nbytes
        return Moved(
            copy_s=copy_s,
            copy_bytes=nbytes,
            sync_s=self._sync_s,
            release_s=release,
            stages=_stage_seconds(report),
        )

    def to_trainer(self) -> Moved:
        released = release_seconds()
        report = self.switch.to_trainer()
        return Moved(
            copy_s=report.stage("reload").seconds,
            copy_bytes=self._moved,
            release_s=release_seconds() - released,
            stages=_stage_seconds(report),
        )


def _stage_seconds(report: SwitchReport) -> dict[str, float]:
    """Each stage's seconds of one switch, by name in its order (repeats summed)."""
    seconds: dict[str, float] = {}
    for stage in report.stages:
        seconds[stage.name] = seconds.get(stage.name, 0.0) + stage.seconds
    return seconds


class Planned(Hybridmem):
    """hybridmem planned by need: the switch is told what the rollout needs (``--need``)."""

    name = "planned"

    def _rollout_need(self) -> RolloutNeed:
        # Read at each switch: the run sizes the KV cache once this strategy has made
        # its own allocations (the bucket), before the first switch.
        return self._need_now

    def _need_now(self) -> int:
        need = self.engine.rollout_need
        if need is None:
            raise ValueError(
                "strategy planned needs a rollout need: run it with hybridmem bench --scale "
                "SIZES --need SHARES"
            )
        return int(need)


class FixedFraction(Hybridmem):
    """NeMo-RL's fractional optimizer offload: a fixed share of the state, whatever is short."""

    name = "fraction"

    def _offloader(self) -> Offloader:
        return Offloader(fixed_share(self.optimizer, FIXED_FRACTION))


def fixed_share(optimizer: torch.optim.Optimizer, fraction: float) -> list[dict[str, Any]]:
    """The optimizer's per-parameter states, in order, up to ``fraction`` of its bytes.

    What a fixed fractional offload moves (NeMo-RL's ``optimizer_offload_fraction``):
    whole parameters' states, the first ones, until the share is reached.

    Example:
        >>> len(fixed_share(optimizer, 0.5))  # doctest: +SKIP
        12
    """
    states = [state for state in optimizer.state.values() if isinstance(state, dict)]

    def size(state: dict[str, Any]) -> int:
        return sum(t.nbytes for t in state.values() if isinstance(t, torch.Tensor))

    budget = fraction * sum(size(state) for state in states)
    chosen, taken = [], 0
    for state in states:
        if taken >= budget:
            break
        chosen.append(state)
        taken += size(state)
    return chosen


class Suspended(Hybridmem):
    """hybridmem with the trainer's NCCL communicators suspended through the rollout."""

    name = "suspended"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.held = SuspendCommunicators(label="bench strategy 'suspended'")

    def to_rollout(self) -> Moved:
        started = time.perf_counter()
        self.held.__enter__()  # before the KV cache wakes: into what they give back
        suspend_s = time.perf_counter() - started
        moved = super().to_rollout()
        moved.stages = {"suspend communicators": suspend_s, **moved.stages}
        return moved

    def to_trainer(self) -> Moved:
        moved = super().to_trainer()  # the engine asleep first: room to map them again
        started = time.perf_counter()
        self.held.__exit__(None, None, None)
        moved.stages["resume communicators"] = time.perf_counter() - started
        return moved


def strategy_classes() -> dict[str, type[Strategy]]:
    """Each strategy's class by name, in ``STRATEGIES`` and then ``NEED_STRATEGIES`` order."""
    return {
        "naive": Naive,
        "handrolled": Handrolled,
        "tms": TmsOffload,
        "hybridmem": Hybridmem,
        "planned": Planned,
        "fraction": FixedFraction,
        "suspended": Suspended,
    }


def make_strategy(
    name: str,
    plan: BenchPlan,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    engine: EngineClient,
) -> Strategy:
    """The strategy called ``name`` (one of ``ALL_STRATEGIES``)."""
    kinds = strategy_classes()
    if name not in kinds:
        raise ValueError(f"unknown strategy {name!r}; known: {', '.join(kinds)}")
    return kinds[name](plan, model, optimizer, engine)
