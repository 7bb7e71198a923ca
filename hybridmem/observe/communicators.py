"""What each process group's NCCL communicator holds on the device, where NCCL can say.

An NCCL communicator allocates its buffers with the CUDA driver, outside torch's
caching allocator: no cache release, offload or engine sleep returns them, and
torch's counters never show them (verl#6266 measured 7-10 GB a rank in a Megatron
3D+EP run). NCCL 2.29.7+ reports them per communicator (``ncclCommMemStats``:
suspendable, persistent, total, suspended); older NCCL cannot, and then the bytes
are part of "not torch's" in :class:`hybridmem.observe.memory.MemoryInfo`, with these groups named
as their likely holders.

Scope: this process's groups; reads only (no collective, no CUDA context made).
Thread-safe as far as torch's group registry is.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from hybridmem import _torch
from hybridmem._format import fmt_bytes
from hybridmem._log import logger
from hybridmem._names import suggests_keywords
from hybridmem._platform.nccl import MemStat, NcclCallError
from hybridmem._torch.nccl import GroupCommunicator, NcclCalls

__all__ = ["CommunicatorMemory", "communicator_memory", "describe_communicators"]

#: Where the figures come from when NCCL can say.
FROM_NCCL = "ncclCommMemStats"


@dataclass(frozen=True)
class CommunicatorMemory:
    """One process group of this process and the device memory its communicator holds.

    Attributes:
        group: torch's name for the group (the same on every rank).
        description: torch's description (``"default_pg"``, a framework's label...).
        backend: ``"nccl"``, ``"gloo"``, ...
        ranks: the group's global ranks.
        device: the device its NCCL communicator is on (None: not NCCL).
        created: whether the NCCL communicator exists yet (a lazy group makes it at
            its first collective).
        suspendable, persistent, total: device bytes (``ncclCommMemStats``); None
            where NCCL cannot say (not NCCL, no communicator, NCCL older than 2.29.7).
        suspended: whether NCCL has the communicator suspended (None: cannot say).
        source: ``"ncclCommMemStats"``, or why the figures are unknown.
    """

    group: str
    description: str
    backend: str
    ranks: tuple[int, ...]
    device: int | None
    created: bool
    suspendable: int | None
    persistent: int | None
    total: int | None
    suspended: bool | None
    source: str

    def as_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return asdict(self)

    def __str__(self) -> str:
        label = self.group if not self.description else f"{self.group} ({self.description})"
        where = f"{self.backend}, ranks {list(self.ranks)}"
        if self.total is None:
            return f"{label}: {where}; memory unknown ({self.source})"
        state = ", suspended" if self.suspended else ""
        return (
            f"{label}: {where}; {fmt_bytes(self.total)} on cuda:{self.device} "
            f"({fmt_bytes(self.suspendable)} suspendable, {fmt_bytes(self.persistent)} "
            f"persistent{state})"
        )


def _make(
    entry: GroupCommunicator,
    source: str,
    figures: dict[MemStat, int] | None = None,
) -> CommunicatorMemory:
    def figure(stat: MemStat) -> int | None:
        return None if figures is None else figures[stat]

    suspended = figure(MemStat.SUSPENDED)
    return CommunicatorMemory(
        group=entry.name,
        description=entry.description,
        backend=entry.backend,
        ranks=entry.ranks,
        device=entry.device,
        created=entry.pointer != 0,
        suspendable=figure(MemStat.SUSPENDABLE),
        persistent=figure(MemStat.PERSISTENT),
        total=figure(MemStat.TOTAL),
        suspended=None if suspended is None else bool(suspended),
        source=source,
    )


def _read(entry: GroupCommunicator, calls: NcclCalls | None) -> CommunicatorMemory:
    if entry.native is None:
        return _make(entry, "not an NCCL group")
    if entry.pointer == 0:
        none = dict.fromkeys(MemStat, 0)
        return _make(entry, "no communicator yet (made at the group's first collective)", none)
    if calls is None or not calls.has_suspend:
        found = "no NCCL library loaded" if calls is None else f"NCCL {calls.version_text}"
        return _make(entry, f"{found} has no ncclCommMemStats (NCCL 2.29.7+)")
    try:
        figures = {stat: calls.mem_stat(entry.pointer, stat) for stat in MemStat}
    except NcclCallError as exc:
        return _make(entry, str(exc))
    return _make(entry, FROM_NCCL, figures)


@suggests_keywords
def communicator_memory(device: int | None = None) -> tuple[CommunicatorMemory, ...]:
    """Each process group of this process, with its communicator's device memory.

    Never raises for what it reads: a figure NCCL cannot give is None, and ``source``
    says why. Makes no communicator and no CUDA context.

    Args:
        device: keep only NCCL communicators on this device index (None: every group).

    Returns:
        One :class:`CommunicatorMemory` a group, in torch's order (the default group
        first).

    Example:
        >>> for c in hm.communicator_memory():   # doctest: +SKIP
        ...     print(c)
        0 (default_pg): nccl, ranks [0]; ... on cuda:0 (... suspendable, ... persistent)
    """
    try:
        entries = _torch.group_communicators()
    except Exception as exc:  # a reading must never break its caller
        logger.debug("process groups not readable: %s", exc)
        return ()
    if not entries:
        return ()
    calls = _torch.nccl_calls() if any(e.pointer for e in entries) else None
    out = tuple(_read(e, calls) for e in entries)
    if device is not None:
        out = tuple(c for c in out if c.device == device)
    return out


def describe_communicators(found: tuple[CommunicatorMemory, ...]) -> list[str]:
    """Lines for a report: NCCL's total where known, else the groups named as holders."""
    nccl = [c for c in found if c.device is not None]
    if not nccl:
        return []
    known = [c for c in nccl if c.total is not None]
    lines: list[str] = []
    if len(known) == len(nccl):
        total = sum(c.total or 0 for c in known)
        lines.append(
            f"NCCL communicators hold {fmt_bytes(total)} ({len(known)} group(s), "
            f"{FROM_NCCL}); {fmt_bytes(sum(c.suspendable or 0 for c in known))} of it "
            "hm.suspend_communicators() can give back"
        )
    else:
        names = ", ".join(c.group for c in nccl)
        why = next(c.source for c in nccl if c.total is None)
        lines.append(
            f"{len(nccl)} NCCL group(s) ({names}) likely hold part of what is not torch's; "
            f"how much is unknown: {why}"
        )
    lines.extend(f"  {c}" for c in nccl)
    return lines
