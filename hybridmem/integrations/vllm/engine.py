"""The worker's end of the vLLM link: connects to a TrainerLink and receives whole syncs.

See :mod:`hybridmem.integrations.vllm.link` for the protocol. Scope: one worker thread
calls :meth:`EngineLink.update`; a daemon thread watches the trainer's pid.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from hybridmem._errors import SyncError
from hybridmem._log import logger
from hybridmem._platform import unix_socket
from hybridmem.integrations.vllm.link import UNTOUCHED, Weights, parse_init_info
from hybridmem.integrations.vllm.schema import Schema, check_weights
from hybridmem.ipc._wire import BucketHandle, Peer, recv_within, send_to
from hybridmem.ipc.receiver import BucketReceiver
from hybridmem.ipc.transports.choice import transport_named
from hybridmem.scopes.release import release_cache

__all__ = ["EngineLink"]

_WATCH_SLICE_S = 1.0  # how often the trainer watcher checks that it is still wanted


class EngineLink:
    """The engine worker's end: connects to a TrainerLink and receives whole syncs.

    Args:
        init_info: the trainer's :meth:`TrainerLink.init_info`.
        device: where received tensors go (the worker's device; CPU without CUDA).
        schema: the names and shapes the model takes (its checkpoint's: see
            :mod:`~hybridmem.integrations.vllm.schema`), sent to the trainer and
            checked on every sync; None: unchecked.

    Raises:
        ValueError: a malformed ``init_info`` (the message names the key).
        SyncError: the trainer cannot be reached within its timeout.

    Scope: one worker thread calls :meth:`update`; a daemon thread watches the
    trainer's pid and lets go of the buffers when it exits.

    Example:
        >>> link = EngineLink(init_info, torch.device("cuda", 0), schema)  # doctest: +SKIP
        >>> # one whole sync, checked, then applied
        >>> link.update(model.load_weights)  # doctest: +SKIP
    """

    def __init__(
        self,
        init_info: Mapping[str, Any],
        device: torch.device,
        schema: Schema | None = None,
    ) -> None:
        address, token, self.timeout, self.keep_staging = parse_init_info(init_info)
        #: the trainer's link this one connects to (each sync names the link it is for)
        self.address = str(init_info["address"])
        self.schema = None if schema is None else dict(schema)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._closed = False
        try:
            sock = unix_socket.connect(address, self.timeout, stream=True)
        except OSError as exc:
            raise SyncError(
                f"cannot reach the trainer's hybridmem link ({exc!r}): it exited, or this "
                "worker is in another network namespace than the trainer"
            ) from None
        trainer_pid = unix_socket.peer_credentials(sock)[0] or None  # who listens there
        conn = unix_socket.message_channel(sock)
        peer = Peer(trainer_pid, "trainer")
        receiver: BucketReceiver | None = None
        try:
            send_to(conn, token, peer, "the token", raw=True)
            message = recv_within(conn, self.timeout, peer, "the bucket")
            if not (isinstance(message, tuple) and len(message) == 3 and message[0] == "bucket"):
                raise SyncError(f"unexpected first message from the trainer: {message!r}")
            handle = message[2]
            if not isinstance(handle, BucketHandle):
                raise SyncError(f"the trainer sent {type(handle).__name__}, not a bucket handle")
            receiver = BucketReceiver(handle, _receiver_device(device, handle))
            shapes = None if self.schema is None else {k: list(v) for k, v in self.schema.items()}
            send_to(conn, ("ready", os.getpid(), shapes), peer, "its ready")
        except BaseException:
            if receiver is not None:
                receiver.close()
            conn.close()
            raise
        finally:
            peer.close()  # its pidfd: the watcher opens its own
        self.receiver = receiver
        self._conn = conn
        self.trainer_pid = handle.producer_pid
        self.transport = handle.transport
        self.syncs = 0
        self._watcher = threading.Thread(
            target=self._watch, name="hybridmem-vllm-trainer-watch", daemon=True
        )
        self._watcher.start()
        logger.info(
            "vLLM link: connected to trainer pid %d over %s", self.trainer_pid, self.transport
        )

    @property
    def closed(self) -> bool:
        """Whether the link let go of the bucket (closed, or the trainer exited)."""
        return self._closed

    def update(
        self, apply: Callable[[Weights], object], sync: int | None = None, link: str | None = None
    ) -> int:
        """Receive one whole sync, check it, then call ``apply(weights)`` once.

        Nothing reaches ``apply`` unless every tensor arrived and fits the schema, so
        a failed sync leaves the model as it was. That costs one copy of the sync on
        the link's device while it is applied (the price of never loading half a
        model); it goes back to the driver afterwards, so the engine's own pools
        (vLLM's KV cache, waking next) can take it.

        Args:
            apply: loads the weights into the model (vLLM's layerwise reload).
            sync: the trainer's sync number (its ``update_info["sync"]``): what an
                earlier, failed sync left unread is skipped up to its marker. None:
                take the next sync as it comes.
            link: the trainer link the sync comes over (its ``update_info["link"]``):
                a sync of a link this one replaced is refused at once. None: unchecked.

        Returns:
            How many tensors were applied.

        Raises:
            ValueError: a name or shape the model does not take (nothing applied).
            SyncError: the trainer died, timed out or aborted (nothing applied); if
                it died, the link is closed: the trainer must connect a new one.
            RuntimeError: the link is closed, or the sync is a replaced link's.
        """
        if link is not None and link != self.address:
            raise RuntimeError(
                "this update_weights comes from a trainer link that a later "
                "init_weight_transfer_engine replaced: sync through the newest trainer_init's "
                f"engine (the old one's link is closed); {UNTOUCHED}"
            )
        with self._lock:
            if self._closed:
                raise RuntimeError(
                    f"the hybridmem link to trainer pid {self.trainer_pid} is closed (the "
                    "trainer exited or the link was shut down): initialise a new one "
                    f"(init_weight_transfer_engine); {UNTOUCHED}"
                )
            try:
                if sync is not None:
                    self._skip_to(sync)
                weights = list(self.receiver.receive(self._conn, timeout=self.timeout))
            except (SyncError, RuntimeError) as exc:
                # A closed channel ends the link as surely as a dead pid (the process
                # may still be exiting when its socket is already shut).
                broken = isinstance(exc.__cause__, (EOFError, OSError))
                gone = broken or not self._trainer_alive()
                if gone:
                    self._close_locked()
                raise SyncError(
                    f"the weight sync failed before anything was loaded ({exc}); {UNTOUCHED}"
                    + (
                        "; the trainer is gone (or closed the link), so the link is closed"
                        if gone
                        else ""
                    )
                ) from exc
            check_weights(
                self.schema, ((n, tuple(t.shape)) for n, t in weights), where="the received sync"
            )
            self.syncs += 1
            try:
                apply(weights)
            finally:
                count = len(weights)
                del weights  # the staging copies: freed before the cache is emptied
                if not self.keep_staging and self.receiver.device.type == "cuda":
                    release_cache(self.receiver.device, collect_garbage=False)
            return count

    def _trainer_alive(self) -> bool:
        peer = Peer(self.trainer_pid, "trainer")
        try:
            return peer.alive()
        finally:
            peer.close()

    def _skip_to(self, sync: int) -> None:
        """Read up to the trainer's marker of ``sync``, dropping an earlier sync's leftovers."""
        peer = Peer(self.trainer_pid, "trainer")
        try:
            while True:
                message = recv_within(self._conn, self.timeout, peer, f"the marker of sync {sync}")
                if message == ("sync", sync):
                    return
                logger.debug("vLLM link: skipped %r, left by an earlier sync", message[:2])
        finally:
            peer.close()

    def _watch(self) -> None:
        """Let go of the buffers once the trainer exits (SIGKILL included) or closes the link.

        A closed link is seen between syncs (the lock free, nothing left to read but the
        end of the connection): the trainer's ``shutdown()``/``close()``.
        """
        peer = Peer(self.trainer_pid, "trainer")
        try:
            while not self._closed:
                why = None if peer.alive() else "exited"
                if why is None and self._lock.acquire(blocking=False):
                    try:
                        if not self._closed and unix_socket.peer_closed(self._conn):
                            why = "closed the link"
                    finally:
                        self._lock.release()
                if why is not None:
                    with self._lock:
                        if not self._closed:
                            logger.info(
                                "vLLM link: trainer pid %d %s; its buffers are let go",
                                self.trainer_pid,
                                why,
                            )
                            self._close_locked()
                    return
                self._stop.wait(_WATCH_SLICE_S)
        finally:
            peer.close()

    def _close_locked(self) -> None:
        self._closed = True
        self._stop.set()
        self.receiver.close()
        with contextlib.suppress(OSError):
            self._conn.close()

    def close(self) -> None:
        """Let go of the trainer's bucket and the connection. Idempotent."""
        with self._lock:
            if not self._closed:
                self._close_locked()


def _receiver_device(device: torch.device, handle: BucketHandle) -> int | None:
    """The receiver's device index: the worker's GPU, or None (host buckets without CUDA)."""
    if device.type == "cuda":
        return device.index if device.index is not None else torch.cuda.current_device()
    if transport_named(handle.transport).on_device:  # the transport says
        raise ValueError(
            f"the trainer's bucket is {handle.transport!r} (device memory) but this worker "
            f"runs on {device}: start the trainer with transport='host'"
        )
    return None
