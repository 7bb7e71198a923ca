"""The transports as strategies (issue #27): the registry, the one choice, a fourth one.

Each transport says what blocks it here; :func:`choose_transport` alone turns what was
asked and those answers into a transport object, which bucket and receiver ask from
then on. The blockers are faked here; the transports' own work runs in test_bucket.py
(host) and on the H200 (cuda, fd).
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any, ClassVar

import pytest
import torch

import hybridmem as hm
from hybridmem.ipc.transports import choice
from hybridmem.ipc.transports.base import Buffers, Probe, Transport
from hybridmem.ipc.transports.cuda import CudaTransport
from hybridmem.ipc.transports.fd import FdTransport
from hybridmem.ipc.transports.host import HostTransport


@pytest.fixture
def blocked(monkeypatch: pytest.MonkeyPatch) -> dict[str, str | None]:
    """What blocks each transport here (None: nothing), and the probes asked for."""
    says: dict[str, str | None] = {"cuda": None, "fd": None, "probes": None}
    probes: list[str] = []

    def blocker_of(name: str) -> Any:
        def blocker(device: int, probe: Probe = "off") -> str | None:
            probes.append(f"{name}:{probe}")
            return says[name]

        return staticmethod(blocker)

    monkeypatch.setattr(CudaTransport, "blocker", blocker_of("cuda"))
    monkeypatch.setattr(FdTransport, "blocker", blocker_of("fd"))
    says["probes"] = probes  # type: ignore[assignment]
    return says


def choose(requested: str, fallback: str, **kw: Any) -> str:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        name = choice.choose_transport(
            requested,
            fallback,  # type: ignore[arg-type]
            0,
            who="WeightBucket",
            **kw,
        ).name
    messages = [str(w.message) for w in caught if issubclass(w.category, hm.HybridMemWarning)]
    return name + "".join(f" [warned: {m}]" for m in messages)


def test_the_registry_names_every_transport_once_and_refuses_strangers() -> None:
    assert set(choice.TRANSPORTS) == {"cuda", "fd", "host"}
    for name, kind in choice.TRANSPORTS.items():
        assert kind.name == name
        made = choice.transport_named(name)
        assert isinstance(made, Transport)
        assert made.name == name
        # the chain ends in a transport that is never blocked
        seen = {name}
        while kind.falls_back_to is not None:
            kind = choice.TRANSPORTS[kind.falls_back_to]
            assert kind.name not in seen
            seen.add(kind.name)
        assert kind.blocker(0) is None
    for stranger in ("pigeon", None, 3):
        with pytest.raises(ValueError, match=r"unknown transport.*same hybridmem version"):
            choice.transport_named(stranger)


def test_the_choice_takes_what_was_asked_where_nothing_blocks_it(
    blocked: dict[str, Any],
) -> None:
    assert choose("auto", "auto") == "cuda"
    assert choose("cuda", "raise") == "cuda"
    assert choose("fd", "auto") == "fd"
    assert choose("host", "raise") == "host"
    assert choose("cuda", "host") == "host"  # fallback="host": always host memory
    assert choose("auto", "auto", probe="run") == "cuda"
    assert "cuda:run" in blocked["probes"]  # the cuda transport was asked to probe


def test_a_blocked_transport_raises_or_warns_once_and_falls_back(
    blocked: dict[str, Any],
) -> None:
    blocked["fd"] = "no fds here"
    with pytest.raises(hm.IpcUnavailableError, match=r"WeightBucket\(transport='fd'\): no fds"):
        choose("fd", "raise")
    got = choose("fd", "auto")
    assert got.startswith("cuda [warned: WeightBucket(transport='fd') is not possible here")
    blocked["cuda"] = "cudaMallocAsync"
    with pytest.raises(hm.IpcUnavailableError, match="CUDA IPC cannot be used on device 0"):
        choose("auto", "raise")
    got = choose("fd", "auto")  # fd -> cuda -> host; fd's warning was given once already
    assert got.startswith("host [warned: CUDA IPC cannot be used on device 0 (cudaMallocAsync)")
    assert "transport='fd'" not in got


def test_without_any_gpu_a_bucket_takes_host_memory_quietly(
    blocked: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybridmem import _torch

    monkeypatch.setattr(_torch, "cuda_available", lambda: False)
    blocked["cuda"] = "no CUDA device is visible"
    assert choose("auto", "auto", host_without_cuda=True) == "host"  # no warning
    assert choose("auto", "auto").startswith("host [warned: CUDA IPC cannot be used")
    with pytest.raises(hm.IpcUnavailableError, match="no CUDA device is visible"):
        choose("auto", "raise", host_without_cuda=True)


class LoopTransport(HostTransport):
    """A fourth transport: host memory, counting its opens (one module and one line)."""

    name = "loop"  # type: ignore[assignment]
    opened: ClassVar[list[int]] = []

    def open(
        self, exports: Sequence[Any], nbytes: int, producer_pid: int, source: int, into: Buffers
    ) -> None:
        LoopTransport.opened.append(len(exports))
        super().open(exports, nbytes, producer_pid, source, into)


def test_a_fourth_transport_is_one_class_and_one_registry_line(
    monkeypatch: pytest.MonkeyPatch, cpu_as_device: list[int], pipe: tuple[Connection, Connection]
) -> None:
    monkeypatch.setitem(choice.TRANSPORTS, "loop", LoopTransport)
    chosen = choice.choose_transport("loop", "raise", 0, who="WeightBucket")
    assert isinstance(chosen, LoopTransport)
    weights = {"w": torch.arange(6.0)}
    with hm.WeightBucket(4096) as bucket:
        # The receiver asks the registry for the handle's transport by its name.
        handle = dataclasses.replace(bucket.handle, transport="loop")  # type: ignore[arg-type]
        got: dict[str, torch.Tensor] = {}

        def receive() -> None:
            with hm.BucketReceiver(handle) as receiver:
                got.update({n: t.clone() for n, t in receiver.receive(pipe[1])})

        thread = threading.Thread(target=receive)
        thread.start()
        bucket.send(weights, pipe[0])
        thread.join()
    assert LoopTransport.opened == [bucket.buffers]
    assert torch.equal(got["w"], weights["w"])


def test_a_receiver_refuses_a_handle_of_an_unknown_transport() -> None:
    with hm.WeightBucket(4096) as bucket:
        handle = dataclasses.replace(bucket.handle, transport="pigeon")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="unknown transport 'pigeon'"):
            hm.BucketReceiver(handle)
