"""Fd passing on the CPU: sockets, the producer's server, handles, the queue reducer.

The CUDA parts (export of pages, import and mapping) are monkeypatched with host
memory here; tests/gpu/test_fd_ipc_gpu.py runs them for real on the H200.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import pickle
import socket
import threading
import weakref
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from typing import Any, ClassVar

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hybridmem as hm
from hybridmem import _torch
from hybridmem._platform import cuda_driver, cuda_vmm, linux, unix_socket
from hybridmem._platform.stdlib import forking_reducer
from hybridmem._torch import dlpack
from hybridmem.ipc import capabilities, fd_reducer, fd_server
from hybridmem.ipc import export as export_module
from hybridmem.ipc.export import TensorHandle
from tests.helpers import run_python

WAIT_S = 10.0  # bound on every wait for the server thread (it answers in microseconds)


class Kept:
    """Stands in for a tensor's storage: its death is what a lease's end looks like."""

    def __init__(self) -> None:
        self.gone = threading.Event()
        weakref.finalize(self, self.gone.set)


def memfd(data: bytes) -> int:
    fd = os.memfd_create("hybridmem-test")
    os.write(fd, data)
    return fd


def offer(
    datas: list[bytes], *, consumer_pid: int | None = None, deadline: float | None = None
) -> tuple[bytes, bytes, threading.Event]:
    """Offer an export of memfds holding ``datas``; return (address, token, gone event)."""
    token = os.urandom(32)
    kept = Kept()
    gone = kept.gone
    export = fd_server.Export(
        key=fd_server.digest(token),
        fds=[memfd(d) for d in datas],
        keep=(kept,),
        nbytes=sum(map(len, datas)),
        deadline=deadline,
        consumer_pid=consumer_pid,
    )
    del kept
    return fd_server.offer(export), token, gone


def hello(address: bytes, token: bytes, maxfds: int = 4) -> tuple[socket.socket, bytes, list[int]]:
    sock = unix_socket.connect(address, WAIT_S)
    try:
        sock.sendall(fd_server.HELLO + token)
        data, fds = unix_socket.receive_with_fds(sock, 64, maxfds)
    except (ConnectionResetError, BrokenPipeError):  # the listener closed meanwhile
        data, fds = b"", []
    except BaseException:
        sock.close()
        raise
    return sock, data, fds


def stranger(address: bytes, token: bytes) -> tuple[bytes, list[int]]:
    """Connect and try ``token``: what a refused peer gets (the server may hang up first)."""
    try:
        sock = unix_socket.connect(address, WAIT_S)
    except (ConnectionRefusedError, FileNotFoundError):
        return b"", []
    try:
        sock.sendall(fd_server.HELLO + token)
        return unix_socket.receive_with_fds(sock, 64, 4)
    except (BrokenPipeError, ConnectionResetError):
        return b"", []
    finally:
        sock.close()


def read_fd(fd: int, size: int) -> bytes:
    return os.pread(fd, size, 0)


@pytest.fixture(autouse=True)
def _quiet_server() -> Iterator[None]:
    yield
    stats = fd_server.server_stats()
    assert stats.pending == 0, "a test left an export pending"


# --------------------------------------------------------------------------- #
# unix_socket
# --------------------------------------------------------------------------- #


def test_fds_pass_and_the_peer_is_named() -> None:
    address = unix_socket.new_address()
    assert address.startswith(b"\0" + unix_socket.PREFIX)
    assert address != unix_socket.new_address()
    listener = unix_socket.listen(address)
    client = unix_socket.connect(address, WAIT_S)
    listener.setblocking(True)
    server, _ = listener.accept()
    try:
        pid, uid, gid = unix_socket.peer_credentials(server)
        assert (pid, uid, gid) == (os.getpid(), os.getuid(), os.getgid())
        fd = memfd(b"payload")
        unix_socket.send_with_fds(server, b"here", [fd])
        os.close(fd)
        data, fds = unix_socket.receive_with_fds(client, 16, 2)
        assert data == b"here"
        assert len(fds) == 1
        assert read_fd(fds[0], 7) == b"payload"  # the same file, a new descriptor
        unix_socket.close_fds(fds + fds)  # closing twice is harmless
    finally:
        for sock in (client, server, listener):
            sock.close()


def test_connect_to_nobody_is_refused() -> None:
    with pytest.raises(ConnectionRefusedError):
        unix_socket.connect(unix_socket.new_address(), 1.0)


# --------------------------------------------------------------------------- #
# fd_server: only the token holder gets the fds; leases hold the storage
# --------------------------------------------------------------------------- #


def test_the_token_holder_gets_the_fds_then_nothing_listens() -> None:
    address, token, gone = offer([b"a" * 10, b"b" * 20])
    assert fd_server.server_stats().listening
    sock, data, fds = hello(address, token)
    try:
        assert data == fd_server.OK
        assert [read_fd(fd, 30) for fd in fds] == [b"a" * 10, b"b" * 20]
        stats = fd_server.server_stats()
        assert (stats.pending, stats.leases, stats.leased_bytes) == (0, 1, 30)
        assert not stats.listening  # no export pending: the listener is closed
        with pytest.raises(ConnectionRefusedError):
            unix_socket.connect(address, 1.0)
        assert not gone.is_set()  # leased: the storage is held
        sock.send(fd_server.RELEASE)
        assert gone.wait(WAIT_S)
    finally:
        unix_socket.close_fds(fds)
        sock.close()


def test_the_listener_closes_before_the_last_fds_leave(monkeypatch: pytest.MonkeyPatch) -> None:
    # The consumer runs on as soon as its fds arrive; had the listener closed only
    # after the send, a second open could still reach it (CI once saw "refused"
    # where "nobody listens" was due). Record what was listening at each send.
    real_send = unix_socket.send_with_fds
    listening_at_send: list[bool] = []

    def send(sock: socket.socket, data: bytes, fds: list[int]) -> None:
        listening_at_send.append(fd_server._SERVER._listener is not None)  # lock held
        real_send(sock, data, fds)

    monkeypatch.setattr(unix_socket, "send_with_fds", send)
    first, second = offer([b"1"]), offer([b"2"])
    for address, token, gone in (first, second):
        sock, data, fds = hello(address, token)
        assert data == fd_server.OK
        unix_socket.close_fds(fds)
        sock.close()
        assert gone.wait(WAIT_S)
    assert listening_at_send == [True, False]  # the other export kept it; the last did not


def test_a_consumer_that_dies_ends_its_lease() -> None:
    address, token, gone = offer([b"x"])
    sock, data, fds = hello(address, token)
    unix_socket.close_fds(fds)
    assert data == fd_server.OK
    sock.close()  # what the kernel does for a process that exits or crashes
    assert gone.wait(WAIT_S)


@pytest.mark.parametrize("token", [b"", b"\0" * 32, b"short"])
def test_strangers_get_nothing_and_are_logged(
    token: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    address, real, gone = offer([b"secret"])
    caplog.set_level(logging.WARNING, logger="hybridmem")
    assert stranger(address, token) == (b"", [])
    assert any("refused pid" in r.getMessage() for r in caplog.records)
    assert fd_server.server_stats().pending == 1  # still there for the right consumer
    sock, data, fds = hello(address, real)
    assert data == fd_server.OK
    assert len(fds) == 1
    unix_socket.close_fds(fds)
    sock.close()
    assert gone.wait(WAIT_S)


def test_a_peer_of_another_uid_is_refused(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    address, token, gone = offer([b"secret"])
    caplog.set_level(logging.WARNING, logger="hybridmem")
    real_uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: real_uid + 1)
    assert stranger(address, token) == (b"", [])
    assert any("only this user" in r.getMessage() for r in caplog.records)
    monkeypatch.undo()
    sock, data, fds = hello(address, token)
    assert data == fd_server.OK
    unix_socket.close_fds(fds)
    sock.close()
    assert gone.wait(WAIT_S)


def test_an_export_for_one_pid_refuses_others() -> None:
    address, token, gone = offer([b"x"], consumer_pid=os.getpid() + 1_000_000)
    assert stranger(address, token) == (b"", [])
    assert fd_server.withdraw(fd_server.digest(token))
    assert gone.wait(WAIT_S)
    assert not fd_server.withdraw(fd_server.digest(token))  # once only
    address, token, gone = offer([b"y"], consumer_pid=os.getpid())
    sock, data, fds = hello(address, token)
    assert data == fd_server.OK
    unix_socket.close_fds(fds)
    sock.close()
    assert gone.wait(WAIT_S)


def test_an_unopened_export_expires(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="hybridmem")
    _address, _token, gone = offer([b"x"], deadline=0.0)  # already due
    assert gone.wait(WAIT_S)
    assert fd_server.server_stats().pending == 0
    assert any("not opened in time" in r.getMessage() for r in caplog.records)


def test_a_silent_peer_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fd_server, "HANDSHAKE_TIMEOUT_S", 0.05)
    address, token, gone = offer([b"x"])
    silent = unix_socket.connect(address, WAIT_S)
    assert silent.recv(64) == b""  # the server hung up on it
    silent.close()
    sock, data, fds = hello(address, token)  # the real consumer was never blocked
    assert data == fd_server.OK
    unix_socket.close_fds(fds)
    sock.close()
    assert gone.wait(WAIT_S)


def test_many_exports_share_one_listener() -> None:
    offers = [offer([bytes([i])]) for i in range(5)]
    assert len({address for address, _, _ in offers}) == 1
    for address, token, gone in reversed(offers):
        sock, data, fds = hello(address, token)
        assert data == fd_server.OK
        unix_socket.close_fds(fds)
        sock.close()
        assert gone.wait(WAIT_S)
    assert not fd_server.server_stats().listening


# --------------------------------------------------------------------------- #
# The consumer's open, with host memory standing in for the mapped pages
# --------------------------------------------------------------------------- #


class HostPages:
    """A PageMap stand-in: the fds' bytes read into one host buffer."""

    closed: ClassVar[list[HostPages]] = []

    def __init__(self, fds: list[int], sizes: tuple[int, ...]) -> None:
        self.buffer = ctypes.create_string_buffer(
            b"".join(read_fd(f, s) for f, s in zip(fds, sizes))
        )
        self.address = ctypes.addressof(self.buffer)
        self.sizes = sizes

    def close(self) -> None:
        HostPages.closed.append(self)


@pytest.fixture
def host_mapping(monkeypatch: pytest.MonkeyPatch) -> None:
    HostPages.closed = []
    monkeypatch.setattr(export_module, "_device_of", lambda handle: 0)
    monkeypatch.setattr(cuda_vmm, "has_vmm", lambda: True)
    monkeypatch.setattr(
        cuda_vmm.PageMap, "open", classmethod(lambda cls, fds, sizes, device: HostPages(fds, sizes))
    )
    monkeypatch.setattr(cuda_vmm, "on_device", lambda index: contextlib.nullcontext(0))
    monkeypatch.setattr(cuda_vmm, "primary_context", lambda index: 0)
    monkeypatch.setattr(cuda_vmm, "synchronize_context", lambda context: None)
    monkeypatch.setattr(cuda_vmm, "release_primary_context", lambda index: None)
    real = dlpack.tensor_from_memory
    monkeypatch.setattr(
        _torch, "tensor_from_memory", lambda a, n, device, free: real(a, n, None, free)
    )


def fd_handle(address: bytes, token: bytes, pages: tuple[int, ...], **meta: Any) -> TensorHandle:
    fields: dict[str, Any] = {
        "kind": "fd",
        "dtype": torch.int32,
        "shape": (4,),
        "stride": (1,),
        "storage_offset": 0,
        "requires_grad": False,
        "device_uuid": "GPU-test",
        "producer_pid": os.getpid(),
        "boot_id": linux.boot_id(),
        "pid_namespace": linux.pid_namespace(),
        "address": address,
        "token": token,
        "pages": pages,
        "offset": 0,
        "nbytes": sum(pages),
        "event": None,
    }
    fields.update(meta)
    return TensorHandle(**fields)


def test_open_views_the_pages_and_dropping_it_releases_both_sides(host_mapping: None) -> None:
    page0 = bytes(range(16)) * 2  # 32 bytes
    page1 = bytes(range(100, 132))
    address, token, gone = offer([page0, page1])
    raw = torch.frombuffer(bytearray(page0 + page1), dtype=torch.int16)
    handle = fd_handle(
        address,
        token,
        (32, 32),
        dtype=torch.int16,
        shape=(3, 4),
        stride=(1, 3),  # a transposed view at an odd offset
        storage_offset=5,
        offset=2,
        nbytes=60,
    )
    tensor = handle.open()
    expected = torch.frombuffer(bytearray((page0 + page1)[2:62]), dtype=torch.int16)
    assert torch.equal(tensor, expected.as_strided((3, 4), (1, 3), 5))
    assert raw.numel() == 32
    assert export_module.open_handles() == 1
    view = tensor[1:]
    del tensor
    gc.collect()
    assert not gone.is_set()  # a view still holds it
    assert export_module.open_handles() == 1
    del view
    gc.collect()
    assert export_module.open_handles() == 0
    assert len(HostPages.closed) == 1  # unmapped once
    assert gone.wait(WAIT_S)  # and the producer let go


def test_a_handle_opens_once(host_mapping: None) -> None:
    address, token, gone = offer([b"\1" * 16])
    handle = fd_handle(address, token, (16,))
    first = handle.open()
    with pytest.raises(hm.IpcUnavailableError, match="nobody listens at its socket"):
        handle.open(timeout=1.0)
    second_export = offer([b"\2" * 16])
    stale = fd_handle(second_export[0], token, (16,))  # the old token at a live socket
    with pytest.raises(hm.IpcUnavailableError, match="the producer refused it"):
        stale.open(timeout=1.0)
    fresh = fd_handle(second_export[0], second_export[1], (16,)).open()
    assert int(fresh[0]) == 0x02020202
    del first, fresh
    gc.collect()
    assert gone.wait(WAIT_S)
    assert second_export[2].wait(WAIT_S)


def test_requires_grad_travels(host_mapping: None) -> None:
    address, token, gone = offer([b"\0" * 16])
    tensor = fd_handle(address, token, (16,), dtype=torch.float32, requires_grad=True).open()
    assert tensor.requires_grad
    assert tensor.dtype == torch.float32
    del tensor
    gc.collect()
    assert gone.wait(WAIT_S)


def test_a_socket_held_by_another_pid_is_not_trusted(host_mapping: None) -> None:
    address, token, gone = offer([b"\0" * 16])
    impostor = fd_handle(address, token, (16,), producer_pid=os.getpid() + 1_000_000)
    with pytest.raises(hm.IpcUnavailableError, match="not the producer; nothing was read"):
        impostor.open(timeout=1.0)
    assert fd_server.withdraw(fd_server.digest(token))
    assert gone.wait(WAIT_S)


def test_fd_count_mismatch_is_an_error(host_mapping: None) -> None:
    address, token, gone = offer([b"\0" * 16])
    with pytest.raises(hm.IpcUnavailableError, match="got 1 fds for 2 pages"):
        fd_handle(address, token, (8, 8)).open()
    assert gone.wait(WAIT_S)  # the lease ended with the socket


def test_another_machine_is_named() -> None:
    handle = fd_handle(b"\0nowhere", b"t", (16,), boot_id="another-boot")
    with pytest.raises(hm.IpcUnavailableError, match="exported on another machine"):
        handle.open()


def test_another_protocol_is_named() -> None:
    handle = fd_handle(b"\0nowhere", b"t", (16,), protocol=99)
    with pytest.raises(hm.IpcUnavailableError, match="same hybridmem version"):
        handle.open()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_open_without_cuda_says_so() -> None:
    handle = fd_handle(b"\0nowhere", b"t", (16,))
    with pytest.raises(hm.IpcUnavailableError, match="no CUDA device is visible"):
        handle.open()


@pytest.mark.parametrize("timeout", [0, -1, "1"])
def test_open_timeout_is_checked(timeout: object) -> None:
    handle = fd_handle(b"\0nowhere", b"t", (16,))
    with pytest.raises((TypeError, ValueError), match="timeout"):
        handle.open(timeout=timeout)  # type: ignore[arg-type]


def test_the_token_is_not_in_repr() -> None:
    handle = fd_handle(b"\0addr", b"\x07" * 32, (16,))
    assert "07070707" not in repr(handle)
    assert "token" not in repr(handle)
    assert pickle.loads(pickle.dumps(handle)) == handle


def test_withdraw_is_for_the_producer_of_fd_handles_only() -> None:
    assert not fd_handle(b"\0a", b"t", (16,), producer_pid=os.getpid() + 1).withdraw()
    assert not fd_handle(b"\0a", b"t", (16,), kind="cuda").withdraw()
    assert not fd_handle(b"\0a", b"never-offered", (16,)).withdraw()


# --------------------------------------------------------------------------- #
# ipc_export's checks
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ("tensor", TypeError, "takes a torch.Tensor"),
        (torch.zeros(3), TypeError, "takes CUDA tensors"),
    ],
)
def test_export_refuses_what_it_cannot_send(value: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        hm.ipc_export(value)  # type: ignore[arg-type]


def test_export_checks_its_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_torch, "is_device_tensor", lambda t: True)
    for kwargs, match in (
        ({"consumer_pid": 0}, "consumer_pid"),
        ({"consumer_pid": "1"}, "consumer_pid"),
        ({"timeout": 0}, "timeout"),
        ({"timeout": -5.0}, "timeout"),
    ):
        with pytest.raises((TypeError, ValueError), match=match):
            hm.ipc_export(torch.zeros(3), **kwargs)


def test_pages_must_lie_side_by_side(monkeypatch: pytest.MonkeyPatch) -> None:
    pages = [(0x1000, 0x100), (0x1200, 0x100)]  # a gap between them

    def allocation_range(address: int) -> tuple[int, int]:
        return next((b, n) for b, n in pages if address < b + n)  # the next page up

    monkeypatch.setattr(cuda_vmm, "allocation_range", allocation_range)
    with pytest.raises(hm.IpcUnavailableError, match="not laid out as whole pages"):
        export_module._pages(0x1000, 0x200)
    pages[1] = (0x1100, 0x100)
    assert export_module._pages(0x1080, 0x100) == [(0x1000, 0x100), (0x1100, 0x100)]


# --------------------------------------------------------------------------- #
# tensor_from_memory (DLPack) and the driver wrapper without a driver
# --------------------------------------------------------------------------- #


def test_an_external_tensor_calls_back_once_when_its_last_view_dies() -> None:
    buffer = ctypes.create_string_buffer(b"abcdefgh" * 4)
    freed: list[int] = []
    before = dlpack.live_external_tensors()
    tensor = dlpack.tensor_from_memory(ctypes.addressof(buffer), 32, None, lambda: freed.append(1))
    assert tensor.dtype == torch.uint8
    assert tensor.numel() == 32
    words = tensor.view(torch.int32)[2:4]
    words.fill_(0)
    assert buffer.raw[8:16] == b"\0" * 8  # the same memory
    del tensor
    assert freed == []
    del words
    gc.collect()
    assert freed == [1]
    assert dlpack.live_external_tensors() == before


def test_a_failing_callback_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    buffer = ctypes.create_string_buffer(8)

    def boom() -> None:
        raise RuntimeError("unmap failed")

    tensor = dlpack.tensor_from_memory(ctypes.addressof(buffer), 8, None, boom)
    caplog.set_level(logging.ERROR, logger="hybridmem")
    del tensor
    gc.collect()
    assert any("releasing an external tensor" in r.getMessage() for r in caplog.records)


def test_an_external_tensor_alive_at_exit_is_let_go_without_a_traceback() -> None:
    # At exit the interpreter sets a module's globals to None before it frees what other
    # modules still hold; the deleter runs then. Done here as the interpreter does it.
    code = (
        "import ctypes\n"
        "from hybridmem._torch import dlpack\n"
        "buffer = ctypes.create_string_buffer(64)\n"
        "kept = dlpack.tensor_from_memory(ctypes.addressof(buffer), 64, None,"
        " lambda: print('let go'))\n"
        "for name in [n for n in vars(dlpack) if not n.startswith('__')]:\n"
        "    setattr(dlpack, name, None)\n"
        "del kept\n"
    )
    done = run_python("-c", code, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "let go\n"  # the callback ran
    assert "Exception ignored" not in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_driver_calls_without_a_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_vmm, "libcuda", lambda: None)
    monkeypatch.setattr(cuda_driver, "libcuda", lambda: None)  # what every call binds from
    monkeypatch.setattr(cuda_driver, "_bound", {})
    assert not cuda_vmm.has_vmm()
    with pytest.raises(KeyError):
        cuda_vmm.allocation_range(0x1000)
    assert cuda_vmm._prefix((4, 4, 8), 8) == [4, 4]
    assert cuda_vmm._prefix((4, 4, 8), 0) == []
    error = cuda_vmm.DriverError("cuMemMap", 1, "CUDA_ERROR_INVALID_VALUE")
    assert "cuMemMap failed with CUDA_ERROR_INVALID_VALUE (1)" in str(error)


def test_page_map_refuses_mismatched_lists() -> None:
    with pytest.raises(ValueError, match="2 fds for 1 allocations"):
        cuda_vmm.PageMap.open([1, 2], [4], 0)
    with pytest.raises(ValueError, match="0 fds"):
        cuda_vmm.PageMap.open([], [], 0)


# --------------------------------------------------------------------------- #
# ipc_fd_sharing: the queue reducer
# --------------------------------------------------------------------------- #


def test_the_scope_registers_and_restores_reducers() -> None:
    import torch.multiprocessing

    torch_reducer = forking_reducer(torch.Tensor)
    assert torch_reducer is not None
    with hm.ipc_fd_sharing():
        assert forking_reducer(torch.Tensor) is fd_reducer._reduce
        assert forking_reducer(torch.nn.Parameter) is fd_reducer._reduce
        with hm.ipc_fd_sharing():  # nests
            assert forking_reducer(torch.Tensor) is fd_reducer._reduce
        assert forking_reducer(torch.Tensor) is fd_reducer._reduce
    assert forking_reducer(torch.Tensor) is torch_reducer
    with pytest.raises(KeyError), hm.ipc_fd_sharing():
        raise KeyError("boom")
    assert forking_reducer(torch.Tensor) is torch_reducer

    @hm.ipc_fd_sharing()
    def inside() -> object:
        return forking_reducer(torch.Tensor)

    assert inside() is fd_reducer._reduce
    assert forking_reducer(torch.Tensor) is torch_reducer
    assert repr(hm.ipc_fd_sharing()) == "ipc_fd_sharing()"


def test_host_tensors_still_pickle_as_torch_pickles_them() -> None:
    tensor = torch.arange(6.0)
    with hm.ipc_fd_sharing():
        data = ForkingPickler.dumps(tensor)
    assert torch.equal(pickle.loads(data), tensor)


class FakeHandle:
    """What ipc_export returns in the reducer test: opens to a known tensor."""

    requires_grad = True

    def __init__(self, value: torch.Tensor) -> None:
        self.values = value.tolist()  # no tensor inside: it pickles as plain data

    def open(self) -> torch.Tensor:
        return torch.tensor(self.values)


def test_expandable_device_tensors_go_by_fd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_torch, "is_device_tensor", lambda t: True)
    monkeypatch.setattr(_torch, "is_legacy_ipc_capable", lambda t: False)
    monkeypatch.setattr(fd_reducer, "ipc_export", FakeHandle)
    param = torch.nn.Parameter(torch.ones(3))
    with hm.ipc_fd_sharing():
        plain = ForkingPickler.dumps(torch.full((2,), 5.0))
        as_param = ForkingPickler.dumps(param)
    rebuilt = pickle.loads(plain)
    assert torch.equal(rebuilt, torch.full((2,), 5.0))
    back = pickle.loads(as_param)
    assert isinstance(back, torch.nn.Parameter)
    assert back.requires_grad
    assert torch.equal(back.detach(), torch.ones(3))


# --------------------------------------------------------------------------- #
# WeightBucket(transport=...) and the probe's report
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"transport": "pigeon"}, "transport must be one of 'auto', 'cuda', 'fd', 'host'"),
        ({"transport": "fd", "fallback": "host"}, "contradict each other"),
    ],
)
def test_bucket_transport_is_checked(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        hm.WeightBucket(1 << 20, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_fd_bucket_without_cuda_raises_or_falls_back() -> None:
    with pytest.raises(hm.IpcUnavailableError, match=r"transport='fd'.*no CUDA device"):
        hm.WeightBucket(1 << 20, transport="fd", fallback="raise")
    with pytest.warns(hm.HybridMemWarning, match="transport='fd'"):
        bucket = hm.WeightBucket(1 << 20, transport="fd")
    with bucket:
        assert bucket.transport == "host"
    with hm.WeightBucket(1 << 20, transport="host") as host:
        assert host.transport == "host"


def test_probe_reports_fd_passing() -> None:
    base = {"self_fetch_errno": "EPERM", "producer_fetch_errno": "EPERM", "seccomp": 2}
    works = capabilities._interpret(
        0, {**base, "classic_ok": True, "expandable_ok": False, "fd_ok": True}, 0.1
    )
    assert works.fd_passing is True
    assert "hm.ipc_export" in works.advice
    assert "ipc_fd_sharing" in works.advice
    assert "fd passing:          works" in str(works)
    fails = capabilities._interpret(
        0,
        {
            **base,
            "classic_ok": True,
            "expandable_ok": False,
            "fd_ok": False,
            "fd_import_error": "IpcUnavailableError: boom",
        },
        0.1,
    )
    assert fails.fd_passing is False
    assert fails.reason is not None
    assert "fd passing fails too (IpcUnavailableError: boom)" in fails.reason
    no_cuda = capabilities._interpret(0, {**base, "cuda_error": "none"}, 0.1)
    assert no_cuda.fd_passing is None


def test_a_non_leaf_tensor_that_requires_grad_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_torch, "is_device_tensor", lambda t: True)
    monkeypatch.setattr(_torch, "is_legacy_ipc_capable", lambda t: False)
    monkeypatch.setattr(fd_reducer, "ipc_export", FakeHandle)
    non_leaf = torch.ones(2, requires_grad=True) * 2
    with hm.ipc_fd_sharing(), pytest.raises(RuntimeError, match=r"send tensor\.detach\(\)"):
        ForkingPickler.dumps(non_leaf)


def test_an_export_that_fails_in_the_pickler_is_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(tensor: torch.Tensor) -> None:
        raise hm.IpcUnavailableError("not exportable")

    monkeypatch.setattr(_torch, "is_device_tensor", lambda t: True)
    monkeypatch.setattr(_torch, "is_legacy_ipc_capable", lambda t: False)
    monkeypatch.setattr(fd_reducer, "ipc_export", refuse)
    caplog.set_level(logging.ERROR, logger="hybridmem")
    with hm.ipc_fd_sharing(), pytest.raises(hm.IpcUnavailableError):
        ForkingPickler.dumps(torch.ones(3))
    assert any("was not sent: not exportable" in r.getMessage() for r in caplog.records)


def test_an_export_the_server_cannot_offer_closes_its_fds(monkeypatch: pytest.MonkeyPatch) -> None:
    fds = [memfd(b"x"), memfd(b"y")]
    storage = torch.zeros(4).untyped_storage()
    monkeypatch.setattr(cuda_vmm, "has_vmm", lambda: True)
    monkeypatch.setattr(cuda_vmm, "on_device", lambda index: contextlib.nullcontext(0))
    monkeypatch.setattr(
        export_module, "_export_pages", lambda t, s, i: ([(0x1000, 16)], list(fds), None, b"e")
    )

    def no_socket(export: fd_server.Export) -> bytes:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(fd_server, "offer", no_socket)
    with pytest.raises(OSError, match="Too many open files"):
        export_module._export_fd(torch.zeros(4), storage, 0, {}, None, None)
    for fd in fds:
        with pytest.raises(OSError, match="Bad file descriptor"):
            os.fstat(fd)  # closed


# --------------------------------------------------------------------------- #
# The server under random interleavings: opens, strangers, withdrawals, releases
# --------------------------------------------------------------------------- #

_ACTIONS = st.lists(
    st.tuples(
        st.sampled_from(["offer", "open", "stranger", "withdraw", "release", "crash"]),
        st.integers(min_value=0, max_value=4),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions=_ACTIONS)
def test_the_server_keeps_its_promises_under_any_interleaving(
    actions: list[tuple[str, int]],
) -> None:
    """Each export opens once, its storage is held exactly while leased or pending, and
    nothing listens once nothing is pending, whatever happens in between."""
    offers: list[tuple[bytes, bytes, threading.Event]] = []
    state: list[str] = []  # per offer: pending, leased, done
    leases: dict[int, socket.socket] = {}
    try:
        for action, pick in actions:
            if action == "offer" or not offers:
                offers.append(offer([bytes([len(offers) % 256]) * 8]))
                state.append("pending")
                continue
            index = pick % len(offers)
            address, token, _ = offers[index]
            if action == "open":
                try:
                    sock, data, fds = hello(address, token)
                except (ConnectionRefusedError, FileNotFoundError):
                    assert state[index] != "pending"  # a pending export is always reachable
                    continue
                unix_socket.close_fds(fds)
                if state[index] == "pending":
                    assert data == fd_server.OK
                    state[index] = "leased"
                    leases[index] = sock
                else:
                    assert data == b""  # opened, withdrawn or released: never twice
                    sock.close()
            elif action == "stranger":
                with contextlib.suppress(ConnectionRefusedError, FileNotFoundError):
                    assert stranger(address, os.urandom(32)) == (b"", [])
            elif action == "withdraw":
                assert fd_server.withdraw(fd_server.digest(token)) == (state[index] == "pending")
                if state[index] == "pending":
                    state[index] = "done"
            elif action in ("release", "crash") and state[index] == "leased":
                sock = leases.pop(index)
                if action == "release":
                    sock.send(fd_server.RELEASE)
                sock.close()
                state[index] = "done"
            for i, (_, _, event) in enumerate(offers):
                if state[i] == "done":
                    assert event.wait(WAIT_S), f"offer {i} was not let go"
                else:
                    assert not event.is_set(), f"offer {i} was let go while {state[i]}"
        stats = fd_server.server_stats()
        assert stats.pending == state.count("pending")
        assert stats.leases == state.count("leased")
    finally:
        for sock in leases.values():
            sock.close()
        for _, token, gone in offers:
            fd_server.withdraw(fd_server.digest(token))
            # The server lets go in its own thread: the next example starts clean.
            assert gone.wait(WAIT_S)


def test_a_connection_reset_while_opening_is_a_clear_refusal(
    host_mapping: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    address, token, gone = offer([b"\0" * 16])

    def reset(*args: object) -> tuple[bytes, list[int]]:
        raise ConnectionResetError(104, "Connection reset by peer")

    monkeypatch.setattr(unix_socket, "receive_with_fds", reset)
    with pytest.raises(hm.IpcUnavailableError, match="the producer refused it"):
        fd_handle(address, token, (16,)).open(timeout=1.0)
    # Whether the server had answered (a lease, ended by the consumer's close) or not
    # (still pending), nothing stays held.
    fd_server.withdraw(fd_server.digest(token))
    assert gone.wait(WAIT_S)
