"""verl's own bucketed weight transfer, run on the CPU as the drop-in's oracle.

``verl/workers/rollout/vllm_rollout/bucketed_weight_transfer.py`` is read from verl's
wheel (``HYBRIDMEM_VERL_WHEEL``, as :mod:`tests.verl_oracle` reads its packing) and run
as it is, its sender and receiver in two threads of this process. Only what cannot run
here is answered by stand-ins:

- ``zmq``: a REQ/REP pair over two queues (verl sends Python objects and empty acks);
- ``verl.utils.device``: the CPU as verl's "device" (``synchronize`` a no-op);
- ``verl.workers.rollout.utils.ensure_async_iterator``: what its name says;
- CUDA IPC (``reduce_tensor``): a handle that hands the tensor itself over, so verl's
  CUDA-IPC path (its default, and the one that takes a tensor larger than the bucket)
  runs on the CPU. ``use_shm=True`` runs verl's shared-memory path for real.

:func:`verl_callbacks` returns what verl's receiver hands ``on_bucket_received``: each
call's ``(name, tensor)`` pairs (cloned: they are views of verl's buffer) and its
``is_last``. Nothing of verl is copied into this project.
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import types
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch

from tests import verl_oracle

TRANSFER = "verl/workers/rollout/vllm_rollout/bucketed_weight_transfer.py"
Callbacks = list[tuple[list[tuple[str, torch.Tensor]], bool]]


def transfer_source() -> str | None:
    """verl's bucketed_weight_transfer.py from its wheel (or an installed verl), or None."""
    found = verl_oracle.verl_source()
    if found is None:
        return None
    _, where = found
    wheel = where.split(":")[0]
    if wheel.endswith(".whl"):
        with zipfile.ZipFile(wheel) as archive:
            return archive.read(TRANSFER).decode()
    path = Path(where).parents[2] / "workers" / "rollout" / "vllm_rollout" / Path(TRANSFER).name
    return path.read_text() if path.is_file() else None


class _Zmq:
    """zmq's Context, REQ and REP sockets as verl uses them, over in-process queues."""

    REQ, REP = 3, 4
    _channels: ClassVar[dict[str, tuple[queue.Queue[Any], queue.Queue[Any]]]] = {}
    _lock = threading.Lock()

    class Context:
        _instance: Any = None

        @classmethod
        def instance(cls) -> Any:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

        def socket(self, kind: int) -> _Zmq.Socket:
            return _Zmq.Socket(kind)

    class Socket:
        def __init__(self, kind: int) -> None:
            self.kind = kind
            self.out: queue.Queue[Any] | None = None
            self.into: queue.Queue[Any] | None = None

        def _attach(self, handle: str) -> None:
            with _Zmq._lock:
                pair = _Zmq._channels.setdefault(handle, (queue.Queue(), queue.Queue()))
            to_rep, to_req = pair
            self.out, self.into = (to_rep, to_req) if self.kind == _Zmq.REQ else (to_req, to_rep)

        bind = connect = _attach

        def send_pyobj(self, obj: Any) -> None:
            assert self.out is not None
            self.out.put(obj)

        send = send_pyobj

        def recv_pyobj(self) -> Any:
            assert self.into is not None
            return self.into.get(timeout=60)  # the oracle's own bound: it never hangs a test

        recv = recv_pyobj

        def close(self) -> None:
            pass


def _device_module() -> types.ModuleType:
    device = types.ModuleType("verl.utils.device")
    torch_device = types.SimpleNamespace(
        synchronize=lambda: None, ipc_collect=lambda: None, empty_cache=lambda: None
    )
    device.get_device_id = lambda: 0  # type: ignore[attr-defined]
    device.get_device_name = lambda: "cpu"  # type: ignore[attr-defined]
    device.get_torch_device = lambda: torch_device  # type: ignore[attr-defined]
    device.is_support_ipc = lambda: True  # type: ignore[attr-defined]
    return device


def _rollout_utils() -> types.ModuleType:
    utils = types.ModuleType("verl.workers.rollout.utils")

    async def ensure_async_iterator(items: Any) -> Any:
        if hasattr(items, "__aiter__"):
            async for item in items:
                yield item
        else:
            for item in items:
                yield item

    utils.ensure_async_iterator = ensure_async_iterator  # type: ignore[attr-defined]
    return utils


def _handed_over(tensor: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
    """A CUDA-IPC handle stand-in: rebuilding it gives the tensor (arg 6 is the device)."""
    return (lambda *args: tensor), (None,) * 8


def load_transfer() -> types.ModuleType:
    """verl's module, loaded with the stand-ins (a fresh module each call)."""
    source = transfer_source()
    if source is None:
        raise FileNotFoundError(verl_oracle.missing_reason())
    saved = {name: sys.modules.get(name) for name in ("zmq", "verl.utils.device")}
    sys.modules["zmq"] = _Zmq  # type: ignore[assignment]
    sys.modules["verl.utils.device"] = _device_module()
    try:
        module = types.ModuleType("verl_bucketed_weight_transfer")
        module.__file__ = TRANSFER
        exec(compile(source, TRANSFER, "exec"), module.__dict__)
    finally:
        for name, value in saved.items():
            if value is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = value
    module.reduce_tensor = _handed_over  # type: ignore[attr-defined]
    module.ensure_async_iterator = _rollout_utils().ensure_async_iterator  # type: ignore[attr-defined]
    sys.modules.setdefault("verl.workers.rollout.utils", _rollout_utils())
    return module


def verl_callbacks(
    weights: list[tuple[str, torch.Tensor]],
    bucket_size_mb: int,
    *,
    use_shm: bool = False,
    bucket_bytes: int | None = None,
) -> tuple[Callbacks, BaseException | None]:
    """Run verl's sender and receiver on ``weights``; their callbacks, and the sender's error.

    ``bucket_bytes`` sets the sender's ``bucket_size`` attribute after it is made (verl
    reads it there), for buckets smaller than the 1 MiB its argument allows.
    """
    module = load_transfer()
    handle = f"ipc:///oracle-{uuid.uuid4().hex}.sock"  # fresh queues: nothing left over
    seen: Callbacks = []
    failed: list[BaseException] = []

    def receive() -> None:
        receiver = module.BucketedWeightReceiver(handle, torch.device("cpu"), use_shm=use_shm)
        try:
            receiver.receive_weights(
                lambda batch, last: seen.append(([(n, t.clone()) for n, t in batch], last))
            )
        except BaseException as exc:  # the sender's failure leaves it waiting: reported
            failed.append(exc)

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    sender = module.BucketedWeightSender(handle, bucket_size_mb=bucket_size_mb, use_shm=use_shm)
    if bucket_bytes is not None:
        sender.bucket_size = bucket_bytes
    error: BaseException | None = None
    try:
        asyncio.run(sender.async_send_weights(iter(weights)))
    except BaseException as exc:
        error = exc
    thread.join(timeout=5 if error is not None else 60)
    _Zmq._channels.pop(handle, None)
    return seen, error


def names(callbacks: Callbacks) -> Iterator[tuple[list[str], bool]]:
    for batch, last in callbacks:
        yield [name for name, _ in batch], last
