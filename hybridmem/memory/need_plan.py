"""An offload planned by need: only the bytes the rollout lacks, cheapest to move first.

A rollout needs a number of bytes on the device (its weights, KV cache and
activations), and the device often has part of them free already. The plan offloads
the deficit, ``need + margin - free``, and nothing when nothing is short, taking whole
storages group by group in :data:`NEED_ORDER`: the optimizer state first (nothing
reads it until the next optimizer step), then gradients, bare tensors, buffers, and
parameters last (the weight sync reads them). Within a group, storages go in the
order the targets hold them, so the plan is the same for the same targets and sizes,
and it overshoots the deficit by less than one storage.

Pure logic: no torch, no device; :meth:`hybridmem.Offloader.offload` takes the
deficit as ``max_bytes`` and picks the same storages with :func:`choose`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from hybridmem._checks import check_number
from hybridmem._format import fmt_bytes

__all__ = ["NEED_ORDER", "NeedPlan", "choose", "need_rank", "plan_by_need"]

#: The order in which groups are offloaded to cover a deficit: cheapest to move first.
NEED_ORDER = ("optimizer", "gradients", "tensors", "buffers", "parameters")

_S = TypeVar("_S")


def need_rank(group: str) -> int:
    """Where ``group`` comes in :data:`NEED_ORDER` (unknown groups last).

    Example:
        >>> need_rank("optimizer"), need_rank("parameters")
        (0, 4)
    """
    return NEED_ORDER.index(group) if group in NEED_ORDER else len(NEED_ORDER)


def choose(
    items: Sequence[_S], sizes: Sequence[int], groups: Sequence[str], max_bytes: int
) -> list[_S]:
    """The items an offload of ``max_bytes`` takes: by :data:`NEED_ORDER`, until covered.

    Args:
        items: what is chosen (storages, or their indices), in the targets' order.
        sizes, groups: each item's bytes and group.
        max_bytes: the bytes to cover; 0 takes nothing.

    Returns:
        The chosen items, in ``items``' order.

    Example:
        >>> choose(["p", "m", "v"], [8, 4, 4], ["parameters", "optimizer", "optimizer"], 5)
        ['m', 'v']
    """
    order = sorted(range(len(items)), key=lambda i: need_rank(groups[i]))  # stable: targets' order
    taken: set[int] = set()
    covered = 0
    for index in order:
        if covered >= max_bytes:
            break
        taken.add(index)
        covered += sizes[index]
    return [item for index, item in enumerate(items) if index in taken]


@dataclass(frozen=True)
class NeedPlan:
    """What an offload planned by need moves, and why.

    Attributes:
        need: the bytes the rollout needs on the device.
        free: device free bytes when planned (after this process's cache was released).
        margin: bytes kept free beyond the need.
        deficit: ``max(0, need + margin - free)``: what must move (with many
            ranks, the largest of theirs: :meth:`moving`).
        moved: bytes to offload, by group (only groups that move).
        stayed: bytes that stay on the device, by group.
        short: bytes still lacking with everything offloaded (0: the need is met).
    """

    need: int
    free: int
    margin: int
    deficit: int
    moved: dict[str, int] = field(default_factory=dict)
    stayed: dict[str, int] = field(default_factory=dict)
    short: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes the plan offloads."""
        return sum(self.moved.values())

    def moving(self, storages: Sequence[tuple[str, int]], deficit: int) -> NeedPlan:
        """This plan made to move ``deficit`` bytes (at least its own) of ``storages``.

        What another rank's larger deficit asks of this one: the need, free memory and
        margin stay this rank's, ``short`` too (this rank lacks nothing more); what it
        moves covers ``deficit``, or is everything where its state is smaller.

        Example:
            >>> plan = plan_by_need([("parameters", 8), ("optimizer", 16)], need=0, free=10)
            >>> plan.moving([("parameters", 8), ("optimizer", 16)], 20).moved
            {'parameters': 8, 'optimizer': 16}
        """
        wider = plan_by_need(storages, need=max(deficit, self.deficit), free=0)
        return replace(wider, need=self.need, free=self.free, margin=self.margin, short=self.short)

    def as_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready fields (for the timeline and saved results)."""
        return {
            "need": self.need,
            "free": self.free,
            "margin": self.margin,
            "deficit": self.deficit,
            "moved": dict(self.moved),
            "stayed": dict(self.stayed),
            "short": self.short,
        }

    def __str__(self) -> str:
        moved = ", ".join(f"{g} {fmt_bytes(b)}" for g, b in self.moved.items()) or "nothing"
        stayed = ", ".join(f"{g} {fmt_bytes(b)}" for g, b in self.stayed.items()) or "nothing"
        text = (
            f"need {fmt_bytes(self.need)} (+{fmt_bytes(self.margin)} margin), free "
            f"{fmt_bytes(self.free)}, deficit {fmt_bytes(self.deficit)}: moves {moved}; "
            f"stays {stayed}"
        )
        return text if not self.short else f"{text}; still {fmt_bytes(self.short)} short"


def plan_by_need(
    storages: Sequence[tuple[str, int]], need: int, free: int, margin: int = 0
) -> NeedPlan:
    """Plan the offload that leaves ``need + margin`` bytes free (see the module).

    Args:
        storages: each device storage of the trainer state as ``(group, bytes)``,
            in the targets' order.
        need: bytes the rollout needs on the device (an int ≥ 0).
        free: device free bytes now, this process's cache released.
        margin: bytes to keep free beyond the need.

    Returns:
        The :class:`NeedPlan` (its ``short`` > 0 when even offloading everything
        leaves less than the need free).

    Raises:
        TypeError, ValueError: a size that is not a whole number of bytes ≥ 0.

    Example:
        >>> plan = plan_by_need([("parameters", 8), ("optimizer", 16)], need=20, free=10)
        >>> plan.moved, plan.stayed
        ({'optimizer': 16}, {'parameters': 8})
    """
    for name, value in (("need", need), ("free", free), ("margin", margin)):
        check_number(name, value, integer=True, minimum=0, expected="a whole number of bytes")
    deficit = max(0, need + margin - free)
    sizes = [size for _, size in storages]
    groups = [group for group, _ in storages]
    chosen = set(choose(list(range(len(storages))), sizes, groups, deficit))
    moved: dict[str, int] = {}
    stayed: dict[str, int] = {}
    for index, (group, size) in enumerate(storages):
        into = moved if index in chosen else stayed
        into[group] = into.get(group, 0) + size
    short = max(0, deficit - sum(moved.values()))
    return NeedPlan(need, free, margin, deficit, moved, stayed, short)
