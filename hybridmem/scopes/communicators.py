"""suspend_communicators: NCCL communicators' device memory given back for a block.

Every process group of a colocated trainer (FSDP's, Megatron's TP/PP/DP/EP groups)
has an NCCL communicator whose buffers stay on the device through the rollout,
outside torch's caching allocator: 7-10 GB a rank in a Megatron 3D+EP run
(verl#6266). NCCL 2.29.7+ releases them and keeps the topology and connections
(``ncclCommSuspend(comm, NCCL_SUSPEND_MEM)``, back with ``ncclCommResume``).
:func:`suspend_communicators` does that for the given groups on entry and brings them
back on exit, in every form the card's scopes take.

It is collective: every rank of each group must enter and leave it (NCCL's suspend
and resume each end in a barrier). The ranks first agree through the default group's
store, with a bounded wait, so a rank that does not come is named in an error instead
of hanging the others inside NCCL (:mod:`hybridmem.scopes.comm_ranks`). While a
group is suspended, collectives on it are refused with a clear error
(:mod:`hybridmem.scopes.comm_guard`): NCCL itself does not check.

What it leaves alone, and says so: non-NCCL groups (gloo), groups this rank is not
in, groups with no communicator yet, communicators suspended by someone else (vLLM's
``enable_nccl_comm_suspend``), and everything where NCCL is older than 2.29.7 (one
warning with the version found and the fix; nothing is destroyed).

Scope: process-global (communicators are per process); nested scopes over one
communicator suspend it once and resume it when the outermost leaves. Thread-safety:
one lock over the set of held communicators; entering from two threads at once over
the same groups is a collective race the caller must avoid, as with any collective.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybridmem import _torch
from hybridmem._checks import check_seconds
from hybridmem._errors import CommunicatorError
from hybridmem._log import info_once, logger, warn_once
from hybridmem._names import suggests_keywords
from hybridmem._platform.nccl import SUSPEND_VERSION, MemStat, NcclCallError, version_text
from hybridmem._scope import ScopedContext
from hybridmem._torch.nccl import GroupCommunicator, NcclCalls
from hybridmem.scopes import comm_guard
from hybridmem.scopes.comm_ranks import OK, RanksMissing, agree
from hybridmem.scopes.comm_report import CommunicatorReport

__all__ = [
    "CommunicatorReport",
    "SuspendCommunicators",
    "held_communicators",
    "suspend_communicators",
]

DEFAULT_TIMEOUT_S = 600.0  # torch's default NCCL process-group timeout
_ELSEWHERE = "suspended by another owner"
_NO_COMM = "no communicator yet"


@dataclass
class _Held:
    entry: GroupCommunicator
    count: int
    label: str
    rounds: int = 0


_lock = threading.Lock()
_held: dict[int, _Held] = {}  # communicator pointer -> who holds it
_rounds: dict[str, int] = {}  # group name -> suspends and resumes so far (store keys)


def held_communicators() -> dict[str, int]:
    """The groups hybridmem holds suspended now, with how many scopes hold each.

    0: its resume failed and no scope holds it; the next scope over the group takes
    it over and resumes it at its exit.
    """
    with _lock:
        return {h.entry.name: h.count for h in _held.values()}


def _check_groups(groups: object) -> tuple[Any, ...] | None:
    if groups is None:
        return None
    items = (groups,) if not isinstance(groups, (list, tuple)) else tuple(groups)
    for item in items:
        if not (_torch.is_process_group(item) or _torch.is_non_member(item)):
            raise TypeError(
                "groups must be None (every process group of this process), a "
                "torch.distributed.ProcessGroup or a list of them; got "
                f"{item!r} ({type(item).__name__})"
            )
    return items


def _next_round(name: str) -> int:
    with _lock:
        n = _rounds.get(name, 0)
        _rounds[name] = n + 1
        return n


def _group_key(entry: GroupCommunicator, step: str, n: int) -> str:
    return f"hybridmem/comm/{entry.name}/{n}/{step}"


def _call(entry: GroupCommunicator, calls: NcclCalls | None, *, suspend: bool) -> str:
    """NCCL's suspend or resume of ``entry``: torch's where it has it (2.12+), else the library's.

    Returns:
        "" when it succeeded, else ``"failed: <NCCL's error>"`` (what this rank tells
        its peers).
    """
    try:
        if _torch.torch_suspends(entry.native):
            entry.native.suspend() if suspend else entry.native.resume()
        elif calls is not None:
            calls.suspend(entry.pointer) if suspend else calls.resume(entry.pointer)
    except (NcclCallError, RuntimeError) as exc:
        return f"failed: {exc}"
    return ""


@suggests_keywords
class SuspendCommunicators(ScopedContext):
    """Suspend the NCCL communicators of process groups for a block; resume them after.

    Built by :func:`suspend_communicators`; see there. ``report`` is the last
    entry's :class:`CommunicatorReport`. ``on_collective``: called at the next
    collective on a suspended group instead of refusing it; it must resume the group
    (:func:`hybridmem.scopes.comm_pending.suspend_until_collective` passes its resume).
    """

    def __init__(
        self,
        groups: Any = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        label: str = "hm.suspend_communicators()",
        on_collective: Callable[[], object] | None = None,
    ) -> None:
        super().__init__()
        self._groups = _check_groups(groups)
        self._timeout_s = check_seconds("timeout_s", timeout_s)
        if not isinstance(label, str) or not label:
            raise TypeError(f"label must be a non-empty str, got {label!r}")
        self._label = label
        if on_collective is not None and not callable(on_collective):
            raise TypeError(f"on_collective must be callable or None, got {on_collective!r}")
        self._on_collective = on_collective
        self.report: CommunicatorReport | None = None

    def __repr__(self) -> str:
        which = "every group" if self._groups is None else f"{len(self._groups)} group(s)"
        return f"suspend_communicators({which}, timeout_s={self._timeout_s:g})"

    # ----------------------------------------------------------------- choosing
    def _chosen(self, report: CommunicatorReport) -> list[GroupCommunicator]:
        found = _torch.group_communicators()
        if self._groups is None:
            chosen = []
            for e in found:
                if e.native is None:
                    logger.debug("suspend_communicators: %s is %s, not NCCL", e.name, e.backend)
                else:
                    chosen.append(e)
            return chosen
        by_group = {id(e.group): e for e in found}
        chosen, seen = [], set()
        for group in self._groups:
            if _torch.is_non_member(group):
                report.skipped.setdefault("(not a member)", "this rank is not in that group")
                continue
            entry = by_group.get(id(group))
            if entry is None or entry.group is not group:
                if not _torch.group_is_alive(group):
                    raise ValueError(
                        f"suspend_communicators: {group!r} is not a live process group of "
                        "this process (destroyed?); pass groups that exist, or None for all"
                    )
                continue
            if id(group) in seen:
                continue  # the same group twice: once is what was meant
            seen.add(id(group))
            if entry.native is None:
                report.skipped[entry.name] = f"{entry.backend}, not NCCL"
                info_once(
                    f"comm-not-nccl:{entry.name}",
                    f"suspend_communicators: group {entry.name} uses {entry.backend}, not "
                    "NCCL; left alone",
                )
                continue
            if entry.rank < 0:
                report.skipped[entry.name] = "this rank is not in it"
                continue
            chosen.append(entry)
        return chosen

    # --------------------------------------------------------------- verdicts
    def _verdict(self, entry: GroupCommunicator, calls: NcclCalls | None) -> str:
        if entry.pointer == 0:
            return _NO_COMM
        if not _torch.torch_suspends(entry.native) and (calls is None or not calls.has_suspend):
            found = "none loaded" if calls is None else calls.version_text
            return f"NCCL {found} has no ncclCommSuspend"
        if calls is not None and calls.has_suspend:
            try:
                if calls.mem_stat(entry.pointer, MemStat.SUSPENDED):
                    return _ELSEWHERE
            except NcclCallError as exc:
                return f"ncclCommMemStats failed: {exc}"
        return OK

    def _meet(self, entry: GroupCommunicator, step: str, n: int, verdict: str) -> dict[int, str]:
        if len(entry.ranks) <= 1:
            return {entry.rank if entry.rank >= 0 else 0: verdict}
        store = _torch.default_store()
        me = _torch.process_rank()
        return agree(store, _group_key(entry, step, n), me, entry.ranks, verdict, self._timeout_s)

    def _meet_or_fail(
        self,
        entry: GroupCommunicator,
        step: str,
        n: int,
        verdict: str,
        state: str,
        *,
        suspended: bool = False,
        label: str | None = None,
    ) -> dict[int, str]:
        """:meth:`_meet`; ranks that do not come raise a CommunicatorError saying ``state``."""
        try:
            return self._meet(entry, step, n, verdict)
        except RanksMissing as exc:
            doing = "suspend" if step.startswith("suspend") else "resume"
            raise CommunicatorError(
                f"{label or self._label}: to {doing} group {entry.name} (ranks "
                f"{list(entry.ranks)}): {exc}; {state}",
                group=entry.name,
                suspended_ranks=(_torch.process_rank(),) if suspended else (),
            ) from None

    # ------------------------------------------------------------------ enter
    def _enter(self) -> object:
        report = CommunicatorReport()
        self.report = report
        chosen = self._chosen(report)
        calls = _torch.nccl_calls() if chosen else None
        mine: list[_Held] = []
        device = next((e.device for e in chosen if e.device is not None), None)
        free_before = _torch.mem_get_info(device)[0] if device is not None else None
        started = time.perf_counter()
        try:
            for entry in chosen:
                with _lock:
                    held = _held.get(entry.pointer)
                    if held is not None:
                        held.count += 1
                        report.nested.append(entry.name)
                        mine.append(held)
                        continue
                self._suspend_one(entry, calls, report, mine)
        except BaseException as error:
            self._release(mine, error, report)  # put back what this entry took
            raise
        report.suspend_s = time.perf_counter() - started
        if device is not None and free_before is not None and report.suspended:
            report.freed = _torch.mem_get_info(device)[0] - free_before
        if report.suspended:
            logger.info("%s: %s", self._label, report)
        return mine

    def _suspend_one(
        self,
        entry: GroupCommunicator,
        calls: NcclCalls | None,
        report: CommunicatorReport,
        mine: list[_Held],
    ) -> None:
        n = _next_round(entry.name)
        verdict = self._verdict(entry, calls)
        verdicts = self._meet_or_fail(
            entry,
            "suspend-ready",
            n,
            verdict,
            "nothing was suspended in that group. Every rank of a group must enter the scope.",
        )
        if any(v != OK for v in verdicts.values()):
            self._leave_alone(entry, verdicts, report)
            return
        released = 0
        if calls is not None and calls.has_suspend:
            released = calls.mem_stat(entry.pointer, MemStat.SUSPENDABLE)
        failure = _call(entry, calls, suspend=True)
        held: _Held | None = None
        if not failure:  # held by no scope (0) until every rank says it suspended too
            held = _Held(entry, 0, self._label)
            with _lock:
                _held[entry.pointer] = held
            comm_guard.refuse(entry.group, entry.name, self._label, self._on_collective)
        outcome = self._meet_or_fail(
            entry,
            "suspend-done",
            n,
            failure or OK,
            "this rank's communicator is "
            + ("running" if failure else "suspended and refused to collectives")
            + "; destroy the group and make it again.",
            suspended=not failure,
        )
        failed = {r: v for r, v in outcome.items() if v != OK}
        if held is not None and not failed:
            with _lock:
                held.count = 1
            mine.append(held)
        if failed:
            done = tuple(r for r, v in outcome.items() if v == OK)
            raise CommunicatorError(
                f"{self._label}: suspending group {entry.name} failed on rank(s) "
                + ", ".join(f"{r} ({v})" for r, v in failed.items())
                + f"; suspended on {list(done) or 'no rank'}. Those stay suspended "
                "(NCCL's resume is collective and the failed ranks cannot join it): "
                "collectives on the group are refused; destroy it "
                "(torch.distributed.destroy_process_group(group)) and make it again.",
                group=entry.name,
                suspended_ranks=done,
            )
        report.suspended.append(entry.name)
        report.released += released

    def _leave_alone(
        self,
        entry: GroupCommunicator,
        verdicts: dict[int, str],
        report: CommunicatorReport,
    ) -> None:
        kinds = set(verdicts.values())
        mine = verdicts.get(_torch.process_rank(), next(iter(verdicts.values())))
        if len(kinds) > 1:
            why = "ranks disagree: " + ", ".join(f"{r}: {v}" for r, v in verdicts.items())
            warn_once(
                f"comm-disagree:{entry.name}",
                f"{self._label}: group {entry.name} left alone on every rank, since its "
                f"ranks disagree ({why}); the communicator keeps its memory.",
            )
            report.skipped[entry.name] = why
        elif mine == _ELSEWHERE:
            report.skipped[entry.name] = _ELSEWHERE
            info_once(
                f"comm-elsewhere:{entry.name}",
                f"{self._label}: group {entry.name}'s communicator is already suspended by "
                "another owner (vLLM's enable_nccl_comm_suspend, say); left to it",
            )
        elif mine == _NO_COMM:
            report.skipped[entry.name] = _NO_COMM
        else:
            report.skipped[entry.name] = mine
            warn_once(
                "comm-old-nccl",
                f"{self._label}: nothing suspended: {mine}. Suspending a communicator "
                f"needs NCCL {version_text(SUSPEND_VERSION)}+ (NVIDIA's nvidia-nccl wheel "
                "of that version, or torch 2.12+ built with it; LD_PRELOAD of a newer "
                "libnccl.so.2 works with torch's own process groups). The block runs "
                "with the communicators as they are.",
            )

    # ------------------------------------------------------------------- exit
    def _exit(self, token: object, exc: BaseException | None) -> None:
        mine = token if isinstance(token, list) else []
        report = self.report if self.report is not None else CommunicatorReport()
        self._release(mine, exc, report)

    def _release(
        self, mine: list[_Held], exc: BaseException | None, report: CommunicatorReport
    ) -> None:
        calls = _torch.nccl_calls() if mine else None
        started = time.perf_counter()
        errors: list[CommunicatorError] = []
        resumed = False
        for held in reversed(mine):
            with _lock:
                held.count -= 1
                if held.count > 0:
                    continue
            try:
                self._resume_one(held, calls)
                resumed = True
            except CommunicatorError as error:
                errors.append(error)
        if resumed:
            report.resume_s = time.perf_counter() - started
        if not errors:
            return
        if exc is None:
            raise errors[0]
        for each in errors:  # never raised over the block's own exception
            logger.error("%s", each)
            add_note = getattr(exc, "add_note", None)  # Python 3.11+
            if add_note is not None:
                add_note(f"hybridmem: {each}")

    def _resume_one(self, held: _Held, calls: NcclCalls | None) -> None:
        entry = held.entry
        n = _next_round(entry.name)
        self._meet_or_fail(
            entry,
            "resume-ready",
            n,
            OK,
            "this rank's communicator stays suspended and collectives on it are refused. "
            "A dead rank cannot resume: destroy the group "
            "(torch.distributed.destroy_process_group(group)).",
            suspended=True,
            label=held.label,
        )
        failure = _call(entry, calls, suspend=False)
        if not failure:  # running again here, whatever the peers say
            with _lock:
                _held.pop(entry.pointer, None)
            comm_guard.allow(entry.group)
        outcome = self._meet_or_fail(
            entry,
            "resume-done",
            n,
            failure or OK,
            "this rank's communicator is "
            + ("still suspended" if failure else "running again")
            + "; destroy the group and make it again.",
            suspended=bool(failure),
            label=held.label,
        )
        failed = {r: v for r, v in outcome.items() if v != OK}
        if failed:
            raise CommunicatorError(
                f"{held.label}: resuming group {entry.name} failed on rank(s) "
                + ", ".join(f"{r} ({v})" for r, v in failed.items())
                + "; those communicators stay suspended and collectives on them are "
                "refused; destroy the group and make it again.",
                group=entry.name,
                suspended_ranks=tuple(failed),
            )


@suggests_keywords
def suspend_communicators(
    groups: Any = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    label: str = "hm.suspend_communicators()",
) -> SuspendCommunicators:
    """Suspend NCCL communicators for a block (their device memory given back); resume after.

    On entry, each NCCL communicator of ``groups`` releases its dynamic device
    memory (``ncclCommSuspend(comm, NCCL_SUSPEND_MEM)``; topology and connections
    stay); on exit it gets it back (``ncclCommResume``) and collectives work as
    before, bit for bit. Use it around a rollout, inside the phase where the trainer
    is idle.

    **Collective**: every rank of each group must enter and leave it, in the same
    order. The ranks meet in the default store first (waiting at most ``timeout_s``),
    so a rank that does not come raises :class:`~hybridmem.CommunicatorError` naming
    it on the others, with nothing suspended, instead of a hang inside NCCL. If the
    ranks disagree (one has an NCCL without suspend, say), none suspends that group
    and one warning says why. Inside the block a collective on a suspended group
    raises :class:`~hybridmem.CommunicatorSuspendedError` before it reaches NCCL.

    Nested scopes over one communicator suspend it once; the outermost resumes it.
    An exception in the block still resumes. Where NCCL is older than 2.29.7 the
    block runs unchanged after one warning with the version found and the fix.

    Scope: process-global. Usable as ``with``, ``async with`` and a decorator.

    Args:
        groups: None (every NCCL group of this process), a ``ProcessGroup`` or a list
            of them. Non-NCCL groups and groups this rank is not in are left alone and
            named in the report; a destroyed group raises ValueError.
        timeout_s: the longest wait for the group's other ranks at entry and at exit
            (default 600 s, torch's NCCL timeout: a rollout's ranks finish at
            different times).
        label: how errors and logs name this scope (a phase names itself).

    Returns:
        A :class:`SuspendCommunicators`; ``.report`` is the last entry's
        :class:`CommunicatorReport`.

    Raises:
        TypeError: ``groups`` holds something other than process groups.
        ValueError: ``timeout_s`` is not a positive number; a group is destroyed.

    Example:
        >>> with hm.suspend_communicators() as held:   # doctest: +SKIP
        ...     outputs = llm.generate(prompts)
        >>> print(held.report)   # doctest: +SKIP
        suspended 5 communicator(s), NCCL released ... (device free +...) in ... ms
    """
    return SuspendCommunicators(groups, timeout_s=timeout_s, label=label)
