"""torch.distributed: rank, barrier, all-gather."""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from hybridmem._torch.device import cuda_initialized


def dist_initialized() -> bool:
    """Return whether a ``torch.distributed`` default process group exists."""
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized())


def dist_rank() -> int | None:
    """Return this process's global rank, or None outside a process group."""
    if not dist_initialized():
        return None
    import torch.distributed as dist

    return int(dist.get_rank())


def process_rank() -> int:
    """This process's rank: ``torch.distributed``'s, else the ``RANK`` env variable, else 0."""
    rank = dist_rank()
    if rank is not None:
        return rank
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def dist_barrier() -> None:
    """Barrier on the default process group (NCCL: on the current device, never device 0)."""
    import torch.distributed as dist

    if dist.get_backend() == "nccl" and cuda_initialized():
        dist.barrier(device_ids=[int(torch.cuda.current_device())])
    else:
        dist.barrier()


def dist_all_gather_object(obj: object, group: Any = None) -> list[Any]:
    """Every rank's ``obj``, in rank order (``torch.distributed.all_gather_object``).

    A collective: every rank of ``group`` (None: the default group) must call it.
    With NCCL the objects travel through the current device, never device 0 by
    assumption. It waits as long as the process group's timeout (set with
    ``init_process_group(timeout=...)``), then raises.
    """
    import torch.distributed as dist

    size = dist.get_world_size(group)
    out: list[Any] = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out


def dist_all_gather_tensors(tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape on every rank), in rank order; differentiable.

    A collective over ``group`` (None: the default group). Gradients flow back: each
    rank's tensor gets the sum over ranks of the gradient of its slot. Built on the
    public ``all_gather`` / ``all_reduce`` (``torch.distributed.nn.functional`` is
    deprecated from torch 2.13 in favour of a private module), so it runs on gloo and
    NCCL alike.
    """
    # without grad, apply() runs only the forward: one gather for both cases
    return list(_all_gather_fn().apply(tensor, group))


@functools.cache
def _all_gather_fn() -> Any:
    import torch.distributed as dist

    class AllGather(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> tuple[torch.Tensor, ...]:
            ctx.group = group
            out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
            dist.all_gather(out, tensor.contiguous(), group=group)
            return tuple(out)

        @staticmethod
        def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, None]:
            stacked = torch.stack([g.contiguous() for g in grads])
            dist.all_reduce(stacked, group=ctx.group)
            return stacked[dist.get_rank(ctx.group)], None

    return AllGather
