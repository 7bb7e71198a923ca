"""The trainer's end of the vLLM link: one WeightBucket and the socket a worker connects to.

See :mod:`hybridmem.integrations.vllm.link` for the protocol. Scope: one thread at a
time per link; one worker per link.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import secrets
import select
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from hybridmem._checks import check_bool
from hybridmem._closing import ClosesOnExit
from hybridmem._devices import DeviceArg
from hybridmem._errors import SyncError
from hybridmem._log import logger
from hybridmem._platform import unix_socket
from hybridmem.integrations.vllm.link import (
    DEFAULT_TIMEOUT_S,
    PREFIX,
    PROTOCOL,
    TOKEN_BYTES,
    bounded_timeout,
)
from hybridmem.integrations.vllm.schema import check_weights
from hybridmem.ipc._wire import Peer, recv_within, send_to
from hybridmem.ipc.bucket import SyncReport, TransportChoice, WeightBucket
from hybridmem.scopes.ipc_safe import Fallback

__all__ = ["TrainerLink"]

_SLICE_S = 0.1  # how often the accept checks that vLLM's init call still runs


class _Watched:
    """The link's channel as the bucket sees it, ended early once vLLM's call failed.

    The bucket waits for the worker's answers in short ``poll`` slices; when vLLM's
    call has already failed (the worker refused before reading, say), nothing will
    answer, and the wait ends at the next slice instead of at the timeout.
    """

    def __init__(self, conn: Any, failed: threading.Event) -> None:
        self._conn = conn
        self._failed = failed

    def send(self, message: Any) -> None:
        self._conn.send(message)

    def recv(self) -> Any:
        return self._conn.recv()

    def poll(self, timeout: float) -> bool:
        if self._failed.is_set():
            raise EOFError("vLLM's call failed: the worker is not reading")
        return bool(self._conn.poll(timeout))


def _concurrently(
    call: Callable[[], object],
    work: Callable[[threading.Event], Any],
    timeout: float,
    what: str,
) -> Any:
    """Run vLLM's blocking control call in a thread while this thread does ``work``.

    vLLM's ``update_weights`` returns only once the worker has loaded the weights,
    which it cannot do before this side sent them: both must run at once (vLLM's
    NCCL backend does the same). ``work`` gets an event set when the call failed, to
    stop waiting for a worker that will not answer. Returns ``work``'s result. When
    both fail, the call's error is raised (the worker's word on what went wrong; a
    failure of this side reaches it as the bucket's abort), this side's chained.
    """
    failure: list[BaseException] = []
    failed = threading.Event()

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # reported to the caller below
            failure.append(exc)
            failed.set()

    thread = threading.Thread(target=run, name=f"hybridmem-vllm-{what}", daemon=True)
    thread.start()
    try:
        result = work(failed)
    except BaseException as exc:
        thread.join(timeout)
        if failure:
            raise failure[0] from exc
        raise
    thread.join(timeout)
    if thread.is_alive():
        raise SyncError(
            f"vLLM's {what} did not return within {timeout:g} s (timeout=) after the data "
            "was sent: the engine is stuck or gone"
        )
    if failure:
        raise failure[0]
    return result


class TrainerLink(ClosesOnExit):
    """The trainer's end: one WeightBucket and the socket an engine connects to.

    Args:
        bucket_bytes: bytes per bucket buffer (256 MiB: see :class:`WeightBucket`).
        device: the device of the tensors to send (None: the current device).
        buffers: bucket buffers (2: fill one while the engine drains the other).
        transport: ``"auto"``, ``"cuda"``, ``"fd"`` or ``"host"`` (as
            :class:`WeightBucket`).
        fallback: ``"auto"``, ``"host"`` or ``"raise"`` (as :class:`WeightBucket`).
        timeout: the longest wait for the engine, per message and per control
            call, in seconds (no unbounded waits).
        keep_staging: the engine keeps each sync's staging copy cached for the next
            one instead of giving it back to the driver once applied (faster: no
            allocation per sync; but one model's worth of device memory stays
            reserved in the engine's process, out of reach of its own pools, such as
            vLLM's KV cache). Default False.

    Raises:
        TypeError, ValueError: a bad argument (the message names it).

    Scope: one thread at a time; one engine worker per link.

    Example:
        >>> link = TrainerLink(256 << 20)                        # doctest: +SKIP
        >>> link.connect(  # doctest: +SKIP
        ...     lambda info: llm.init_weight_transfer_engine({"init_info": info}))
        >>> link.sync(  # doctest: +SKIP
        ...     model.state_dict(), lambda info: llm.update_weights({"update_info": info}))
    """

    def __init__(
        self,
        bucket_bytes: int = 256 << 20,
        device: DeviceArg = None,
        *,
        buffers: int = 2,
        transport: TransportChoice = "auto",
        fallback: Fallback = "auto",
        timeout: float = DEFAULT_TIMEOUT_S,
        keep_staging: bool = False,
    ) -> None:
        self.timeout = bounded_timeout(timeout)
        self.keep_staging = check_bool("keep_staging", keep_staging)
        self.bucket = WeightBucket(
            bucket_bytes, device, buffers=buffers, transport=transport, fallback=fallback
        )
        self.schema: dict[str, tuple[int, ...]] | None = None
        self.engine_pid: int | None = None
        self._token = secrets.token_bytes(TOKEN_BYTES)
        self._address = unix_socket.new_address(PREFIX)
        self._listener: socket.socket | None = unix_socket.listen(self._address, stream=True)
        self._conn: Any = None
        self._syncs = 0

    @property
    def transport(self) -> str:
        """The bucket's transport: ``"cuda"``, ``"fd"`` or ``"host"``."""
        return self.bucket.transport

    def init_info(self) -> dict[str, Any]:
        """What the engine needs to connect (JSON-native: any vLLM client carries it)."""
        return {
            "address": self._address[1:].decode(),  # abstract namespace: no leading NUL
            "token": self._token.hex(),
            "timeout": self.timeout,
            "protocol": PROTOCOL,
            "transport": self.bucket.transport,
            "keep_staging": self.keep_staging,
        }

    def connect(self, init: Callable[[dict[str, Any]], object]) -> None:
        """Call ``init(init_info)`` (vLLM's init RPC) and take the engine's connection.

        Raises:
            SyncError: no engine connected within ``timeout``, or it broke off.
            RuntimeError: already connected, or closed.
        """
        if self._listener is None:
            raise RuntimeError("this TrainerLink is closed or already connected")
        info = self.init_info()
        _concurrently(lambda: init(info), self._accept, self.timeout, "init_weight_transfer_engine")

    def _accept(self, failed: threading.Event) -> None:
        assert self._listener is not None
        deadline = time.monotonic() + self.timeout
        readable: list[Any] = []
        while not readable and not failed.is_set() and time.monotonic() < deadline:
            slice_s = min(_SLICE_S, max(0.0, deadline - time.monotonic()))
            readable, _, _ = select.select([self._listener], [], [], slice_s)
        if failed.is_set():
            raise SyncError("vLLM's init_weight_transfer_engine failed before a worker connected")
        if not readable:
            raise SyncError(
                f"no vLLM worker connected within {self.timeout:g} s (timeout=): is the "
                "engine started with weight_transfer_config={'backend': 'hybridmem'}?"
            )
        sock, _ = self._listener.accept()
        pid, uid, _gid = unix_socket.peer_credentials(sock)
        if uid != os.getuid():
            sock.close()
            raise SyncError(f"a process of another user (uid {uid}) connected; refused")
        conn = unix_socket.message_channel(sock)
        peer = Peer(pid or None, "engine")
        try:
            if not conn.poll(self.timeout) or not hmac.compare_digest(
                conn.recv_bytes(maxlength=TOKEN_BYTES), self._token
            ):
                raise SyncError("the connecting process did not present this link's token")
            send_to(conn, ("bucket", PROTOCOL, self.bucket.handle), peer, "the bucket")
            message = recv_within(conn, self.timeout, peer, "its ready message")
            if not (isinstance(message, tuple) and len(message) == 3 and message[0] == "ready"):
                raise SyncError(f"unexpected answer from the engine: {message!r}")
        except BaseException:
            conn.close()
            raise
        finally:
            peer.close()
        _, self.engine_pid, schema = message
        self.schema = None if schema is None else {k: tuple(v) for k, v in schema.items()}
        self._conn = conn
        self._listener.close()
        self._listener = None
        # The engine has mapped the host buffers: their names can go, so a killed
        # trainer leaves nothing in /dev/shm.
        self.bucket.unlink_shared_names()
        logger.info(
            "vLLM link: engine pid %s connected over %s (%s)",
            self.engine_pid,
            self.bucket.transport,
            "its checkpoint's names checked" if self.schema else "no checkpoint schema",
        )

    def check(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Raise ValueError (naming them) if these tensors do not fit the engine's model."""
        check_weights(
            self.schema, ((n, tuple(t.shape)) for n, t in named), where="the weights to send"
        )

    def sync(
        self,
        named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        update: Callable[[dict[str, Any]], object],
        *,
        weight_version: str | None = None,
        start: Callable[[], object] | None = None,
    ) -> SyncReport:
        """Check, then send ``named`` while ``update(update_info)`` (vLLM's RPC) receives them.

        Args:
            named: the tensors, by name (checked as :meth:`WeightBucket.send` checks
                them, and against the engine's checkpoint).
            update: vLLM's ``update_weights`` call, run beside the sending.
            weight_version: carried in ``update_info``.
            start: vLLM's ``start_weight_update``, called once every check passed
                and before ``update``: a refused sync never leaves an update open in
                the worker (whose next start would then fail).

        Returns:
            The bucket's :class:`SyncReport`.

        Raises:
            ValueError: a name or shape the engine's model does not take; nothing sent.
            SyncError: the engine died, closed the link (a later link replaced this
                one: said at once, before vLLM is called) or did not answer in time.
            RuntimeError: not connected, or the engine refused the update (its error).
        """
        if self._conn is None:
            raise RuntimeError("this TrainerLink has no engine: call connect() first")
        if unix_socket.peer_closed(self._conn):
            raise SyncError(
                "the engine closed this link before the sync: a later trainer_init replaced "
                "it, or the engine shut its weight transfer down or exited. Nothing was sent "
                "and vLLM was not called; sync through the newest trainer_init's engine"
            )
        items = self.bucket.check(named)  # refused here, before vLLM is told anything
        self.check(items)
        if start is not None:
            start()
        self._syncs += 1
        sync = self._syncs
        info = {
            "sync": sync,
            "tensors": len(items),
            "weight_version": weight_version,
            "link": self.init_info()["address"],  # a replaced link's sync is refused at once
        }
        conn = self._conn

        def send(failed: threading.Event) -> SyncReport:
            # The worker reads from this marker on: whatever an earlier, failed sync
            # left unread in the connection is skipped, not taken for this one.
            send_to(conn, ("sync", sync), Peer(None, "engine"), f"the marker of sync {sync}")
            return self.bucket.send(items, _Watched(conn, failed), timeout=self.timeout)

        report: SyncReport = _concurrently(
            lambda: update(info), send, self.timeout, "update_weights"
        )
        return report

    def close(self) -> None:
        """Close the connection and free the bucket. Idempotent."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.close()
            self._conn = None
        self.bucket.close()
