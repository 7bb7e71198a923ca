"""HybridSwitch: the staged trainer -> rollout -> trainer switch, checked and reported.

Order (vLLM RFC #15254, verl #302; SGLang's multi-stage wake-up lowered peak memory
192 -> 131.8 GB for Qwen-32B): offload trainer state -> release -> [barrier] -> wake
weights -> weight sync -> free staging -> [barrier] -> wake KV cache -> rollout ->
sleep -> confirm the memory came back -> release -> [barrier] -> reload. Never old
weights + new weights + KV cache at once, and with many ranks no rank wakes its KV
cache while another rank on the node is still offloading.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from hybridmem import _torch, phases
from hybridmem import timeline as _timeline
from hybridmem._devices import DeviceArg, device_index
from hybridmem._format import fmt_bytes
from hybridmem._log import logger
from hybridmem.backends.engines import EngineAdapter, SGLangEngine, VLLMEngine, call_sync
from hybridmem.backends.registry import BackendProfile, get_backend
from hybridmem.cache import release_cache
from hybridmem.offload import Offloader
from hybridmem.phases import Phase
from hybridmem.telemetry import MemoryInfo, memory_info

__all__ = ["HybridSwitch", "HybridSwitchError", "StageReport", "SwitchReport"]

Barrier = Callable[[], object]
# Stages that block the host for long (copies, collectives): run off the event loop.
_BLOCKING = frozenset({"offload", "reload", "barrier", "barrier_kv", "barrier_reload"})


class HybridSwitchError(RuntimeError):
    """A switch failed and could not put everything back; the message says what remains."""


@dataclass(frozen=True)
class StageReport:
    """One stage of a switch: how long it took and device memory after it."""

    name: str
    seconds: float
    free_before: int | None
    free_after: int | None
    allocated_after: int | None
    reserved_after: int | None
    started: float  # time.time(), comparable between processes of one host

    def __str__(self) -> str:
        free = (
            f"free {fmt_bytes(self.free_before)} -> {fmt_bytes(self.free_after)}"
            if self.free_before is not None and self.free_after is not None
            else "no device"
        )
        return f"{self.name:<14} {self.seconds * 1e3:8.2f} ms  {free}"


@dataclass
class SwitchReport:
    """Every stage of one direction of a switch, with the rank that ran it."""

    direction: Literal["to_rollout", "to_trainer"]
    rank: int
    stages: list[StageReport] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        """Total time of the stages."""
        return sum(s.seconds for s in self.stages)

    def stage(self, name: str) -> StageReport:
        """The stage called ``name``."""
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"no stage {name!r}; stages: {[s.name for s in self.stages]}")

    def __str__(self) -> str:
        head = f"rank {self.rank} {self.direction}: {self.seconds * 1e3:.1f} ms"
        return "\n".join([head, *(f"  {s}" for s in self.stages)])


def _adapter(engine: object, profile: BackendProfile) -> EngineAdapter:
    if isinstance(engine, EngineAdapter):
        return engine
    if profile.name == "vllm":
        return VLLMEngine(engine)
    if profile.name == "sglang":
        return SGLangEngine(engine)
    raise TypeError(
        f"wrap the engine in an adapter (hm.VLLMEngine, hm.SGLangEngine or an "
        f"hm.EngineAdapter subclass); backend {profile.name!r} has no default adapter"
    )


def _default_barrier() -> Barrier | None:
    return _torch.dist_barrier if _torch.dist_initialized() else None


@dataclass
class _Stage:
    """A stage in progress: its name, free memory and clocks at the start, its span."""

    name: str
    free0: int | None
    clock: float
    wall: float
    span: Any


@dataclass
class _State:
    offloaded: bool = False
    weights: bool = False
    kv: bool = False
    phases: list[Phase] = field(default_factory=list)


class HybridSwitch:
    """Run the staged trainer -> rollout -> trainer switch around generation.

    Args:
        engine: the rollout engine: an :class:`EngineAdapter`, or a raw vLLM ``LLM`` /
            SGLang ``Engine`` when ``backend`` is ``"vllm"`` / ``"sglang"``.
        backend: backend name or profile (None: ``HYBRIDMEM_BACKEND`` / ``"default"``);
            its recipes run in the ``wake_up``, ``weight_sync``, ``rollout`` and
            ``sleep`` phases.
        offloader: an :class:`Offloader` for the trainer state (None: nothing moves).
        sync_weights: called with the adapter inside the ``weight_sync`` phase, after
            the engine's weights woke (sync or ``async def``).
        barrier: ``"auto"`` (the default group's ``torch.distributed`` barrier when one
            is initialised, else none), None, or a callable; it runs before the engine
            wakes, before the KV cache wakes and before the trainer reloads, so no rank
            takes memory back while another on the node still holds it.
        confirm_timeout_s: how long to wait for device free memory to settle after
            the engine sleeps (SGLang can return before its memory is free).
        collect_garbage: when releases run a ``gc.collect()`` pass: ``"once"``
            (default) in the first release of each direction (after the offload;
            after the engine sleeps), which frees what reference cycles held
            before memory changes hands; ``True`` in every release (five per
            cycle, the switch's own and its recipes'); ``False`` never (when no
            reference cycle holds device memory). A pass costs tens to hundreds of
            milliseconds in a trainer process; a release without one, well under
            a millisecond plus the driver's frees.
        device: the device to measure and release (None: the current device at each
            stage); an index, ``"cuda:N"`` or a ``torch.device``.

    Scope: one switch at a time per instance. Reports name their rank
    (``torch.distributed`` rank, else ``RANK``, else 0).

    Example:
        >>> switch = hm.HybridSwitch(hm.VLLMEngine(llm), "vllm", offloader, sync_weights=push)
        >>> with switch.rollout():                   # doctest: +SKIP
        ...     outputs = llm.generate(prompts)
    """

    def __init__(
        self,
        engine: object,
        backend: str | BackendProfile | None = None,
        offloader: Offloader | None = None,
        *,
        sync_weights: Callable[[EngineAdapter], object] | None = None,
        barrier: Barrier | Literal["auto"] | None = "auto",
        confirm_timeout_s: float = 5.0,
        device: DeviceArg = None,
        collect_garbage: bool | Literal["once"] = "once",
    ) -> None:
        self.profile = backend if isinstance(backend, BackendProfile) else get_backend(backend)
        self.engine = _adapter(engine, self.profile)
        if offloader is not None and not isinstance(offloader, Offloader):
            raise TypeError(f"offloader must be an hm.Offloader or None, got {offloader!r}")
        if sync_weights is not None and not callable(sync_weights):
            raise TypeError(f"sync_weights must be callable or None, got {sync_weights!r}")
        if barrier == "auto":
            self.barrier = _default_barrier()
        elif barrier is None or callable(barrier):
            self.barrier = barrier
        else:
            raise TypeError(f"barrier must be 'auto', None or a callable, got {barrier!r}")
        if isinstance(confirm_timeout_s, bool) or not isinstance(confirm_timeout_s, int | float):
            raise TypeError(f"confirm_timeout_s must be a number, got {confirm_timeout_s!r}")
        if confirm_timeout_s < 0:
            raise ValueError(f"confirm_timeout_s must be >= 0, got {confirm_timeout_s}")
        self.offloader = offloader
        self.sync_weights = sync_weights
        self.confirm_timeout_s = float(confirm_timeout_s)
        if not (isinstance(collect_garbage, bool) or collect_garbage == "once"):
            raise TypeError(
                f"collect_garbage must be True, False or 'once', got {collect_garbage!r}"
            )
        self.collect_garbage: bool | Literal["once"] = collect_garbage
        self._collected = False  # a gc pass ran (or is planned) in this direction
        self.device = None if device is None else device_index(device)
        self.rank = _torch.process_rank()
        self.reports: list[SwitchReport] = []
        self._state = _State()
        self._active = False
        self._async_mode = False

    def __repr__(self) -> str:
        return f"HybridSwitch({self.engine!r}, backend={self.profile.name!r}, rank={self.rank})"

    # ------------------------------------------------------------------ #
    # Measuring
    # ------------------------------------------------------------------ #
    def _memory(self) -> MemoryInfo:
        """One reading for a stage boundary: the report and the timeline share it."""
        return memory_info(self.device)

    # ------------------------------------------------------------------ #
    # The stages, as (name, operation) pairs; an operation may return an awaitable
    # ------------------------------------------------------------------ #
    def _enter_phase(self, name: str) -> None:
        releases = [s.name for s in self.profile.recipe(name) if s.action == "release_cache"]
        overrides: dict[str, object] = {}
        if releases and not self._gc_now():  # the recipes' releases skip gc too
            overrides = {step: {"collect_garbage": False} for step in releases}
        entered = Phase(name, self.profile, overrides)
        entered.__enter__()
        self._state.phases.append(entered)

    def _exit_phase(self, exc: BaseException | None = None) -> Awaitable[None] | None:
        """Leave the innermost phase; in async mode its waits poll without blocking."""
        entered = self._state.phases.pop()
        info = (type(exc) if exc else None, exc, exc.__traceback__ if exc else None)
        if self._async_mode:
            return entered.__aexit__(*info)
        entered.__exit__(*info)
        return None

    @staticmethod
    def _then(first: Awaitable[Any] | None, then: Callable[[], object]) -> Any:
        """Run ``then`` after ``first`` (awaiting both when they are awaitable)."""
        if first is None:
            return then()

        async def chain() -> None:
            await first
            result = then()
            if inspect.isawaitable(result):
                await result

        return chain()

    def _offload(self) -> None:
        if self.offloader is not None:
            self._state.offloaded = True  # before: a failed offload may have moved some
            self.offloader.offload(release_cache=False)  # the next stage releases

    def _reload(self) -> None:
        if self.offloader is not None and self._state.offloaded:
            self.offloader.reload()
            self._state.offloaded = False

    def _barrier(self) -> None:
        if self.barrier is not None:
            self.barrier()

    def _wake(self, tag: str) -> Awaitable[Any] | None:
        # Counted as awake before the call: a failed wake may have taken memory.
        if tag == "weights":
            self._state.weights = True
        else:
            self._state.kv = True
        return self.engine.wake_up([tag])

    def _sleep(self) -> Awaitable[Any] | None:
        result = self.engine.sleep()
        if not inspect.isawaitable(result):
            self._state.weights = self._state.kv = False
            return None

        async def asleep() -> None:
            await result
            self._state.weights = self._state.kv = False

        return asleep()

    def _gc_now(self) -> bool:
        """Whether the next release collects garbage (and count it as done)."""
        if self.collect_garbage == "once":
            first = not self._collected
            self._collected = True
            return first
        return bool(self.collect_garbage)

    def _release(self) -> Awaitable[Any] | None:
        gc = self._gc_now()
        if self._async_mode:  # a gc pass takes tens of milliseconds: off the loop
            return asyncio.to_thread(release_cache, self.device, collect_garbage=gc)
        release_cache(self.device, collect_garbage=gc)
        return None

    def _wake_weights(self) -> Awaitable[Any] | None:
        self._enter_phase("wake_up")
        return self._wake("weights")

    def _sync(self) -> object:
        self._enter_phase("weight_sync")
        return None if self.sync_weights is None else self.sync_weights(self.engine)

    def _free_staging(self) -> object:
        # weight_sync: its recipe collects IPC leftovers and releases
        return self._then(self._exit_phase(), self._release)

    def _start_rollout(self) -> object:
        return self._then(self._exit_phase(), lambda: self._enter_phase("rollout"))  # wake_up

    def _put_to_sleep(self) -> object:
        def sleep() -> object:
            self._enter_phase("sleep")
            return self._sleep()

        return self._then(self._exit_phase(), sleep)  # rollout

    def _confirm(self) -> object:
        def settle() -> object:
            if self._async_mode:
                return phases.await_free_async(self.device, self.confirm_timeout_s)
            phases.await_free(self.device, timeout_s=self.confirm_timeout_s)
            return None

        return self._then(self._exit_phase(), settle)  # sleep: releases (SGLang: waits)

    def _to_rollout(self) -> list[tuple[str, Callable[[], object]]]:
        return [
            ("offload", self._offload),
            ("release", self._release),
            ("barrier", self._barrier),
            ("wake_weights", self._wake_weights),
            ("weight_sync", self._sync),
            ("free_staging", self._free_staging),
            ("barrier_kv", self._barrier),
            ("wake_kv", lambda: self._wake("kv_cache")),
            ("rollout", self._start_rollout),
        ]

    def _to_trainer(self) -> list[tuple[str, Callable[[], object]]]:
        return [
            ("sleep", self._put_to_sleep),
            ("confirm", self._confirm),
            ("release", self._release),
            ("barrier_reload", self._barrier),
            ("reload", self._reload),
        ]

    # ------------------------------------------------------------------ #
    # Recovery: back to the trainer phase, or say exactly what remains
    # ------------------------------------------------------------------ #
    def _recover(
        self,
        failed: str,
        exc: BaseException,
        problems: list[str] | None = None,
        *,
        try_sleep: bool = True,
    ) -> HybridSwitchError | None:
        problems = [] if problems is None else problems
        self._async_mode = False  # recovery runs to the end in one go
        state = self._state
        if (state.weights or state.kv) and try_sleep:
            try:
                call_sync(self._sleep(), "engine.sleep()")
            except Exception as error:
                problems.append(self._still_awake(error))
        while state.phases:
            try:
                self._exit_phase(exc)
            except Exception as error:
                problems.append(f"leaving a phase failed: {error!r}")
        with contextlib.suppress(Exception):
            self._release()
        if state.offloaded and not (state.weights or state.kv):
            try:
                self._reload()
            except Exception as error:
                problems.append(f"the trainer state is still offloaded: reload failed: {error!r}")
        elif state.offloaded:
            problems.append(
                "the trainer state is still offloaded (not reloaded: the engine is awake)"
            )
        self._active = False
        if not problems:
            logger.warning(
                "rank %d: switch failed at stage %r (%r); back in the trainer phase: engine "
                "asleep, trainer state reloaded, allocator settings restored",
                self.rank,
                failed,
                exc,
            )
            return None
        return HybridSwitchError(
            f"rank {self.rank}: the switch failed at stage {failed!r} ({exc!r}) and could not "
            f"restore everything: {'; '.join(problems)}. Allocator settings are restored."
        )

    async def _arecover(self, failed: str, exc: BaseException) -> HybridSwitchError | None:
        problems: list[str] = []
        if self._state.weights or self._state.kv:
            try:
                result = self._sleep()
                if inspect.isawaitable(result):
                    await result
            except Exception as error:
                problems.append(self._still_awake(error))
        return self._recover(failed, exc, problems, try_sleep=False)

    def _still_awake(self, error: Exception) -> str:
        on = (("weights", self._state.weights), ("kv_cache", self._state.kv))
        awake = ", ".join(tag for tag, is_on in on if is_on)
        return f"the engine is still awake ({awake}): sleep failed: {error!r}"

    # ------------------------------------------------------------------ #
    # Drivers
    # ------------------------------------------------------------------ #
    def _stages(self, direction: Literal["to_rollout", "to_trainer"]) -> list[tuple[str, Any]]:
        self._collected = False  # "once": one gc pass per direction
        return self._to_rollout() if direction == "to_rollout" else self._to_trainer()

    def _start_stage(self, name: str) -> _Stage:
        info = self._memory()
        span = _timeline.begin(
            f"stage:{name}",
            "stage",
            backend=self.profile.name,
            device=self.device,
            memory=info,
            rank=self.rank,
        )
        return _Stage(name, info.free, time.perf_counter(), time.time(), span)

    def _finish_stage(self, report: SwitchReport, stage: _Stage) -> None:
        info = self._memory()
        _timeline.end(stage.span, memory=info)
        seconds = time.perf_counter() - stage.clock
        counted = info.available  # without a context the counters say nothing: None
        report.stages.append(
            StageReport(
                stage.name,
                seconds,
                stage.free0,
                info.free,
                info.allocated if counted else None,
                info.reserved if counted else None,
                stage.wall,
            )
        )

    def _finish(self, report: SwitchReport) -> SwitchReport:
        self.reports.append(report)
        logger.info("%s", report)
        return report

    def _run(self, direction: Literal["to_rollout", "to_trainer"]) -> SwitchReport:
        report = SwitchReport(direction, self.rank)
        for name, operation in self._stages(direction):
            stage = self._start_stage(name)
            try:
                call_sync(operation(), f"stage {name!r}")
            except BaseException as exc:
                _timeline.end(stage.span, error=repr(exc))
                error = self._recover(name, exc)
                if error is not None:
                    raise error from exc
                raise
            self._finish_stage(report, stage)
        return self._finish(report)

    async def _arun(self, direction: Literal["to_rollout", "to_trainer"]) -> SwitchReport:
        self._async_mode = True
        try:
            report = SwitchReport(direction, self.rank)
            for name, operation in self._stages(direction):
                stage = self._start_stage(name)
                try:
                    if name in _BLOCKING:
                        result = await asyncio.to_thread(operation)  # blocking: off the loop
                    else:
                        result = operation()
                    if inspect.isawaitable(result):
                        await result
                except BaseException as exc:
                    _timeline.end(stage.span, error=repr(exc))
                    error = await self._arecover(name, exc)
                    if error is not None:
                        raise error from exc
                    raise
                self._finish_stage(report, stage)
            return self._finish(report)
        finally:
            self._async_mode = False

    def _begin(self) -> None:
        if self._active:
            raise RuntimeError(f"{self!r} is already in a rollout; switches do not nest")
        self._active = True
        self._state = _State()

    def to_rollout(self) -> SwitchReport:
        """Trainer -> rollout: offload, release, wake weights, sync, wake KV cache."""
        if self.engine.is_async:
            raise TypeError(
                f"{self.engine!r} is async: use the async API (`async with switch.rollout():`)"
            )
        self._begin()
        return self._run("to_rollout")

    def to_trainer(self) -> SwitchReport:
        """Rollout -> trainer: sleep, confirm memory came back, release, reload."""
        try:
            return self._run("to_trainer")
        finally:
            self._active = False

    @contextlib.contextmanager
    def _sync_rollout(self) -> Iterator[HybridSwitch]:
        self.to_rollout()
        try:
            yield self
        except BaseException as exc:
            error = self._recover("rollout", exc)
            if error is not None:
                raise error from exc
            raise
        self.to_trainer()

    @contextlib.asynccontextmanager
    async def _async_rollout(self) -> AsyncIterator[HybridSwitch]:
        self._begin()
        await self._arun("to_rollout")
        try:
            yield self
        except BaseException as exc:
            error = await self._arecover("rollout", exc)
            if error is not None:
                raise error from exc
            raise
        try:
            await self._arun("to_trainer")
        finally:
            self._active = False

    def rollout(self) -> _RolloutScope:
        """``with switch.rollout():`` (or ``async with``): generate between the two switches.

        On an error in the block the engine is put to sleep and the trainer state
        reloaded before the error propagates.
        """
        return _RolloutScope(self)


class _RolloutScope:
    """Both ``with`` and ``async with`` for :meth:`HybridSwitch.rollout`."""

    def __init__(self, switch: HybridSwitch) -> None:
        self._switch = switch
        self._sync: contextlib.AbstractContextManager[HybridSwitch] | None = None
        self._async: contextlib.AbstractAsyncContextManager[HybridSwitch] | None = None

    def __enter__(self) -> HybridSwitch:
        self._sync = self._switch._sync_rollout()
        return self._sync.__enter__()

    def __exit__(self, *exc: Any) -> bool | None:
        if self._sync is None:
            raise RuntimeError("rollout scope exited without being entered")
        return self._sync.__exit__(*exc)

    async def __aenter__(self) -> HybridSwitch:
        self._async = self._switch._async_rollout()
        return await self._async.__aenter__()

    async def __aexit__(self, *exc: Any) -> bool | None:
        if self._async is None:
            raise RuntimeError("rollout scope exited without being entered")
        return await self._async.__aexit__(*exc)
