"""The switch's stages as data, and what a switch carries through them: its state, a failure.

:data:`STAGES` lists each direction's stages in order, each the name of the switch's
method that runs it (None: a sync point, where every rank's status is exchanged).
The order follows vLLM RFC #15254 and verl #302: offload the trainer, release, wake
the engine's weights, sync them, free the staging, wake the KV cache; back: sleep,
confirm the memory came back, release, reload. A switch planned by need first plans
what to offload and has the ranks agree on it (:data:`PLAN_STAGES`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridmem.engine.switch_phase import SwitchPhase
from hybridmem.observe.memory import MemoryInfo

__all__ = ["PLAN_STAGES", "STAGES", "STAGE_PHASES", "Failure", "Stage", "SwitchState"]

#: The stages of each direction, in order, as data: (stage, the method that runs it).
#: None marks a sync point, which the drivers run as an exchange of every rank's
#: status (the order: see the module's docstring).
STAGES: dict[str, tuple[tuple[str, str | None], ...]] = {
    "to_rollout": (
        ("plan", "_plan"),  # planned by need only (rollout_need): else left out
        ("barrier_plan", None),  # the same: every rank moves the largest deficit
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


#: The stages a switch runs only when planned by need (``rollout_need``).
PLAN_STAGES = frozenset({"plan", "barrier_plan"})


@dataclass
class Failure:
    """Where a switch failed and why (here, or on another rank)."""

    stage: str
    error: BaseException
    remote: bool = False

    def describe(self) -> str:
        return f"{type(self.error).__name__}: {self.error}"


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
    #: the KV cache woke under the offload's copies this cycle
    kv_under: bool = False
