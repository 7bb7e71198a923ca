"""The guard that refuses collectives on a process group whose communicator is suspended.

NCCL does not check whether a communicator is suspended when a collective comes to
it (``src/enqueue.cc`` of NCCL 2.30.7 never reads the memory manager's ``released``
flag): the kernel would read the buffers the suspend released. While hybridmem holds
a communicator suspended, the collective methods of torch's ``ProcessGroup`` class
(what every ``torch.distributed`` collective calls) are wrapped by one that raises
:class:`~hybridmem.CommunicatorSuspendedError` for the suspended groups and calls
torch's own method for every other group; with nothing suspended, torch's methods
are back as they were. A suspension made to last until the next collective
(:func:`hybridmem.scopes.comm_pending.suspend_until_collective`) is resumed there
instead, and the collective runs. A collective that reaches NCCL some other way (a compiled
graph's functional collectives, a C++ caller) is not seen.

Scope: process-global (the class is); thread-safe (one lock for the set and the
wrapping).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

from hybridmem import _torch
from hybridmem._errors import CommunicatorSuspendedError

__all__ = ["allow", "guarded_groups", "refuse"]

_lock = threading.Lock()
# id(group) -> (group, its name, who suspended it, what resumes it at a collective);
# read without the lock on the hot path (a dict lookup is atomic), changed under it
_refused: dict[int, tuple[Any, str, str, Callable[[], object] | None]] = {}


def _wrap(name: str, original: Any) -> Callable[..., Any]:
    @functools.wraps(original)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        held = _refused.get(id(self))
        if held is not None and held[0] is self and held[3] is not None:
            held[3]()  # resumes (collective: every rank comes to this collective too)
            held = _refused.get(id(self))
        if held is not None and held[0] is self:
            raise CommunicatorSuspendedError(
                f"{name} on process group {held[1]}: its NCCL communicator is suspended "
                f"by {held[2]}; NCCL does not check, and the collective would read the "
                "buffers the suspend released. Nothing ran. Call it after the block, or "
                "leave this group out (hm.suspend_communicators(groups=[...])).",
                group=held[1],
            )
        return original(self, *args, **kwargs)

    return guarded


def refuse(group: Any, name: str, why: str, resume: Callable[[], object] | None = None) -> None:
    """Refuse collectives on ``group`` (``why``: who suspended it).

    Args:
        resume: instead of refusing, call this at the group's next collective (it must
            resume the group, which :func:`allow` s it), then run the collective.
    """
    with _lock:
        if not _refused:
            _torch.wrap_collectives(_wrap)
        _refused[id(group)] = (group, name, why, resume)


def allow(group: Any) -> None:
    """Let collectives reach ``group`` again; torch's methods come back with the last one."""
    with _lock:
        held = _refused.get(id(group))
        if held is None or held[0] is not group:
            return
        del _refused[id(group)]
        if not _refused:
            _torch.unwrap_collectives()


def guarded_groups() -> list[str]:
    """The names of the groups whose collectives are refused now."""
    return [held[1] for held in list(_refused.values())]
