"""The switch's recovery: back to the trainer phase with every rank, or say what remains.

With the room check that comes before a reload (the engine must have let go before
the trainer state comes back). A mixin of :class:`~hybridmem.engine.switch.HybridSwitch`:
the switch's state and stage operations are declared here for the type checker only.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Generator, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any, cast

from hybridmem._errors import HybridSwitchError
from hybridmem._format import fmt_bytes
from hybridmem._log import logger
from hybridmem.engine.ranks import RankStatus
from hybridmem.engine.switch_calls import Call
from hybridmem.engine.switch_stages import Failure, SwitchState
from hybridmem.memory.offload import Offloader
from hybridmem.observe.memory import MemoryInfo
from hybridmem.scopes import phases

__all__ = ["Recovery"]


class Recovery:
    """Recover from a failed switch, and check for room before a reload."""

    if TYPE_CHECKING:  # the switch's, used here
        rank: int
        offloader: Offloader | None
        confirm_timeout_s: float
        _state: SwitchState
        _active: bool

        def _memory(self) -> MemoryInfo: ...

        def _sleep(self) -> Awaitable[Any] | None: ...

        def _exit_phase(
            self, exc: BaseException | None = None, *, releases: bool = True
        ) -> Awaitable[None] | None: ...

        def _release(self, point: str = "release") -> Awaitable[Any] | None: ...

        def _reload(self) -> None: ...

        def _exchange(self, point: str, failure: Failure | None) -> list[RankStatus]: ...

        def _cancel_offload(self) -> None: ...

        def _stop_feed(self) -> None: ...

    def _reload_need(self) -> int:
        if self.offloader is None or not self._state.offloaded:
            return 0
        return self.offloader.reload_bytes()

    def _room(self) -> tuple[bool, int | None, int]:
        need = self._reload_need()
        free = self._memory().free if need else None
        return (free is None or free >= need), free, need

    def _no_room(self, free: int | None, need: int) -> str:
        return (
            f"device free memory is {fmt_bytes(free or 0)} but the trainer state needs about "
            f"{fmt_bytes(need)}: the engine has not let go of its memory (its sleep returned "
            "before freeing it, or another process holds it)"
        )

    def _room_polls(self) -> Iterator[None]:
        """Yield while the trainer state does not fit yet; raise once the time is up.

        Raises:
            HybridSwitchError: no room after ``confirm_timeout_s``.
        """
        deadline = time.monotonic() + self.confirm_timeout_s
        while True:
            fits, free, need = self._room()
            if fits:
                return
            if time.monotonic() >= deadline:
                raise HybridSwitchError(
                    f"rank {self.rank}: {self._no_room(free, need)} after "
                    f"{self.confirm_timeout_s:g} s (confirm_timeout_s); not reloading into "
                    "memory that cannot hold it"
                )
            yield

    def _await_room(self) -> None:
        for _ in self._room_polls():
            time.sleep(phases.POLL_S)

    async def _await_room_async(self) -> None:
        for _ in self._room_polls():
            await asyncio.sleep(phases.POLL_S)

    def _recover(self, failure: Failure) -> Generator[Call, object, None]:
        """Back to the trainer phase with every rank, or say exactly what remains; raises."""
        problems: list[str] = []
        state = self._state
        try:  # an offload whose copies still run: nothing is freed, drop it first
            yield Call(self._cancel_offload, True, "recover:cancel")
        except Exception as error:
            problems.append(f"cancelling the offload in flight failed: {error!r}")
        try:  # a reload fed through the sleep: keep what landed, the rest stays offloaded
            yield Call(self._stop_feed, True, "recover:feed")
        except Exception as error:
            problems.append(f"stopping the reload feed failed: {error!r}")
        if state.weights or state.kv:
            try:
                yield Call(self._sleep, False, "recover:sleep")
            except Exception as error:
                problems.append(self._still_awake(error))
        while state.phases:
            try:
                yield Call(partial(self._exit_phase, failure.error), False, "recover:phase")
            except Exception as error:
                problems.append(f"leaving a phase failed: {error!r}")
        with contextlib.suppress(Exception):
            yield Call(self._release, False, "recover:release")
        everyone_asleep = True
        try:  # no rank reloads while another rank's engine may still hold memory
            statuses = yield Call(partial(self._exchange, "recover", failure), True, "recover")
            awake = [s.rank for s in cast("list[RankStatus]", statuses) if not s.asleep]
            everyone_asleep = not awake
        except Exception as error:
            awake, everyone_asleep = [], False
            problems.append(f"the ranks could not agree on recovery: {error!r}")
        if state.offloaded:
            fits, free, need = self._room()
            if state.weights or state.kv:
                problems.append(
                    "the trainer state is still offloaded (not reloaded: the engine is awake)"
                )
            elif not everyone_asleep:
                ranks = ", ".join(map(str, awake)) or "some rank"
                problems.append(
                    f"the trainer state is still offloaded (not reloaded: the engine of rank "
                    f"{ranks} is awake); call offloader.reload() once it sleeps"
                )
            elif not fits:
                problems.append(
                    f"the trainer state is still offloaded and intact: {self._no_room(free, need)}"
                    "; call offloader.reload() once the memory is free"
                )
            else:
                try:
                    yield Call(self._reload, True, "recover:reload")
                except Exception as error:
                    problems.append(
                        f"the trainer state is still offloaded: reload failed: {error!r}"
                    )
        self._active = False
        where = f"stage {failure.stage!r}"
        if not problems and not failure.remote:
            logger.warning(
                "rank %d: switch failed at %s (%r); back in the trainer phase: engine asleep, "
                "trainer state reloaded, allocator settings restored",
                self.rank,
                where,
                failure.error,
            )
            raise failure.error
        done = (
            "could not restore everything: " + "; ".join(problems)
            if problems
            else ("every rank recovered: engine asleep, trainer state reloaded")
        )
        origin = f"{failure.error}" if failure.remote else f"failed at {where} ({failure.error!r})"
        raise HybridSwitchError(
            f"rank {self.rank}: the switch {origin}, and {done}. Allocator settings are restored."
        ) from (None if failure.remote else failure.error)

    def _still_awake(self, error: Exception) -> str:
        on = (("weights", self._state.weights), ("kv_cache", self._state.kv))
        awake = ", ".join(tag for tag, is_on in on if is_on)
        return f"the engine is still awake ({awake}): sleep failed: {error!r}"
