"""hybridmem as vLLM's sleep-mode backend: ``--sleep-mode-backend hybridmem``.

vLLM 0.33 made sleep mode pluggable (RFC #34303, ``vllm/device_allocator/
sleep_mode_backend.py``): the GPU worker's ``sleep(level)`` calls its backend's
``suspend(level)`` (then vLLM's own NCCL suspend where ``enable_nccl_comm_suspend``
is set), ``wake_up(tags)`` calls ``resume(tags)``, ``discard(tags)`` calls
``discard``. hybridmem's plugin (:mod:`~hybridmem.integrations.vllm.plugin`) registers
:class:`HybridmemSleepModeBackend` under the name ``hybridmem`` in vLLM's
``SleepModeBackendFactory``; ``LLM(..., enable_sleep_mode=True,
sleep_mode_backend="hybridmem")`` or ``--sleep-mode-backend hybridmem`` selects it.

It sleeps and wakes the same pool as vLLM's ``cumem`` backend (the worker allocates in
vLLM's ``CuMemAllocator`` whichever backend is chosen), keeping the same tags at each
level, through :class:`~hybridmem.integrations.vllm.sleep_pool.PoolSleep`: kept bytes
in host memory pinned once, no garbage collection or cache flush the state does not
need. Host memory for a level-1 sleep is pinned by :func:`reserve_sleep_backup`,
which a driver runs on every worker once the engine is made::

    llm.collective_rpc(reserve_sleep_backup)

Without it the first level-1 sleep pins (as vLLM's ``cumem`` does) and says so once.

Imports vLLM. Scope: the worker process (one pool per process).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.device_allocator.sleep_mode_backend import SleepModeBackend, SleepModeState

from hybridmem.integrations.vllm.sleep_pool import PoolSleep, SleepReport

__all__ = ["HybridmemSleepModeBackend", "pool_sleep", "reserve_sleep_backup"]

_shared: list[PoolSleep] = []  # this process's one PoolSleep, made on first use


def pool_sleep() -> PoolSleep:
    """This process's :class:`PoolSleep` over vLLM's ``CuMemAllocator`` (made once).

    Raises:
        RuntimeError: vLLM's ``cumem_allocator`` extension did not load here (no CUDA).

    Example:
        >>> pool_sleep().state()   # doctest: +SKIP
        'RUNNING'
    """
    if not _shared:
        from vllm.device_allocator import cumem

        if not cumem.cumem_available:
            raise RuntimeError(
                "vLLM's sleep-mode pool is not available here: its cumem_allocator "
                "extension did not load (it needs CUDA)"
            )
        _shared.append(
            PoolSleep(
                cumem.CuMemAllocator.get_instance(),
                create_and_map=cumem.create_and_map,
                unmap_and_release=cumem.unmap_and_release,
            )
        )
    return _shared[0]


def reserve_sleep_backup(worker: Any = None, level: int = 1) -> int:
    """Pin host memory now for what a sleep at ``level`` keeps; return the bytes pinned.

    Run it on every worker once the engine is made, so that no sleep pins::

        llm.collective_rpc(reserve_sleep_backup)

    vLLM's ``collective_rpc`` calls it with the worker first (unused: the pool is
    the process's). Pinning runs at a few GB/s (docs/benchmarks.md), so a level-1
    sleep of 14.5 GiB of weights that pins spends seconds there; reserved ahead, it
    copies at the pinned rate from its first sleep. It is idempotent: a second call
    pins only for allocations made since.

    Raises:
        ValueError: ``level`` is not 1 or 2.

    Example:
        >>> llm.collective_rpc(reserve_sleep_backup)   # doctest: +SKIP
        [15569256448]
    """
    return pool_sleep().reserve(level)


class HybridmemSleepModeBackend(SleepModeBackend):
    """vLLM's sleep-mode backend ``hybridmem``: vLLM's pool slept and woken by hybridmem.

    Level 1 keeps ``weights`` in host memory, level 2 discards them; both keep
    ``runtime`` and ``cudagraph`` and discard the rest (``kv_cache``,
    ``workspace``), as vLLM's ``cumem`` backend. :meth:`state` is read from the pool
    (``SUSPENDED`` while any of it sleeps); a failure part way raises
    :class:`~hybridmem.SleepPoolError` saying what sleeps and what is kept.

    Scope: the worker process; vLLM makes one per worker, on its first sleep.

    Example:
        >>> from vllm import LLM   # doctest: +SKIP
        >>> llm = LLM(model, enable_sleep_mode=True,
        ...           sleep_mode_backend="hybridmem")  # doctest: +SKIP
        >>> llm.sleep(level=1)   # doctest: +SKIP
        >>> llm.wake_up(["weights"]); llm.wake_up(["kv_cache"])  # doctest: +SKIP
    """

    def __init__(self) -> None:
        super().__init__()
        self.pool = pool_sleep()

    def suspend(self, level: int = 1) -> None:
        """Sleep the pool at ``level`` (1: weights kept in host memory; 2: discarded)."""
        self.pool.suspend(level)

    def resume(self, tags: list[str] | None = None) -> None:
        """Wake ``tags`` (None: all); tags other than weights and KV cache always wake."""
        self.pool.resume(tags)

    def discard(self, tags: tuple[str, ...]) -> None:
        """Unmap the mapped memory of ``tags`` without keeping it."""
        self.pool.discard(tags)

    def state(self) -> SleepModeState:
        """``RUNNING``, ``SUSPENDED`` (any of the pool asleep) or ``RESUMING``."""
        return self.pool.state()

    @property
    def last(self) -> SleepReport | None:
        """What the last suspend, resume or discard did (None before the first)."""
        return self.pool.last

    @classmethod
    def is_supported(cls) -> bool:
        """CUDA with vLLM's ``cumem_allocator`` extension (ROCm's chunked handles: no)."""
        if not torch.cuda.is_available() or torch.version.hip is not None:
            return False
        from vllm.device_allocator import cumem

        return bool(cumem.cumem_available)

    @classmethod
    def preserves_communicators(cls) -> bool:
        """True: only the pool's memory sleeps; NCCL communicators are left as they are."""
        return True

    @classmethod
    def preserves_compiled_artifacts(cls) -> bool:
        """True: the process lives on, and its kernels' memory wakes at the same addresses."""
        return True

    @classmethod
    def preserves_graphs_with_communicators(cls) -> bool:
        """True: communicators are not rebuilt and ``cudagraph`` memory is kept at every level."""
        return True

    @classmethod
    def supports_durable_storage(cls) -> bool:
        """False: what is kept lives in this process's host memory."""
        return False
