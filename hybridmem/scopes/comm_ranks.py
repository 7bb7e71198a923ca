"""The ranks of a group agreeing before and after NCCL's collective suspend and resume.

``ncclCommSuspend`` and ``ncclCommResume`` each wait in a barrier over the
communicator's bootstrap sockets, with no timeout: a rank that never comes (it took
another branch, it died) hangs every other rank inside NCCL. So the ranks first meet
in the default group's c10d store, with a bounded wait, and each says what it will do
("ok", or why not); only when every rank of the group said "ok" does any rank call
NCCL. After the call they meet again to learn whether every rank succeeded.

Keys: ``hybridmem/comm/<group>/<round>/<step>/<rank>``, ``round`` counting this
process's suspends and resumes of that group (the same on every rank of an SPMD
program). Scope: one call per group and round; thread-safe as the store is.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from hybridmem import _torch

__all__ = ["OK", "RanksMissing", "agree"]

#: What a rank says when it will make (or made) the NCCL call.
OK = "ok"


class RanksMissing(Exception):
    """Some ranks did not come to the store within the time allowed, or the store died."""

    def __init__(self, missing: tuple[int, ...], waited_s: float, why: str = "") -> None:
        text = why or f"ranks {list(missing)} did not come within {waited_s:.0f} s"
        super().__init__(text)
        self.missing = missing
        self.waited_s = waited_s


def agree(
    store: Any,
    key: str,
    rank: int,
    ranks: Sequence[int],
    verdict: str,
    timeout_s: float,
) -> dict[int, str]:
    """Post this rank's ``verdict`` under ``key`` and read every rank's.

    Args:
        store: the c10d store every rank of the group shares.
        key: the meeting's key (the same on every rank).
        rank: this process's global rank.
        ranks: the group's global ranks.
        verdict: what this rank says (:data:`OK`, or why not).
        timeout_s: how long to wait for the others.

    Returns:
        rank -> verdict, for every rank of the group.

    Raises:
        RanksMissing: some ranks did not post within ``timeout_s`` (named), or the
            store stopped answering (the rank that hosts a TCPStore died).
    """
    started = time.perf_counter()
    keys = [f"{key}/{r}" for r in ranks]
    try:
        _torch.store_set(store, f"{key}/{rank}", verdict)
        if not _torch.store_wait(store, keys, timeout_s):
            missing = tuple(r for r, k in zip(ranks, keys) if not _torch.store_has(store, k))
            raise RanksMissing(missing or tuple(ranks), time.perf_counter() - started)
        return {r: _torch.store_get(store, k) for r, k in zip(ranks, keys)}
    except RuntimeError as exc:  # DistNetworkError, DistStoreError: the store is gone
        waited = time.perf_counter() - started
        why = f"the ranks' store stopped answering after {waited:.1f} s ({exc})"
        raise RanksMissing((), waited, why) from None
