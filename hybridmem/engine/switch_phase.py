"""How a switch runs a phase's recipe: its releases as the switch's garbage policy says.

A :class:`~hybridmem.scopes.phases.Phase` runs its recipe as written. A
:class:`~hybridmem.HybridSwitch` runs the same recipe with three changes that are its
own: its releases collect garbage as its :class:`~hybridmem.scopes.garbage.GarbagePolicy`
says, a release is skipped while the offload's copies run (a release synchronizes the
device, so it would wait for them; the switch releases once they have landed), and the
engine's ``await_free`` ends at once once free memory reaches what its last sleep gave
back. :class:`SwitchPhase` is one such use, built from the phase's checked steps
(nothing is checked again) and left by the switch's recovery as by its stages.

Scope: one switch, one thread or task at a time.
"""

from __future__ import annotations

from typing import Any, cast

from hybridmem._scope import ScopedContext
from hybridmem.scopes.phases import (
    Phase,
    PhaseStep,
    await_exit_waits,
    skipping_waits,
)
from hybridmem.scopes.release import Garbage

__all__ = ["SwitchPhase"]


class SwitchPhase(ScopedContext):
    """One use of ``phase`` by a switch (see the module).

    Args:
        phase: the phase, built once.
        collect_garbage: what its releases collect (None: the recipe's own).
        enough_free: free bytes that end its ``await_free`` steps at once.
        enter_releases: run the recipe's releases on entry.

    Attributes:
        exit_releases: run the recipe's releases on exit; settable until the phase
            is left (the switch decides once it knows whether copies still run).
    """

    def __init__(
        self,
        phase: Phase,
        collect_garbage: Garbage | None,
        enough_free: int | None,
        *,
        enter_releases: bool = True,
    ) -> None:
        super().__init__()
        self.phase = phase
        self.collect_garbage = collect_garbage
        self.enough_free = enough_free
        self.enter_releases = enter_releases
        self.exit_releases = True

    def __repr__(self) -> str:
        return f"{self.phase!r} in a switch (collect_garbage={self.collect_garbage!r})"

    def _act(self, releases: bool) -> Any:
        def act(step: PhaseStep) -> None:
            if step.step.action == "release_cache" and not releases:
                return
            step.run(self.collect_garbage, self.enough_free)

        return act

    def _enter(self) -> object:
        return self.phase.begin(self._act(self.enter_releases))

    def _exit(self, token: object, exc: BaseException | None) -> None:
        self.phase.end(cast(Any, token), exc, self._act(self.exit_releases))

    async def _aexit(self, token: object, exc: BaseException | None) -> None:
        await await_exit_waits(self.phase.prepared, self.enough_free)
        self.phase.end(cast(Any, token), exc, skipping_waits(self._act(self.exit_releases)))
