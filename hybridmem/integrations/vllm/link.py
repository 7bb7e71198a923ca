"""The vLLM backend's two endpoints over a WeightBucket, without importing vLLM.

vLLM drives a weight update through its control plane, one blocking call at a time
(``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
``finish_weight_update``); the data goes another way. Here it goes through one
:class:`~hybridmem.WeightBucket`, allocated and exported once:

1. :class:`TrainerLink` allocates the bucket and listens on a fresh abstract Unix
   socket; :meth:`TrainerLink.init_info` (address, one-time token, timeout) is
   JSON-native, so it rides vLLM's in-process, HTTP and Ray clients alike.
2. :class:`EngineLink` (in vLLM's worker, from ``init_weight_transfer_engine``)
   connects, proves the token, opens the bucket and answers with the names and
   shapes its model takes (its checkpoint's safetensors headers: see
   :mod:`~hybridmem.integrations.vllm.schema`). The trainer then checks every sync
   against them before sending a byte.
3. Each sync is the bucket's own protocol over that connection, while vLLM's
   ``update_weights`` call waits in the worker. The worker holds every tensor of
   the sync and checks them before anything is loaded: a trainer that dies, times
   out or sends a wrong name or shape leaves the model untouched, serving its
   previous weights.

Transports are the bucket's (``"cuda"``, ``"fd"``, ``"host"``, chosen as
:class:`~hybridmem.WeightBucket` chooses). Host buffers' names are unlinked as soon
as the engine opened them, and the engine lets go of the buffers when the trainer
exits (a watcher on its pid), so nothing outlives the two processes.

Scope: one trainer link serves one engine worker (tensor and pipeline parallel size
1); each link's methods are called from one thread at a time.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import secrets
import select
import socket
import threading
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import Any

import torch

from hybridmem._checks import check_bool, check_number
from hybridmem._devices import DeviceArg
from hybridmem._errors import SyncError
from hybridmem._log import logger
from hybridmem._platform import unix_socket
from hybridmem.integrations.vllm.schema import Schema, check_weights
from hybridmem.ipc._wire import BucketHandle, Peer, PeerAborted, recv_within
from hybridmem.ipc.bucket import SyncReport, TransportChoice, WeightBucket
from hybridmem.ipc.receiver import BucketReceiver
from hybridmem.ipc.shareable import Fallback
from hybridmem.memory.release import release_cache

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "PROTOCOL",
    "EngineLink",
    "TrainerLink",
    "Weights",
    "parse_init_info",
]

#: The link's message protocol (on top of the bucket's own).
PROTOCOL = 1
#: How long either side waits for the other, per message and per control call (s).
DEFAULT_TIMEOUT_S = 120.0
_PREFIX = b"hybridmem-vllm-"
_TOKEN_BYTES = 16
_INIT_KEYS = frozenset({"address", "token", "timeout", "protocol", "transport", "keep_staging"})
_WATCH_SLICE_S = 1.0  # how often the engine's trainer watcher checks that it is wanted

Weights = list[tuple[str, torch.Tensor]]


def _check_timeout(timeout: object) -> float:
    # Every wait is bounded here: None is refused (a hung peer must end in an error).
    return float(check_number("timeout", timeout, above=0, expected="a number of seconds > 0"))


def _concurrently(
    call: Callable[[], object], work: Callable[[], Any], timeout: float, what: str
) -> Any:
    """Run vLLM's blocking control call in a thread while this thread does ``work``.

    vLLM's ``update_weights`` returns only once the worker has loaded the weights,
    which it cannot do before this side sent them: both must run at once (vLLM's
    NCCL backend does the same). Returns ``work``'s result; the call's error, if
    any, wins (it is the engine's word on what went wrong).
    """
    failure: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # reported to the caller below
            failure.append(exc)

    thread = threading.Thread(target=run, name=f"hybridmem-vllm-{what}", daemon=True)
    thread.start()
    try:
        result = work()
    except PeerAborted:
        # The engine stopped the sync: its own error says why (this one only echoes it).
        thread.join(timeout)
        if failure:
            raise failure[0] from None
        raise
    except BaseException:
        # This side failed (its abort reached the engine, which ends its call).
        thread.join(timeout)
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


class TrainerLink:
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
        >>> link.connect(lambda info: llm.init_weight_transfer_engine({"init_info": info}))
        >>> link.sync(model.state_dict(), lambda info: llm.update_weights({"update_info": info}))
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
        self.timeout = _check_timeout(timeout)
        self.keep_staging = check_bool("keep_staging", keep_staging)
        self.bucket = WeightBucket(
            bucket_bytes, device, buffers=buffers, transport=transport, fallback=fallback
        )
        self.schema: dict[str, tuple[int, ...]] | None = None
        self.engine_pid: int | None = None
        self._token = secrets.token_bytes(_TOKEN_BYTES)
        self._address = unix_socket.new_address(_PREFIX)
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

    def _accept(self) -> None:
        assert self._listener is not None
        readable, _, _ = select.select([self._listener], [], [], self.timeout)
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
                conn.recv_bytes(maxlength=_TOKEN_BYTES), self._token
            ):
                raise SyncError("the connecting process did not present this link's token")
            conn.send(("bucket", PROTOCOL, self.bucket.handle))
            message = recv_within(conn, self.timeout, peer, "the engine's ready")
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
    ) -> SyncReport:
        """Check, then send ``named`` while ``update(update_info)`` (vLLM's RPC) receives them.

        Returns:
            The bucket's :class:`SyncReport`.

        Raises:
            ValueError: a name or shape the engine's model does not take; nothing sent.
            SyncError: the engine died, closed the link or did not answer in time.
            RuntimeError: not connected, or the engine refused the update (its error).
        """
        if self._conn is None:
            raise RuntimeError("this TrainerLink has no engine: call connect() first")
        items = self.bucket.check(named)  # refused here, before vLLM is told anything
        self.check(items)
        self._syncs += 1
        info = {"sync": self._syncs, "tensors": len(items), "weight_version": weight_version}
        conn = self._conn
        report: SyncReport = _concurrently(
            lambda: update(info),
            lambda: self.bucket.send(items, conn, timeout=self.timeout),
            self.timeout,
            "update_weights",
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

    def __enter__(self) -> TrainerLink:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def parse_init_info(info: Mapping[str, Any]) -> tuple[bytes, bytes, float, bool]:
    """Validate a trainer's ``init_info``; return (address, token, timeout, keep_staging).

    Raises:
        ValueError: a missing, unknown or malformed key (named), or another protocol.
    """
    if not isinstance(info, Mapping):
        raise ValueError(f"init_info must be a dict, got {type(info).__name__}")
    missing = sorted(_INIT_KEYS - set(info))
    unknown = sorted(set(info) - _INIT_KEYS)
    if missing or unknown:
        raise ValueError(
            f"init_info for the hybridmem backend: missing {missing}, unknown {unknown}; "
            "pass TrainerLink.init_info() unchanged (the trainer side builds it)"
        )
    if info["protocol"] != PROTOCOL:
        raise ValueError(
            f"the trainer speaks link protocol {info['protocol']!r}, this engine {PROTOCOL}: "
            "install the same hybridmem version on both sides"
        )
    try:
        address = b"\0" + str(info["address"]).encode()
        token = bytes.fromhex(str(info["token"]))
    except ValueError as exc:
        raise ValueError(f"init_info has a malformed token: {exc}") from None
    if not address.startswith(b"\0" + _PREFIX) or len(token) != _TOKEN_BYTES:
        raise ValueError(f"init_info's address {info['address']!r} or token is not the trainer's")
    if not isinstance(info["keep_staging"], bool):
        raise ValueError(f"init_info's keep_staging must be a bool, got {info['keep_staging']!r}")
    return address, token, _check_timeout(info["timeout"]), info["keep_staging"]


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
        >>> link.update(model.load_weights)   # one whole sync, checked, then applied
    """

    def __init__(
        self,
        init_info: Mapping[str, Any],
        device: torch.device,
        schema: Schema | None = None,
    ) -> None:
        address, token, self.timeout, self.keep_staging = parse_init_info(init_info)
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
        try:
            conn.send_bytes(token)
            message = recv_within(conn, self.timeout, Peer(trainer_pid, "trainer"), "the bucket")
            if not (isinstance(message, tuple) and len(message) == 3 and message[0] == "bucket"):
                raise SyncError(f"unexpected first message from the trainer: {message!r}")
            handle = message[2]
            if not isinstance(handle, BucketHandle):
                raise SyncError(f"the trainer sent {type(handle).__name__}, not a bucket handle")
            self.receiver = BucketReceiver(handle, _receiver_device(device, handle))
            shapes = None if self.schema is None else {k: list(v) for k, v in self.schema.items()}
            conn.send(("ready", os.getpid(), shapes))
        except BaseException:
            conn.close()
            raise
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

    def update(self, apply: Callable[[Weights], object]) -> int:
        """Receive one whole sync, check it, then call ``apply(weights)`` once.

        Nothing reaches ``apply`` unless every tensor arrived and fits the schema, so
        a failed sync leaves the model as it was. That costs one copy of the sync on
        the link's device while it is applied (the price of never loading half a
        model); it goes back to the driver afterwards, so the engine's own pools
        (vLLM's KV cache, waking next) can take it.

        Returns:
            How many tensors were applied.

        Raises:
            ValueError: a name or shape the model does not take (nothing applied).
            SyncError: the trainer died, timed out or aborted (nothing applied); if
                it died, the link is closed: the trainer must connect a new one.
            RuntimeError: the link is closed.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError(
                    f"the hybridmem link to trainer pid {self.trainer_pid} is closed (the "
                    "trainer exited or the link was shut down): initialise a new one "
                    "(init_weight_transfer_engine); the model keeps its weights"
                )
            try:
                weights = list(self.receiver.receive(self._conn, timeout=self.timeout))
            except (SyncError, RuntimeError) as exc:
                # A closed channel ends the link as surely as a dead pid (the process
                # may still be exiting when its socket is already shut).
                broken = isinstance(exc.__cause__, (EOFError, OSError))
                gone = broken or not Peer(self.trainer_pid, "trainer").alive()
                if gone:
                    self._close_locked()
                raise SyncError(
                    f"the weight sync failed before anything was loaded ({exc}); the model "
                    "keeps its previous weights"
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

    def _watch(self) -> None:
        """Let go of the buffers once the trainer exits (SIGKILL included)."""
        peer = Peer(self.trainer_pid, "trainer")
        try:
            while not self._closed:
                if not peer.alive():
                    with self._lock:
                        if not self._closed:
                            logger.info(
                                "vLLM link: trainer pid %d exited; its buffers are let go",
                                self.trainer_pid,
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
    if handle.transport != "host":
        raise ValueError(
            f"the trainer's bucket is {handle.transport!r} (device memory) but this worker "
            f"runs on {device}: start the trainer with transport='host'"
        )
    return None
