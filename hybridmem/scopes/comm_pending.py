"""Communicators suspended until the next collective: for drivers that call methods one by one.

verl's driver calls the trainer's methods (``update_weights``, ``compute_log_prob``...)
one at a time, so no block of the trainer's code spans the rollout.
:func:`suspend_until_collective` suspends now; the next ``torch.distributed``
collective on one of the groups resumes every pending suspension (the guard of
:mod:`hybridmem.scopes.comm_guard` calls :func:`resume_communicators`), then runs.

Scope: process-global; thread-safe (one lock over the pending list).
"""

from __future__ import annotations

import threading
from typing import Any

from hybridmem._errors import CommunicatorError
from hybridmem._names import suggests_keywords
from hybridmem.scopes.comm_report import CommunicatorReport
from hybridmem.scopes.communicators import DEFAULT_TIMEOUT_S, SuspendCommunicators

__all__ = ["resume_communicators", "suspend_until_collective"]

_lock = threading.Lock()
_pending: list[SuspendCommunicators] = []  # suspend_until_collective's, newest last


@suggests_keywords
def suspend_until_collective(
    groups: Any = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    label: str = "hm.suspend_until_collective()",
) -> CommunicatorReport:
    """Suspend NCCL communicators now; resume them at the next collective on one of them.

    For frameworks where no block spans the rollout (verl's trainer methods are
    separate calls from its driver): the communicators stay suspended until the next
    ``torch.distributed`` collective on one of the groups, which first resumes them
    all (collective, in the order they were suspended: every rank comes to that
    collective too) and then runs; or until :func:`resume_communicators`. Same rules
    as :func:`suspend_communicators` otherwise. A collective that reaches NCCL without
    going through ``torch.distributed``'s Python functions (a compiled graph's
    functional collectives) is not seen: call :func:`resume_communicators` before it.

    Scope: process-global. Thread-safety: as :func:`suspend_communicators`.

    Args:
        groups, timeout_s, label: as :func:`suspend_communicators`.

    Returns:
        What was suspended (:class:`CommunicatorReport`).

    Example:
        >>> report = suspend_until_collective()   # doctest: +SKIP
        >>> dist.all_reduce(t)   # resumes every suspended group, then runs   # doctest: +SKIP
    """
    scope = SuspendCommunicators(
        groups, timeout_s=timeout_s, label=label, on_collective=resume_communicators
    )
    scope.__enter__()
    with _lock:
        _pending.append(scope)
    return scope.report if scope.report is not None else CommunicatorReport()


def resume_communicators() -> CommunicatorReport | None:
    """Resume what :func:`suspend_until_collective` suspended (collective); None if nothing.

    Every pending suspension is resumed, newest first.

    Returns:
        The first (outermost) suspension's report, its ``resume_s`` filled; None when
        nothing was pending.

    Raises:
        CommunicatorError: as at a :func:`suspend_communicators` exit (the first one;
            the others are still resumed).

    Example:
        >>> resume_communicators()   # doctest: +SKIP
    """
    report: CommunicatorReport | None = None
    first_error: CommunicatorError | None = None
    while True:
        with _lock:
            if not _pending:
                break
            scope = _pending.pop()
        try:
            scope.__exit__(None, None, None)
        except CommunicatorError as error:
            first_error = first_error or error
        report = scope.report
    if first_error is not None:
        raise first_error
    return report
