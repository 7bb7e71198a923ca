"""A trainer in a process of its own, for the vLLM link's tests (with and without vLLM).

The child holds a :class:`TrainerLink` (the data plane); its control calls (vLLM's
``init_weight_transfer_engine`` and ``update_weights``) go to the parent over a
pipe, where the engine side runs. It can die after a number of batches (SIGKILL-like:
``os._exit``, no finalizer runs) or go silent, to test what the engine keeps.
"""

from __future__ import annotations

import os
import threading
from multiprocessing.connection import Connection
from typing import Any

import torch

from hybridmem.integrations.vllm.trainer import TrainerLink


class _DiesAfter:
    """The link's channel, but the process exits after sending ``batches`` batches."""

    def __init__(self, conn: Any, batches: int, asked: threading.Event) -> None:
        self._conn = conn
        self._left = batches
        self._asked = asked

    def send(self, message: Any) -> None:
        self._conn.send(message)
        if isinstance(message, tuple) and message[0] == "batch":
            self._left -= 1
            if self._left <= 0:
                # Die mid-update: once the engine has been asked (vLLM's call is made
                # in a thread beside the data; dying before it would be another test).
                self._asked.wait(30)
                os._exit(3)  # no finalizer, no unlink: as SIGKILL leaves it

    def recv(self) -> Any:
        return self._conn.recv()

    def poll(self, timeout: float) -> bool:
        return bool(self._conn.poll(timeout))

    def fileno(self) -> int:
        return int(self._conn.fileno())


def run(
    control: Connection,
    weights: dict[str, torch.Tensor],
    bucket_bytes: int,
    timeout: float,
    die_after: int | None,
    silent: bool,
) -> None:
    """Child main: connect through the parent, then sync on each ``"sync"`` it sends."""

    asked = threading.Event()

    def ask(kind: str, info: dict[str, Any]) -> None:
        control.send((kind, info))
        asked.set()
        answer = control.recv()
        if answer != "ok":
            raise RuntimeError(f"the engine side failed: {answer}")

    link = TrainerLink(bucket_bytes, transport="host", timeout=timeout)
    link.connect(lambda info: ask("init", info))
    control.send(("connected", link.bucket.handle.exports))
    while control.recv() == "sync":
        if silent:  # tell the engine a sync comes, then never send it
            control.send(("update", {"sync": 1, "tensors": len(weights), "weight_version": None}))
            control.recv()
            continue
        asked.clear()  # set again once this sync's update call is made
        if die_after is not None:
            link._conn = _DiesAfter(link._conn, die_after, asked)
        link.sync(weights, lambda info: ask("update", info), weight_version="v1")
        control.send(("synced", None))
    link.close()
