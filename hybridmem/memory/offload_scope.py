"""The scoped offload: ``hm.offloaded(...)`` keeps targets offloaded for a block or call.

One :class:`~hybridmem.memory.offload.Offloader` serves every entry (its pool pinned
once); nested entries offload once and reload at the outermost exit.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch

from hybridmem._checks import refuse_bare_decoration
from hybridmem._names import suggests_keywords
from hybridmem._scope import ScopedContext
from hybridmem.memory.offload import Offloader
from hybridmem.memory.targets import Target, select_groups

__all__ = ["Offloaded", "offloaded"]


class Offloaded(ScopedContext):
    """Offload on entry, reload on exit (see :func:`offloaded`)."""

    def __init__(self, offloader: Offloader, groups: str | Iterable[str] | None) -> None:
        super().__init__()
        self.offloader = offloader
        self.groups = None if groups is None else select_groups(groups)
        self._depth = [0]  # shared by the fresh copies a decorator makes

    def __repr__(self) -> str:
        return f"offloaded({self.offloader!r}, groups={self.groups})"

    def _enter(self) -> object:
        if self._depth[0] == 0:
            self.offloader.offload(self.groups)
        self._depth[0] += 1
        return None

    def _exit(self, token: object, exc: BaseException | None) -> None:
        self._depth[0] -= 1
        if self._depth[0] == 0:
            self.offloader.reload(self.groups)


@suggests_keywords
def offloaded(
    *targets: Target,
    groups: str | Iterable[str] | None = None,
    pin_memory: bool = True,
    grads: Literal["keep", "drop"] = "keep",
    max_host_bytes: int | None = None,
    device: torch.device | str | int | None = None,
) -> Offloaded:
    """Keep ``targets`` offloaded to pinned host memory for a block or call.

    Offloads on entry and reloads (blocking) on exit, also when the block raises.
    One pinned pool serves every entry, including every call of a decorated
    function; nested entries offload once and reload at the outermost exit.

    Args:
        *targets: as for :class:`Offloader` (or one existing ``Offloader``).
        groups: the groups to move (default: all).
        pin_memory, grads, max_host_bytes, device: as for :class:`Offloader`.

    Returns:
        An :class:`Offloaded` context/decorator; ``.offloader`` is the Offloader.

    Example:
        >>> with hm.offloaded(model, optimizer):       # doctest: +SKIP
        ...     engine.generate(prompts)
    """
    if targets:
        refuse_bare_decoration(
            "offloaded", targets[0], "@hm.offloaded(model, optimizer), the targets to offload"
        )
    if len(targets) == 1 and isinstance(targets[0], Offloader):
        offloader = targets[0]
    else:
        offloader = Offloader(
            *targets,
            pin_memory=pin_memory,
            grads=grads,
            max_host_bytes=max_host_bytes,
            device=device,
        )
    return Offloaded(offloader, groups)
