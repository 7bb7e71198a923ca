"""torch's NCCL process groups: which exist, their communicators, suspend and resume.

Every call here is private or version-dependent torch:

- the groups this process made: ``distributed_c10d._world.pg_names`` (every torch
  2.x; a group leaves it when ``destroy_process_group`` destroys it);
- a group's NCCL backend: ``ProcessGroup._get_backend(device)`` (torch 2.0+);
- its communicator: ``ProcessGroupNCCL._comm_ptr()`` (torch 2.8+), the
  ``ncclComm_t`` on the *current* device; 0 where none was made there yet (a lazy
  group before its first collective), so the group's own device is made current
  around the call;
- suspend and resume: ``Backend.suspend()`` / ``resume()`` where torch has them
  (torch 2.12+, over NCCL 2.29.7+), else NCCL's own calls on ``_comm_ptr()``
  through :mod:`hybridmem._platform.nccl`;
- the default store, for the agreement between ranks:
  ``distributed_c10d._get_default_store()`` (every torch 2.x);
- the collective methods of the ``ProcessGroup`` class, wrapped while a
  communicator is suspended (the names of torch 2.4-2.15).

CPU tests replace :func:`group_communicators` and :func:`nccl_calls` (a stand-in
NCCL library); the GPU tests run the real ones.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from hybridmem._platform.nccl import MemStat, NcclLibrary, loaded_nccl
from hybridmem._torch.dist import dist_initialized

__all__ = [
    "COLLECTIVES",
    "GroupCommunicator",
    "NcclCalls",
    "default_store",
    "group_communicators",
    "group_is_alive",
    "is_non_member",
    "is_process_group",
    "nccl_calls",
    "nccl_version",
    "store_get",
    "store_has",
    "store_set",
    "store_wait",
    "torch_suspends",
    "unwrap_collectives",
    "wrap_collectives",
]


@dataclass(frozen=True)
class GroupCommunicator:
    """One process group of this process and, where it is NCCL's, its communicator.

    Attributes:
        group: the ``ProcessGroup`` object.
        name: torch's name for it (``pg_names``; the same on every rank).
        description: its ``group_desc`` (``"default_pg"``, ``"undefined"``, ...).
        backend: ``"nccl"``, ``"gloo"``, ... (torch's backend name).
        ranks: its global ranks.
        rank: this process's rank in it (-1 when not a member).
        device: the CUDA device its communicator is on (None: not NCCL, or unknown).
        pointer: the ``ncclComm_t`` (0: none made on that device yet, or not NCCL).
        native: the NCCL backend object (torch's ``ProcessGroupNCCL``), or None.
    """

    group: Any
    name: str
    description: str
    backend: str
    ranks: tuple[int, ...]
    rank: int
    device: int | None
    pointer: int
    native: Any = None


def _bound_device(group: Any) -> int | None:
    bound = getattr(group, "bound_device_id", None)  # torch 2.3+: init(device_id=...)
    if bound is not None and getattr(bound, "index", None) is not None:
        return int(bound.index)
    return None


def _comm_pointer(native: Any, device: int) -> int:
    import torch

    fn = getattr(native, "_comm_ptr", None)  # torch 2.8+
    if fn is None:
        return 0
    with torch.cuda.device(device):
        return int(fn())


def group_communicators() -> list[GroupCommunicator]:
    """Every process group this process has, with its NCCL communicator where one exists.

    Never creates a communicator or a CUDA context: a lazy NCCL group before its first
    collective is listed with pointer 0.

    Example:
        >>> [(g.name, g.backend, hex(g.pointer)) for g in group_communicators()]  # doctest: +SKIP
    """
    if not dist_initialized():
        return []
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from hybridmem._torch.device import cuda_initialized, current_device

    out: list[GroupCommunicator] = []
    for group, name in list(getattr(c10d._world, "pg_names", {}).items()):
        try:
            backend_name = str(dist.get_backend(group))
            ranks = tuple(int(r) for r in dist.get_process_group_ranks(group))
            rank = int(dist.get_rank(group))
        except (RuntimeError, ValueError):  # destroyed under us
            continue
        native, device, pointer = None, None, 0
        if "nccl" in backend_name and cuda_initialized():
            try:
                native = group._get_backend(torch.device("cuda"))
            except RuntimeError:
                native = None
            if native is not None:
                device = _bound_device(group)
                if device is None:
                    device = current_device()
                pointer = _comm_pointer(native, device) if device is not None else 0
        out.append(
            GroupCommunicator(
                group=group,
                name=str(name),
                description=str(getattr(group, "group_desc", "") or ""),
                backend=backend_name,
                ranks=ranks,
                rank=rank,
                device=device,
                pointer=pointer,
                native=native,
            )
        )
    return out


def is_process_group(value: object) -> bool:
    """Whether ``value`` is a ``torch.distributed.ProcessGroup``."""
    import torch.distributed as dist

    return isinstance(value, dist.ProcessGroup)


def is_non_member(value: object) -> bool:
    """Whether ``value`` is what ``new_group`` returns on ranks it leaves out.

    ``GroupMember.NON_GROUP_MEMBER`` (an int sentinel, -100, in torch 2.x).
    """
    import torch.distributed as dist

    sentinel = getattr(dist.GroupMember, "NON_GROUP_MEMBER", None)
    return sentinel is not None and type(value) is type(sentinel) and value == sentinel


# The collectives and point-to-point calls of torch's ProcessGroup (2.4-2.15); the
# names a given torch lacks are left alone.
COLLECTIVES = (
    "allreduce",
    "allreduce_coalesced",
    "allgather",
    "allgather_coalesced",
    "allgather_into_tensor_coalesced",
    "_allgather_base",
    "all_gather_single",
    "all_gather_single_coalesced",
    "broadcast",
    "reduce",
    "reduce_scatter",
    "_reduce_scatter_base",
    "reduce_scatter_single",
    "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced",
    "alltoall",
    "alltoall_base",
    "all_to_all_single",
    "gather",
    "gather_single",
    "gather_into_tensor",
    "scatter",
    "send",
    "recv",
    "recv_anysource",
    "barrier",
    "monitored_barrier",
)
_wrapped: dict[str, Any] = {}


def wrap_collectives(make: Callable[[str, Any], Any]) -> None:
    """Replace each collective method of ``ProcessGroup`` by ``make(name, torch's method)``.

    Every ``torch.distributed`` collective calls these methods on the group object,
    so the wrappers see every Python-level collective; a compiled graph's functional
    collectives reach NCCL from C++ and are not seen. Undone by
    :func:`unwrap_collectives`; not thread-safe on its own (the caller holds a lock).
    """
    import torch.distributed as dist

    cls = dist.ProcessGroup
    for name in COLLECTIVES:
        original = cls.__dict__.get(name)
        if original is not None and name not in _wrapped:
            _wrapped[name] = original
            setattr(cls, name, make(name, original))


def unwrap_collectives() -> None:
    """Put torch's own collective methods back on ``ProcessGroup``."""
    import torch.distributed as dist

    for name, original in _wrapped.items():
        setattr(dist.ProcessGroup, name, original)
    _wrapped.clear()


def group_is_alive(group: Any) -> bool:
    """Whether ``group`` is still one of this process's groups (not destroyed)."""
    if not dist_initialized():
        return False
    from torch.distributed import distributed_c10d as c10d

    return group in getattr(c10d._world, "pg_names", {})


def torch_suspends(native: Any) -> bool:
    """Whether torch's backend object has ``suspend``/``resume`` (torch 2.12+)."""
    return callable(getattr(native, "suspend", None)) and callable(getattr(native, "resume", None))


class NcclCalls(Protocol):
    """What the scope asks of NCCL for one communicator (the loaded library, or a stand-in)."""

    @property
    def version(self) -> int: ...

    @property
    def has_suspend(self) -> bool: ...

    @property
    def version_text(self) -> str: ...

    def suspend(self, comm: int) -> None: ...

    def resume(self, comm: int) -> None: ...

    def mem_stat(self, comm: int, stat: MemStat) -> int: ...


def nccl_calls() -> NcclCalls | None:
    """The NCCL library torch loaded, bound (None: none loaded in this process)."""
    lib: NcclLibrary | None = loaded_nccl()
    return lib


def nccl_version() -> str | None:
    """The loaded NCCL's version (``"2.28.9"``), else torch's build-time one, else None."""
    calls = nccl_calls()
    if calls is not None:
        return calls.version_text
    try:
        import torch

        found = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
    except (AttributeError, RuntimeError, ImportError):
        return None
    if isinstance(found, tuple):
        return ".".join(str(x) for x in found)
    return str(found)


def default_store() -> Any:
    """The default group's c10d store (TCPStore, FileStore...), or None outside a group."""
    if not dist_initialized():
        return None
    from torch.distributed import distributed_c10d as c10d

    getter: Callable[[], Any] | None = getattr(c10d, "_get_default_store", None)
    return getter() if getter is not None else None


def store_set(store: Any, key: str, value: str) -> None:
    """``store.set(key, value)``."""
    store.set(key, value)


def store_get(store: Any, key: str) -> str:
    """``store.get(key)`` as text (the key must exist: it blocks otherwise)."""
    value = store.get(key)
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def store_has(store: Any, key: str) -> bool:
    """Whether ``key`` is in ``store`` now (no wait)."""
    return bool(store.check([key]))


def store_wait(store: Any, keys: list[str], timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for every key of ``keys``; False when time ran out."""
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:  # DistStoreError on timeout; anything else is raised
        if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
            return False
        raise
    return True
