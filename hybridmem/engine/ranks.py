"""How the ranks of a switch meet: each rank's status at each sync point.

With many ranks no rank may take memory back while another rank on the node still
holds it, and a failure on one rank must fail the cycle on every rank. The switch
exchanges a :class:`RankStatus` at each sync point through a :class:`RankSync`:
``torch.distributed`` (:class:`DistRanks`, the default) or the user's own.

Scope: one exchange per sync point per rank; every rank passes the same points in
the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from hybridmem import _torch

__all__ = ["SYNC_POINTS", "Barrier", "DistRanks", "PlainBarrier", "RankStatus", "RankSync"]

#: A plain barrier: a callable that returns once every rank called it.
Barrier = Callable[[], object]
#: The stages where ranks meet: each carries every rank's status (torch.distributed).
SYNC_POINTS = frozenset({"barrier", "barrier_kv", "barrier_reload"})


@dataclass(frozen=True)
class RankStatus:
    """What one rank says at a sync point of a switch (picklable).

    Attributes:
        rank: the rank that says it.
        cycle: its switch's cycle number (one per ``to_rollout``).
        point: the sync point (``"barrier_plan"``, ``"barrier"``, ``"barrier_kv"``,
            ``"barrier_reload"``, ``"to_rollout:end"``, ``"to_trainer:end"``,
            ``"recover"``).
        ok: False once this rank's switch failed in this direction.
        stage: where it failed.
        error: what failed, as text.
        asleep: whether its engine is asleep (nothing of it awake).
        device: the UUID of the GPU its switch works on (None: unknown), so that
            ranks sharing one learn it.
        deficit: at ``barrier_plan`` (a switch planned by need), the bytes this
            rank's plan must move; every rank then moves the largest.
    """

    rank: int
    cycle: int
    point: str
    ok: bool
    stage: str | None = None
    error: str | None = None
    asleep: bool = True
    device: str | None = None
    #: at ``barrier_plan``: the bytes this rank's offload planned by need must move
    deficit: int | None = None


@runtime_checkable
class RankSync(Protocol):
    """How ranks meet: give every rank's :class:`RankStatus` for this rank's one.

    Every rank calls :meth:`exchange` at the same points in the same order; the
    default (``barrier="auto"``) does it with ``torch.distributed.all_gather_object``
    on the default group, bounded by the process group's timeout.
    """

    def exchange(self, status: RankStatus) -> list[RankStatus]:
        """Return every rank's status at this point, this rank's included."""


class DistRanks:
    """Ranks meet through torch.distributed (the given group, or the default one)."""

    def __init__(self, group: Any = None) -> None:
        self.group = group

    def exchange(self, status: RankStatus) -> list[RankStatus]:
        return list(_torch.dist_all_gather_object(status, self.group))

    def __repr__(self) -> str:
        return "torch.distributed" if self.group is None else f"torch.distributed({self.group})"


class PlainBarrier:
    """A callable barrier: it makes ranks wait for each other but carries no status.

    It is called at the three stage barriers only (never at the points where a
    status would be needed), so every rank calls it equally often, failed or not.
    """

    def __init__(self, barrier: Barrier) -> None:
        self.barrier = barrier

    def exchange(self, status: RankStatus) -> list[RankStatus]:
        if status.point in SYNC_POINTS:
            self.barrier()
        return [status]
