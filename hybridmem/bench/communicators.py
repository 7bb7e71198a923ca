"""The trainer's NCCL process groups a ``--communicators`` bench run holds.

A trainer rank holds one NCCL communicator per parallel group (Megatron's TP, PP, DP,
CP and EP groups) through the rollout. The bench makes them in its trainer process
once the engine has started, so what they hold is not counted as context: the default
group of this one rank (bound to the current device) and ``count - 1`` subgroups,
each communicator made by a first all-reduce.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["destroy_communicators", "make_communicators"]


def make_communicators(count: int) -> None:
    """``count`` NCCL process groups of this one rank, each with its communicator made.

    Nothing for 0.

    Example:
        >>> make_communicators(5)   # doctest: +SKIP
    """
    if not count:
        return
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 1000))
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    groups: list[Any] = [dist.group.WORLD] + [dist.new_group([0]) for _ in range(count - 1)]
    for group in groups:
        dist.all_reduce(torch.ones(1, device=device), group=group)
    torch.cuda.synchronize()


def destroy_communicators(count: int) -> None:
    """Destroy the process groups ``make_communicators(count)`` made (nothing for 0)."""
    if not count:
        return
    import torch.distributed as dist

    dist.destroy_process_group()
