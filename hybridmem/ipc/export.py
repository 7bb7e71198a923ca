"""Any CUDA tensor to another process, zero copy, without ``pidfd_getfd``: :func:`ipc_export`.

A tensor in a **classic** segment goes the way torch sends it (``cudaIpcGetMemHandle``;
no pidfd needed). A tensor in an **expandable** segment is made of physical
allocations (pages) that torch would export as POSIX fds and let the consumer
copy out of the producer with ``pidfd_getfd``, which a container's seccomp
profile denies (pytorch#165685, verl #2846). :func:`ipc_export` exports those
pages as fds itself and the consumer's :meth:`TensorHandle.open` receives them
over a Unix socket (``SCM_RIGHTS``: no ptrace right needed), maps them at an
address of its own and wraps a tensor there: the same device memory, no copy.

Lifetimes: the producer keeps the tensor's storage referenced (so torch neither
reuses nor unmaps it) until the consumer's tensor is freed or the consumer's
process ends (:mod:`hybridmem.ipc.fd_server`); the consumer unmaps what it
mapped when its last view of the tensor dies. Security: only the intended
consumer gets the fds (see ``docs/ipc.md``).

Scope: process-global server (one per producer process); handles are one-time
(one :meth:`~TensorHandle.open` each; export again for another consumer).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from hybridmem import _torch
from hybridmem._checks import check_number, check_seconds
from hybridmem._errors import IpcUnavailableError
from hybridmem._format import fmt_bytes
from hybridmem._log import logger
from hybridmem._names import suggests_keywords
from hybridmem._platform import cuda_vmm, linux, unix_socket
from hybridmem.ipc import fd_server

__all__ = ["HandleKind", "TensorHandle", "ipc_export", "open_handles"]

HandleKind = Literal["cuda", "fd"]
PROTOCOL = 1
DEFAULT_EXPORT_TIMEOUT_S = 300.0
DEFAULT_OPEN_TIMEOUT_S = 60.0
_TOKEN_BYTES = 32

_open_lock = threading.Lock()
_open_count = 0


@suggests_keywords
@dataclass(frozen=True)
class TensorHandle:
    """A picklable handle to one CUDA tensor of another process; :meth:`open` it once.

    Made by :func:`ipc_export`. ``kind`` is ``"cuda"`` (a classic segment, sent
    the way ``torch.multiprocessing`` sends it) or ``"fd"`` (an expandable
    segment, its pages' fds passed over a Unix socket).

    The token is a secret (it lets its holder map the memory read-write); it is
    left out of ``repr`` and must only travel to the intended consumer.
    """

    kind: HandleKind
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    requires_grad: bool
    device_uuid: str | None
    producer_pid: int
    boot_id: str | None
    pid_namespace: str | None
    torch_export: tuple[Any, tuple[Any, ...]] | None = field(default=None, repr=False)
    address: bytes = field(default=b"", repr=False)
    token: bytes = field(default=b"", repr=False)
    pages: tuple[int, ...] = ()
    offset: int = 0
    nbytes: int = 0
    event: bytes | None = field(default=None, repr=False)
    protocol: int = PROTOCOL

    def open(self, *, timeout: float | None = DEFAULT_OPEN_TIMEOUT_S) -> torch.Tensor:
        """Return a tensor over the producer's memory (zero copy), on the same GPU.

        The GPU is found by UUID, so different ``CUDA_VISIBLE_DEVICES`` in the two
        processes do not matter. For ``"fd"`` handles no ``pidfd_getfd`` is made:
        this works under a seccomp profile that denies it. Before the tensor is
        returned the current stream waits for the producer's writes that were
        queued before the export. The producer's memory stays valid while the
        tensor (or any view of it) lives; dropping it unmaps and tells the producer.

        Args:
            timeout: seconds to wait for the producer (None: no bound).

        Returns:
            The tensor, with the exported dtype, shape, strides and
            ``requires_grad``.

        Raises:
            IpcUnavailableError: it cannot be opened here; the message says why
                (another machine, GPU not visible, the producer gone, the handle
                already opened or expired, the driver refusing) and what to do.
            TimeoutError: the producer did not answer within ``timeout``.

        Scope: the current thread; the tensor is on the producer's GPU.

        Example:
            >>> tensor = handle.open()   # doctest: +SKIP
        """
        check_number(
            "timeout", 1.0 if timeout is None else timeout, above=0, expected="seconds or None"
        )
        if self.protocol != PROTOCOL:
            raise IpcUnavailableError(
                f"this handle speaks protocol {self.protocol}, this hybridmem {PROTOCOL}: run "
                "the same hybridmem version in producer and consumer"
            )
        mine = linux.boot_id()
        if self.boot_id is not None and mine is not None and mine != self.boot_id:
            raise IpcUnavailableError(
                f"this tensor was exported on another machine (boot id {self.boot_id}, "
                f"here {mine}, host {socket.gethostname()}): device memory can be shared "
                "only between processes of one host; send it over NCCL or copy it to the "
                "host instead"
            )
        index = _device_of(self)
        if self.kind == "cuda":
            assert self.torch_export is not None
            rebuild, args = self.torch_export
            try:
                return _torch.import_cuda_tensor(rebuild, args, index)
            except RuntimeError as exc:
                raise IpcUnavailableError(
                    f"cannot open the producer's (pid {self.producer_pid}) CUDA IPC handle: "
                    f"{exc}; see hm.ipc_capabilities() here"
                ) from exc
        if self.nbytes == 0:
            return _empty_like_handle(self, index)
        return _open_fd(self, index, timeout)

    def withdraw(self) -> bool:
        """In the producer: withdraw this export if no consumer opened it yet.

        Returns:
            True if it was pending (its fds are closed and the storage let go);
            False if it was opened, expired, withdrawn before, or is a ``"cuda"``
            handle (torch owns those).
        """
        if self.kind != "fd" or not self.token or self.producer_pid != os.getpid():
            return False
        return fd_server.withdraw(fd_server.digest(self.token))


def _device_of(handle: TensorHandle) -> int:
    if not _torch.cuda_available():
        raise IpcUnavailableError(
            "no CUDA device is visible in this process; open the handle in a process "
            f"that sees GPU {handle.device_uuid}"
        )
    index = _torch.device_index_by_uuid(handle.device_uuid) if handle.device_uuid else None
    if index is None:
        visible = [_torch.device_uuid(i) for i in range(_torch.device_count())]
        raise IpcUnavailableError(
            f"the producer's GPU {handle.device_uuid} is not visible in this process "
            f"(visible: {visible or 'none'}); give it a CUDA_VISIBLE_DEVICES that includes it"
        )
    return index


def _empty_like_handle(handle: TensorHandle, index: int) -> torch.Tensor:
    tensor = torch.empty_strided(
        handle.shape, handle.stride, dtype=handle.dtype, device=torch.device("cuda", index)
    )
    return tensor.requires_grad_(handle.requires_grad)


# --------------------------------------------------------------------------- #
# Producer
# --------------------------------------------------------------------------- #


@suggests_keywords
def ipc_export(
    tensor: torch.Tensor,
    *,
    consumer_pid: int | None = None,
    timeout: float | None = DEFAULT_EXPORT_TIMEOUT_S,
) -> TensorHandle:
    """Export a CUDA tensor for one consumer process; it opens the handle with ``.open()``.

    A tensor in a classic segment is exported as ``torch.multiprocessing`` does
    (CUDA IPC, no pidfd needed). A tensor in an expandable segment is exported
    by passing its pages' file descriptors over a Unix socket, so a consumer
    that may not call ``pidfd_getfd`` (a default container seccomp profile, Yama
    ``ptrace_scope`` 1 and above) still gets the same memory, with no copy.

    Only the intended consumer gets the descriptors: the socket is in the
    abstract namespace under a random name and listens only while an export
    waits to be opened; a peer of another uid (``SO_PEERCRED``), without the
    handle's one-time token, or (with ``consumer_pid``) of another pid is
    refused and logged. The producer keeps the storage alive until the
    consumer's tensor is freed or the consumer exits.

    Args:
        tensor: a CUDA tensor (any dtype, shape, strides, storage offset).
        consumer_pid: the only process allowed to open it (None: any process of
            this user that holds the handle).
        timeout: seconds after which an unopened ``"fd"`` export is withdrawn
            (None: never; :meth:`TensorHandle.withdraw` withdraws it by hand).

    Returns:
        A picklable :class:`TensorHandle`, good for one :meth:`~TensorHandle.open`.

    Raises:
        TypeError: ``tensor`` is not a dense CUDA tensor.
        ValueError: bad ``consumer_pid`` or ``timeout``.
        IpcUnavailableError: the memory cannot be exported; the message names the
            cause (``cudaMallocAsync`` pool, ``TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC=0``,
            a driver without the virtual memory API) and the fix.

    Scope: the tensor's device; thread-safe.

    Example:
        >>> with hm.expandable_segments(True):          # doctest: +SKIP
        ...     weight = torch.randn(1 << 26, device="cuda")
        >>> # the consumer opens it with conn.recv().open()
        >>> conn.send(hm.ipc_export(weight))  # doctest: +SKIP
    """
    if consumer_pid is not None:  # the arguments first: each error names its own
        check_number("consumer_pid", consumer_pid, integer=True, minimum=1, maximum=2**31 - 1)
    if timeout is not None:
        check_seconds("timeout", timeout)
    _check_exportable(tensor)
    index = tensor.device.index if tensor.device.index is not None else 0
    meta: dict[str, Any] = {
        "dtype": tensor.dtype,
        "shape": tuple(tensor.shape),
        "stride": tuple(tensor.stride()),
        "storage_offset": int(tensor.storage_offset()),
        "requires_grad": bool(tensor.requires_grad),
        "device_uuid": _torch.device_uuid(index),
        "producer_pid": os.getpid(),
        "boot_id": linux.boot_id(),
        "pid_namespace": linux.pid_namespace(),
    }
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:
        return TensorHandle(kind="fd", **meta)
    legacy = _torch.is_legacy_ipc_capable(tensor)
    if legacy is None and _torch.runtime_allocator_backend() == "cudaMallocAsync":
        raise IpcUnavailableError(_ASYNC_POOL)
    if legacy is not False:
        return TensorHandle(kind="cuda", torch_export=_torch.export_cuda_tensor(tensor), **meta)
    return _export_fd(tensor, storage, index, meta, consumer_pid, timeout)


_ASYNC_POOL = (
    "this tensor comes from a cudaMallocAsync pool "
    "(PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync), which cannot be exported; "
    "use the native allocator, or copy the tensor with hm.ipc_shareable()"
)


def _check_exportable(tensor: object) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"ipc_export() takes a torch.Tensor, got {type(tensor).__name__}")
    if not _torch.is_device_tensor(tensor):
        raise TypeError(
            f"ipc_export() takes CUDA tensors, got one on {tensor.device}; host tensors "
            "share through torch.multiprocessing (tensor.share_memory_())"
        )
    if (
        tensor.layout != torch.strided
        or tensor.is_quantized
        or callable(getattr(tensor, "to_local", None))
    ):
        raise TypeError(
            f"ipc_export() takes dense tensors, got layout {tensor.layout} "
            f"({type(tensor).__name__}); export tensor.to_local() or a dense copy"
        )


def _pages(address: int, nbytes: int) -> list[tuple[int, int]]:
    """The physical allocations that hold ``[address, address + nbytes)``, in order."""
    pages: list[tuple[int, int]] = []
    cursor, end = address, address + nbytes
    while cursor < end:
        base, size = cuda_vmm.allocation_range(cursor)
        if size <= 0 or base > cursor or (pages and base != pages[-1][0] + pages[-1][1]):
            raise IpcUnavailableError(
                f"the memory at {cursor:#x} is not laid out as whole pages side by side "
                f"(the driver says {size} bytes at {base:#x}); copy the tensor with "
                "hm.ipc_shareable() instead"
            )
        pages.append((base, size))
        cursor = base + size
    return pages


def _export_pages(
    tensor: torch.Tensor, storage: torch.UntypedStorage, index: int
) -> tuple[list[tuple[int, int]], list[int], Any, bytes]:
    """Export the storage's pages as fds; record an event after its queued writes.

    Returns ``(pages, fds, event, event handle)``; the caller owns the fds and
    keeps the event alive until the consumer opened it. Runs with the device's
    context current.

    Raises:
        IpcUnavailableError: not exportable as file descriptors (the message says why).
        DriverError: a driver call failed.
    """
    address, nbytes = storage.data_ptr(), storage.nbytes()
    types = cuda_vmm.allowed_handle_types(address)
    if types is not None and not types & cuda_vmm.HANDLE_TYPE_POSIX_FD:
        raise IpcUnavailableError(
            f"this tensor's memory was not created exportable as a file descriptor "
            f"(allowed handle types {types:#x}): torch makes expandable segments "
            "exportable unless TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC=0 is set (unset it), "
            "and memory of cudaMallocAsync pools is not; or copy the tensor with "
            "hm.ipc_shareable()"
        )
    pages = _pages(address, nbytes)
    fds: list[int] = []
    try:
        for base, _ in pages:
            fds.append(cuda_vmm.export_fd(base))
        with torch.cuda.device(index):
            event = _torch.new_ipc_event(index)
            _torch.record_event(event, _torch.current_stream(tensor.device))
            handle = _torch.ipc_event_handle(event)
    except BaseException:
        unix_socket.close_fds(fds)
        raise
    return pages, fds, event, handle


def _export_fd(
    tensor: torch.Tensor,
    storage: torch.UntypedStorage,
    index: int,
    meta: dict[str, Any],
    consumer_pid: int | None,
    timeout: float | None,
) -> TensorHandle:
    if not cuda_vmm.has_vmm():
        raise IpcUnavailableError(
            "the CUDA driver lacks the virtual memory API (cuMemExportToShareableHandle, "
            "CUDA 10.2+): update the driver, or put the tensor in a classic segment "
            "(hm.ipc_shareable(), hm.ipc_safe())"
        )
    try:
        with cuda_vmm.on_device(index):  # any thread: a queue's feeder has no context
            pages, fds, event, event_handle = _export_pages(tensor, storage, index)
    except cuda_vmm.DriverError as exc:
        raise IpcUnavailableError(
            f"the driver refused to export this tensor's memory as file descriptors "
            f"({exc}); copy it with hm.ipc_shareable() instead"
        ) from exc
    address, nbytes = storage.data_ptr(), storage.nbytes()
    token = secrets.token_bytes(_TOKEN_BYTES)
    export = fd_server.Export(
        key=fd_server.digest(token),
        fds=fds,
        keep=(storage, event),
        nbytes=nbytes,
        deadline=None if timeout is None else time.monotonic() + timeout,
        consumer_pid=consumer_pid,
    )
    try:
        socket_address = fd_server.offer(export)
    except BaseException:  # no socket: nothing may stay exported
        export.drop()
        raise
    logger.debug(
        "ipc_export: %s in %d pages offered by fd (consumer pid %s)",
        fmt_bytes(nbytes),
        len(pages),
        consumer_pid,
    )
    return TensorHandle(
        kind="fd",
        address=socket_address,
        token=token,
        pages=tuple(size for _, size in pages),
        offset=address - pages[0][0],
        nbytes=nbytes,
        event=event_handle,
        **meta,
    )


# --------------------------------------------------------------------------- #
# Consumer
# --------------------------------------------------------------------------- #


class _Lease:
    """What one opened ``"fd"`` handle holds in the consumer, let go once."""

    def __init__(self, sock: socket.socket, pages: cuda_vmm.PageMap, index: int) -> None:
        self.sock = sock
        self.pages = pages
        self.index = index
        self.context = cuda_vmm.primary_context(index)
        self._done = False
        self._lock = threading.Lock()
        _count(+1)

    def release(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        try:
            # Work queued on any stream may still read or write the pages.
            cuda_vmm.synchronize_context(self.context)
            self.pages.close()
        except cuda_vmm.DriverError as exc:
            logger.warning("hybridmem: unmapping an opened tensor failed: %s", exc)
        finally:
            with contextlib.suppress(cuda_vmm.DriverError, KeyError):
                cuda_vmm.release_primary_context(self.index)
            with contextlib.suppress(OSError):
                self.sock.send(fd_server.RELEASE)
            self.sock.close()
            _count(-1)


def _count(delta: int) -> None:
    global _open_count
    with _open_lock:
        _open_count += delta


def open_handles() -> int:
    """Return how many ``"fd"`` handles this process has open (their tensors alive).

    Example:
        >>> open_handles()   # doctest: +SKIP
        0
    """
    with _open_lock:
        return _open_count


def _refused(handle: TensorHandle, why: str) -> IpcUnavailableError:
    return IpcUnavailableError(
        f"cannot open the tensor exported by pid {handle.producer_pid}: {why}"
    )


def _connect(handle: TensorHandle, timeout: float | None) -> socket.socket:
    try:
        sock = unix_socket.connect(handle.address, timeout)
    except (ConnectionRefusedError, FileNotFoundError):
        raise _refused(
            handle,
            "nobody listens at its socket: the producer exited, or the handle was "
            "already opened (each handle opens once), withdrawn or expired; export the "
            "tensor again. A consumer in another network namespace cannot reach the "
            "producer's abstract socket either (share the namespace, e.g. one pod)",
        ) from None
    except OSError as exc:
        if exc.errno == 24:  # EMFILE
            raise _refused(
                handle,
                "this process has no file descriptor left (each open tensor holds one "
                "until it is freed): raise the limit (ulimit -n) or free tensors first",
            ) from exc
        raise
    pid, _uid, _gid = unix_socket.peer_credentials(sock)
    same_ns = handle.pid_namespace is not None and handle.pid_namespace == linux.pid_namespace()
    if same_ns and pid != handle.producer_pid:
        sock.close()
        raise _refused(
            handle, f"its socket is held by pid {pid}, not the producer; nothing was read"
        )
    return sock


def _open_fd(handle: TensorHandle, index: int, timeout: float | None) -> torch.Tensor:
    if not cuda_vmm.has_vmm():
        raise _refused(handle, "this CUDA driver lacks the virtual memory API (CUDA 10.2+)")
    sock = _connect(handle, timeout)
    try:
        try:
            sock.sendall(fd_server.HELLO + handle.token)
            data, fds = unix_socket.receive_with_fds(sock, 64, len(handle.pages) + 1)
        except TimeoutError:
            raise TimeoutError(
                f"the producer (pid {handle.producer_pid}) did not answer in {timeout} s"
            ) from None
        except (ConnectionResetError, BrokenPipeError):
            # The listener closed while this connection waited in its backlog: the
            # export was withdrawn, expired or opened by another process just now.
            data, fds = b"", []
        try:
            if data != fd_server.OK:
                raise _refused(
                    handle,
                    "the producer refused it (already opened by another process, "
                    "withdrawn, expired, or exported for another consumer_pid); the "
                    "producer's log says which",
                )
            if len(fds) != len(handle.pages):
                raise _refused(handle, f"got {len(fds)} fds for {len(handle.pages)} pages")
            with cuda_vmm.on_device(index):  # the caller's thread may have no context
                pages = cuda_vmm.PageMap.open(fds, handle.pages, index)
        except cuda_vmm.DriverError as exc:
            raise _refused(handle, f"mapping its memory failed ({exc})") from exc
        finally:
            unix_socket.close_fds(fds)  # the mapping holds the memory, not the fds
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    lease = _Lease(sock, pages, index)
    try:
        device = torch.device("cuda", index)
        if handle.event is not None:
            event = _torch.open_ipc_event(index, handle.event)
            _torch.wait_event(_torch.current_stream(device), event)
        base = _torch.tensor_from_memory(
            pages.address + handle.offset, handle.nbytes, index, lease.release
        )
    except BaseException:
        lease.release()
        raise
    return _view(base, handle)


def _view(base: torch.Tensor, handle: TensorHandle) -> torch.Tensor:
    itemsize = handle.dtype.itemsize
    words = base[: handle.nbytes // itemsize * itemsize].view(handle.dtype)
    tensor = words.as_strided(handle.shape, handle.stride, handle.storage_offset)
    if handle.requires_grad:
        tensor.requires_grad_(True)
    return tensor
