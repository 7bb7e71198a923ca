"""What a switch reports: each stage's time and the memory readings at its boundaries."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hybridmem._format import fmt_bytes
from hybridmem.memory.need_plan import NeedPlan
from hybridmem.observe.memory import MemoryInfo

__all__ = ["StageReport", "SwitchReport"]


@dataclass(frozen=True)
class StageReport:
    """One stage of a switch: how long it took, and device memory before and after it.

    Attributes:
        name: the stage.
        seconds: how long it took.
        before, after: the :class:`~hybridmem.observe.memory.MemoryInfo` readings
            at its boundaries (the timeline's span carries the same two).
        started: ``time.time()`` at its start, comparable between processes of a host.
    """

    name: str
    seconds: float
    before: MemoryInfo
    after: MemoryInfo
    started: float

    @property
    def free_before(self) -> int | None:
        """Device free bytes at the start (None without a CUDA context)."""
        return self.before.free

    @property
    def free_after(self) -> int | None:
        """Device free bytes at the end (None without a CUDA context)."""
        return self.after.free

    @property
    def allocated_after(self) -> int | None:
        """Bytes held by live tensors at the end (None without a CUDA context)."""
        return self.after.allocated if self.after.available else None

    @property
    def reserved_after(self) -> int | None:
        """Bytes torch's allocator held at the end (None without a CUDA context)."""
        return self.after.reserved if self.after.available else None

    def __str__(self) -> str:
        free = (
            f"free {fmt_bytes(self.free_before)} -> {fmt_bytes(self.free_after)}"
            if self.free_before is not None and self.free_after is not None
            else "no device"
        )
        return f"{self.name:<14} {self.seconds * 1e3:8.2f} ms  {free}"


@dataclass
class SwitchReport:
    """Every stage of one direction of a switch, with the rank that ran it.

    ``plan``: a switch to rollout's offload planned by need (``rollout_need``), what
    moved and what stayed; None where everything was offloaded.
    """

    direction: Literal["to_rollout", "to_trainer"]
    rank: int
    stages: list[StageReport] = field(default_factory=list)
    plan: NeedPlan | None = None

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
        plan = [] if self.plan is None else [f"  planned: {self.plan}"]
        return "\n".join([head, *plan, *(f"  {s}" for s in self.stages)])
