"""verl's trainer communicators suspended through the rollout (opt-in, as verl#6408's flag).

verl 0.9's colocated step on every trainer rank (``ActorRolloutRefWorker.
update_weights`` in ``verl/workers/engine_workers.py``, for FSDP and Megatron alike):
wake the rollout's weights, sync them, offload the trainer's, meet at a
``torch.distributed.barrier``, then wake the KV cache with
``await self.rollout.resume(tags=["kv_cache"])``. The rollout then runs while the
trainer's process groups keep their NCCL buffers on the device (7-10 GB a rank in a
Megatron 3D+EP run, verl#6266). :func:`suspends_through_rollout` wraps that method:
right before the KV wake, every NCCL communicator of the trainer's process is
suspended (:func:`hybridmem.scopes.comm_pending.suspend_until_collective`: the KV
cache wakes into the memory they gave back), and they stay suspended until the next
``torch.distributed`` collective of the next training step (the first all-gather of
``compute_log_prob``), which resumes them all first. A step that starts with
``update_weights`` again resumes them at its start.

Only the trainer's own process is touched: verl's vLLM and SGLang servers run in their
own processes, with their own communicators (vLLM's ``enable_nccl_comm_suspend``).

Scope: process-global (the trainer worker's process).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from hybridmem.scopes.comm_pending import resume_communicators, suspend_until_collective

__all__ = ["ENV", "LABEL", "suspends_through_rollout"]

_R = TypeVar("_R")

#: ``1``: :func:`hybridmem.integrations.verl.install.install` also wraps
#: ``update_weights`` with :func:`suspends_through_rollout` (off by default: collective).
ENV = "HYBRIDMEM_VERL_SUSPEND_COMMUNICATORS"
LABEL = "hybridmem's verl drop-in (trainer communicators through the rollout)"
_MARK = "__hybridmem_suspends__"


def _asks_for_kv(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    tags = kwargs.get("tags", args[0] if args else None)
    return tags is not None and "kv_cache" in list(tags)


def suspends_through_rollout(
    update: Callable[..., Awaitable[_R]],
) -> Callable[..., Awaitable[_R]]:
    """Wrap verl's async ``update_weights``: trainer communicators suspended before the KV wake.

    Collective, as verl's method is: every trainer rank runs it (``ONE_TO_ALL``) and
    reaches the KV wake after verl's barrier. A peer that does not come within 600 s
    fails the call with :class:`~hybridmem.CommunicatorError` naming it.

    Args:
        update: the coroutine function (a method: ``self`` has ``rollout``).

    Returns:
        The wrapped coroutine function (the same one if already wrapped).

    Example:
        >>> from hybridmem.integrations.verl.communicators import suspends_through_rollout
        >>> class Worker:  # verl's ActorRolloutRefWorker, as far as this goes
        ...     async def update_weights(self):
        ...         await self.rollout.resume(tags=["kv_cache"])
        >>> Worker.update_weights = suspends_through_rollout(Worker.update_weights)
    """
    if getattr(update, _MARK, False):
        return update

    @functools.wraps(update)
    async def wrapper(self: Any, *args: Any, **kwargs: Any) -> _R:
        # a suspension the last step left: resumed before this step's collectives
        await asyncio.to_thread(resume_communicators)
        rollout = getattr(self, "rollout", None)
        resume = getattr(rollout, "resume", None)
        if rollout is None or resume is None:
            return await update(self, *args, **kwargs)
        own = vars(rollout).get("resume")  # an instance attribute of its own, if any

        async def resume_after_suspending(*rargs: Any, **rkwargs: Any) -> Any:
            if _asks_for_kv(rargs, rkwargs):
                await asyncio.to_thread(suspend_until_collective, label=LABEL)
            return await resume(*rargs, **rkwargs)

        rollout.resume = resume_after_suspending  # for this call only
        try:
            return await update(self, *args, **kwargs)
        finally:
            if own is None:
                del rollout.resume
            else:
                rollout.resume = own

    setattr(wrapper, _MARK, True)
    return wrapper
