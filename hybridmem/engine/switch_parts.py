"""What the hybrid switch is made of: its stages as data, the calls its drivers run, its state.

Split out of :mod:`hybridmem.engine.switch` (issue #27) with the rank protocol
(:mod:`~hybridmem.engine.switch_ranks`) and the recovery
(:mod:`~hybridmem.engine.switch_recovery`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from hybridmem.engine.ranks import SYNC_POINTS
from hybridmem.engine.switch_phase import SwitchPhase
from hybridmem.observe.memory import MemoryInfo
from hybridmem.scopes.engines import EngineAdapter
from hybridmem.scopes.profiles import BackendProfile

__all__ = [
    "BLOCKING",
    "STAGES",
    "STAGE_PHASES",
    "Call",
    "Failure",
    "Stage",
    "SwitchState",
    "adapter",
    "in_thread",
    "then_run",
]

#: The stages of each direction, in order, as data: (stage, the method that runs it).
#: None marks a sync point, which the drivers run as an exchange of every rank's
#: status. Order: vLLM RFC #15254, verl #302 (see the module's docstring).
STAGES: dict[str, tuple[tuple[str, str | None], ...]] = {
    "to_rollout": (
        ("offload", "_offload"),
        ("release", "_release_offloaded"),
        ("barrier", None),
        ("wake_weights", "_wake_weights"),
        ("weight_sync", "_sync"),
        ("offload_land", "_offload_land"),  # the copies' frees, when the weights ran under them
        ("free_staging", "_free_staging"),
        ("barrier_kv", None),
        ("wake_kv", "_wake_kv"),
        ("offload_land_late", "_offload_land_late"),  # the same, when the KV cache did too
        ("rollout", "_start_rollout"),
    ),
    "to_trainer": (
        ("reload_early", "_reload_early"),
        ("sleep", "_put_to_sleep"),
        ("confirm", "_confirm"),
        ("release", "_release"),
        ("barrier_reload", None),
        ("reload", "_reload"),
    ),
}
# Stages that block the host for long (copies, collectives): run off the event loop.
BLOCKING = frozenset({"offload", "reload"}) | SYNC_POINTS


@dataclass
class Failure:
    """Where a switch failed and why (here, or on another rank)."""

    stage: str
    error: BaseException
    remote: bool = False

    def describe(self) -> str:
        return f"{type(self.error).__name__}: {self.error}"


@dataclass(frozen=True)
class Call:
    """One operation of a direction, for a driver to run (in a thread if ``blocking``)."""

    fn: Callable[[], object]
    blocking: bool
    name: str


def adapter(engine: object, profile: BackendProfile) -> EngineAdapter:
    """The engine as an adapter: given as one, or wrapped by the profile's adapter."""
    if isinstance(engine, EngineAdapter):
        return engine
    if profile.adapter is None:
        raise TypeError(
            f"wrap the engine in an adapter (hm.VLLMEngine, hm.SGLangEngine or an "
            f"hm.EngineAdapter subclass); backend {profile.name!r} has no default adapter "
            "(a BackendProfile names one with adapter=...)"
        )
    adapted = profile.adapter(engine)
    if not isinstance(adapted, EngineAdapter):
        raise TypeError(
            f"backend {profile.name!r}: its adapter returned {adapted!r}, not an hm.EngineAdapter"
        )
    return adapted


@dataclass
class Stage:
    """A stage in progress: its name, the memory reading and clocks at its start, its span."""

    name: str
    before: MemoryInfo
    clock: float
    wall: float
    span: Any


#: The phases a switch runs, in its stages' order.
STAGE_PHASES = ("wake_up", "weight_sync", "rollout", "sleep")


@dataclass
class SwitchState:
    """What is offloaded, what is awake, which phases are entered, what runs under the copies."""

    offloaded: bool = False
    weights: bool = False
    kv: bool = False
    phases: list[SwitchPhase] = field(default_factory=list)
    #: the KV cache woke under the offload's copies this cycle (decision 89)
    kv_under: bool = False


async def in_thread(fn: Callable[[], object]) -> object:
    """``await`` ``fn()`` in a worker thread; if cancelled, wait for the thread to end first.

    The thread cannot be stopped (an offload or reload midway): recovery must not
    touch the same state until it has finished.
    """
    task = asyncio.ensure_future(asyncio.to_thread(fn))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        while not task.done():  # the thread cannot be stopped: let it finish
            with contextlib.suppress(BaseException):
                await asyncio.shield(task)
        raise


def then_run(first: Awaitable[Any] | None, then: Callable[[], object]) -> Any:
    """Run ``then`` after ``first``, awaiting both where they are awaitable.

    ``first`` None: ``then()`` now, its result returned (an awaitable stays for the
    driver to await); else a coroutine that awaits ``first``, runs ``then`` and
    awaits what it returns.

    Example:
        >>> then_run(None, lambda: 3)
        3
    """
    if first is None:
        return then()

    async def chain() -> None:
        await first
        result = then()
        if inspect.isawaitable(result):
            await result

    return chain()
