"""Exception and warning classes raised by hybridmem."""

from __future__ import annotations

__all__ = [
    "AllocatorSettingsError",
    "CommunicatorError",
    "CommunicatorSuspendedError",
    "EngineAsleepError",
    "HybridMemWarning",
    "HybridSwitchError",
    "IpcUnavailableError",
    "OffloadError",
    "SleepPoolError",
    "SyncError",
]


class HybridMemWarning(UserWarning):
    """Warning category for misuse and degraded operation in hybridmem.

    Filter it like any other warning category::

        import warnings, hybridmem as hm
        warnings.simplefilter("error", hm.HybridMemWarning)
    """


class AllocatorSettingsError(ValueError):
    """A CUDA caching-allocator setting was malformed or refused by torch.

    It subclasses :class:`ValueError`, so ``except ValueError`` catches it on
    every torch version (torch itself raises ``ValueError`` on 2.10+ and
    ``RuntimeError`` before).
    """


class IpcUnavailableError(RuntimeError):
    """CUDA IPC cannot carry a tensor here, and no fallback was allowed.

    The message says why (allocator backend, probe result, pidfd denial) and what
    to do (usually ``fallback="host"`` or :func:`hybridmem.ipc_safe`).
    """


class OffloadError(RuntimeError):
    """An offload or reload could not finish; the message says where the data is.

    Nothing is lost when it is raised: either every target is back as it was (an
    offload that failed), or the data stays in the host pool, every target still
    offloaded, and a later :meth:`Offloader.reload` brings it back bit for bit (a
    reload that found too little device memory: retry once the memory is free).
    When an offload fails and putting back what it had freed fails too, those
    storages stay offloaded (``offloaded`` names their groups) and ``reload()``
    brings them back. The error torch raised, an out-of-memory error say, is its
    ``__cause__``.

    Attributes:
        offloaded: the groups whose device storage is still freed, in whole or in
            part (empty: nothing was left offloaded by the failed call).
    """

    def __init__(self, message: str, *, offloaded: frozenset[str] = frozenset()) -> None:
        super().__init__(message)
        self.offloaded = offloaded


class SyncError(RuntimeError):
    """A weight sync failed: the other side died, stopped answering, or broke the protocol.

    The bucket (or receiver) stays usable for the next sync; the message says what
    the other side did and how long was waited.
    """


class HybridSwitchError(RuntimeError):
    """A switch failed: on another rank, or here without putting everything back.

    The message says which rank failed at which stage and what remains (an engine
    still awake, trainer state still offloaded and how to get it back).
    """


class EngineAsleepError(RuntimeError):
    """A step that needs an engine's memory came while that memory sleeps.

    Raised before anything is received, written or generated: the engine's state is
    unchanged. The message names the tags asleep and the call that wakes them.
    """


class CommunicatorError(RuntimeError):
    """Suspending or resuming a process group's NCCL communicator failed, here or on a peer.

    The message names the group, the ranks and what state each communicator is in.
    A communicator left suspended stays refused to collectives (each one raises
    :class:`CommunicatorSuspendedError`); NCCL's resume is collective, so bring it
    back by resuming on every rank, or destroy the group
    (``torch.distributed.destroy_process_group(group)``) and make it again.

    Attributes:
        group: torch's name for the group.
        suspended_ranks: the ranks whose communicator is still suspended, as far as
            this rank knows (empty: none is).
    """

    def __init__(self, message: str, *, group: str, suspended_ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.group = group
        self.suspended_ranks = suspended_ranks


class CommunicatorSuspendedError(CommunicatorError):
    """A collective came to a process group whose NCCL communicator is suspended.

    Raised before torch or NCCL see the call: NCCL does not check, and a collective
    on a suspended communicator reads the buffers it released. Nothing ran.
    """


class SleepPoolError(RuntimeError):
    """A sleep, wake or discard of vLLM's sleep-mode pool stopped part way.

    The message says which tags' memory is asleep now, which of it is kept in host
    memory (woken with its bytes) and which was discarded. Nothing kept is lost: the
    pool's records still hold each kept allocation's host copy, and a later wake (of
    hybridmem's backend or vLLM's own ``wake_up``) maps it and copies it back. The
    error the driver or torch raised is its ``__cause__``.

    Attributes:
        asleep: bytes asleep now, by tag.
        kept: of those, the bytes whose contents are kept in host memory, by tag.
    """

    def __init__(self, message: str, *, asleep: dict[str, int], kept: dict[str, int]) -> None:
        super().__init__(message)
        self.asleep = asleep
        self.kept = kept
