"""A stand-in NCCL library and NCCL groups over gloo, for the communicator scope's CPU tests.

:class:`StandInNccl` answers what hybridmem asks NCCL (version, suspend, resume,
memory statistics) with NCCL 2.30.7's rules read in its ``src/mem_manager.cc``: a
second suspend or a resume of a running communicator is ``ncclInvalidUsage`` (5);
a suspend releases the suspendable bytes and a resume maps them again. With a store
it also waits like NCCL's bootstrap barrier (every rank of the communicator), so a
rank that never calls hangs the others as NCCL would — which the scope's agreement
must prevent.

:func:`as_nccl` makes real gloo groups look like NCCL groups to the seam (what
``group_communicators`` returns), so ``torch.distributed`` collectives on them run
through the real ``ProcessGroup`` methods the guard wraps.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import pytest

from hybridmem import _torch
from hybridmem._platform.nccl import MemStat, NcclCallError, version_text
from hybridmem._torch.nccl import GroupCommunicator

INVALID_USAGE = 5
SUSPENDABLE = 512 << 20
PERSISTENT = 96 << 20


@dataclass
class StandInNccl:
    """The NCCL calls hybridmem makes, on communicators numbered by pointer."""

    version: int = 23007
    has_suspend: bool = True
    suspended: set[int] = field(default_factory=set)
    fail_suspend: set[int] = field(default_factory=set)
    fail_resume: set[int] = field(default_factory=set)
    calls: list[tuple[str, int]] = field(default_factory=list)
    # for several ranks: the store and each communicator's ranks, to wait as NCCL does
    store: Any = None
    rank: int = 0
    ranks: dict[int, tuple[int, ...]] = field(default_factory=dict)
    rounds: dict[int, int] = field(default_factory=dict)

    @property
    def version_text(self) -> str:
        return version_text(self.version)

    def _barrier(self, comm: int) -> None:
        ranks = self.ranks.get(comm, ())
        if self.store is None or len(ranks) <= 1:
            return
        n = self.rounds.get(comm, 0)
        self.rounds[comm] = n + 1
        key = f"standin/{comm}/{n}"
        self.store.set(f"{key}/{self.rank}", "1")
        self.store.wait([f"{key}/{r}" for r in ranks], datetime.timedelta(seconds=60))

    def suspend(self, comm: int) -> None:
        self.calls.append(("suspend", comm))
        if comm in self.suspended:
            raise NcclCallError("ncclCommSuspend", INVALID_USAGE, "MemManager: Already suspended")
        self._barrier(comm)
        if comm in self.fail_suspend:
            raise NcclCallError("ncclCommSuspend", 1, "unhandled cuda error (injected)")
        self.suspended.add(comm)

    def resume(self, comm: int) -> None:
        self.calls.append(("resume", comm))
        if comm not in self.suspended:
            raise NcclCallError("ncclCommResume", INVALID_USAGE, "Not in suspended state")
        self._barrier(comm)
        if comm in self.fail_resume:
            raise NcclCallError("ncclCommResume", 1, "unhandled cuda error (injected)")
        self.suspended.discard(comm)

    def mem_stat(self, comm: int, stat: MemStat) -> int:
        if not self.has_suspend:
            raise AssertionError("no ncclCommMemStats in this NCCL: hybridmem must not ask")
        held = 0 if comm in self.suspended else SUSPENDABLE
        return {
            MemStat.SUSPENDABLE: SUSPENDABLE,
            MemStat.SUSPENDED: int(comm in self.suspended),
            MemStat.PERSISTENT: PERSISTENT,
            MemStat.TOTAL: PERSISTENT + held,
        }[stat]

    def device_free(self, comms: int, total: int = 80 << 30) -> int:
        """Free device bytes as NCCL's allocations leave them (for ``mem_get_info``)."""
        return total - (8 << 30) - (comms - len(self.suspended)) * SUSPENDABLE


class TorchNative:
    """torch 2.12+'s ``ProcessGroupNCCL``: ``suspend()`` and ``resume()`` on the backend."""

    def __init__(self, nccl: StandInNccl, comm: int) -> None:
        self.nccl, self.comm = nccl, comm

    def suspend(self) -> None:
        self.nccl.calls.append(("torch.suspend", self.comm))
        self.nccl.suspend(self.comm)

    def resume(self) -> None:
        self.nccl.calls.append(("torch.resume", self.comm))
        self.nccl.resume(self.comm)


def as_nccl(
    monkeypatch: pytest.MonkeyPatch,
    nccl: StandInNccl,
    groups: list[Any],
    *,
    gloo: tuple[Any, ...] = (),
    lazy: tuple[Any, ...] = (),
    torch_native: bool = False,
) -> dict[int, int]:
    """Make the seam see ``groups`` (real gloo groups) as NCCL groups on device 0.

    Returns:
        id(group) -> the communicator pointer the stand-in numbers it by.
    """
    import torch.distributed as dist

    pointers = {id(g): 0x1000 * (i + 1) for i, g in enumerate(groups)}
    names = dist.distributed_c10d._world.pg_names

    def entries() -> list[GroupCommunicator]:
        out = []
        for g in [*groups, *gloo]:
            if g not in names:
                continue
            ranks = tuple(dist.get_process_group_ranks(g))
            nccl_group = g not in gloo
            pointer = pointers[id(g)] if nccl_group and g not in lazy else 0
            native: Any = None
            if nccl_group:
                native = TorchNative(nccl, pointer) if torch_native else object()
            if pointer:
                nccl.ranks.setdefault(pointer, ranks)
            out.append(
                GroupCommunicator(
                    group=g,
                    name=str(names[g]),
                    description=str(getattr(g, "group_desc", "")),
                    backend="nccl" if nccl_group else "gloo",
                    ranks=ranks,
                    rank=dist.get_rank(g),
                    device=0 if nccl_group else None,
                    pointer=pointer,
                    native=native,
                )
            )
        return out

    monkeypatch.setattr(_torch, "group_communicators", entries)
    monkeypatch.setattr(_torch, "nccl_calls", lambda: nccl)
    count = len(groups) - len(lazy)
    monkeypatch.setattr(
        _torch, "mem_get_info", lambda index=None: (nccl.device_free(count), 80 << 30)
    )
    return pointers
