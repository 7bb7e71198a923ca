"""The switch's rank protocol: every sync point carries each rank's status.

A mixin of
:class:`~hybridmem.engine.switch.HybridSwitch`: it reads the switch's rank, cycle and
state, declared here for the type checker only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridmem import _torch
from hybridmem._errors import HybridSwitchError
from hybridmem.engine.ranks import RankStatus, RankSync
from hybridmem.engine.switch_stages import Failure, SwitchState
from hybridmem.memory.need_plan import NeedPlan

__all__ = ["RankProtocol"]


class RankProtocol:
    """Exchange this rank's status at each point; learn whether another rank failed."""

    if TYPE_CHECKING:  # the switch's, read here
        rank: int
        device: int | None
        _cycle: int
        _state: SwitchState
        _ranks: RankSync | None
        _out_of_step: bool
        _shared_device: bool
        plan: NeedPlan | None

    def _device_uuid(self) -> str | None:
        """The UUID of the GPU this switch works on (None without CUDA)."""
        index = self.device if self.device is not None else _torch.current_device()
        try:
            return None if index is None else _torch.device_uuid(index)
        except (AssertionError, RuntimeError, ValueError):  # no such device here: unknown
            return None

    def _status(self, point: str, failure: Failure | None) -> RankStatus:
        return RankStatus(
            rank=self.rank,
            cycle=self._cycle,
            point=point,
            ok=failure is None,
            stage=None if failure is None else failure.stage,
            error=None if failure is None else failure.describe(),
            asleep=not (self._state.weights or self._state.kv),
            device=self._device_uuid() if self._ranks is not None else None,
            deficit=self.plan.deficit if point == "barrier_plan" and self.plan else None,
        )

    def _exchange(self, point: str, failure: Failure | None) -> list[RankStatus]:
        """Tell every rank this rank's status at ``point``; return every rank's.

        A collective when the barrier is torch.distributed's: every rank passes the
        same points in the same order, failed or not (a failed rank skips its
        remaining work but never a point), so no point pairs with another.

        Raises:
            HybridSwitchError: the ranks are at different points (out of step).
        """
        status = self._status(point, failure)
        if self._ranks is None or self._out_of_step:
            return [status]
        statuses = self._ranks.exchange(status)
        where = {(s.cycle, s.point) for s in statuses}
        if len(where) > 1:
            self._out_of_step = True
            listed = ", ".join(f"rank {s.rank} at {s.point!r} of cycle {s.cycle}" for s in statuses)
            raise HybridSwitchError(
                f"the ranks are out of step ({listed}): every rank must run the same "
                "switches in the same order"
            )
        # Another rank's switch on this GPU: its engine may still be generating when
        # this rank's switch would reload early, so the reload waits (switch_reload).
        if status.device is not None and any(
            s.device == status.device and s.rank != self.rank for s in statuses
        ):
            self._shared_device = True
        return statuses

    def _remote(self, statuses: list[RankStatus]) -> Failure | None:
        failed = [s for s in statuses if not s.ok and s.rank != self.rank]
        if not failed:
            return None
        first = failed[0]
        return Failure(
            first.stage or "?",
            HybridSwitchError(
                "; ".join(f"rank {s.rank} failed at stage {s.stage!r} ({s.error})" for s in failed)
            ),
            remote=True,
        )
