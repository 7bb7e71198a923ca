"""A verl sender or receiver in a child process, for the drop-in's peer-failure tests.

Run by ``multiprocessing`` (spawn): :func:`send` sends ``tensors`` tensors of 1 MB and
exits the process without a word after ``die_after`` of them (``os._exit``, as a kill
leaves it); :func:`receive` receives, and exits the same way in its ``die_at``-th
callback.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import torch

from hybridmem.integrations.verl.transfer import BucketedWeightReceiver, BucketedWeightSender


def send(handle: str, tensors: int, die_after: int | None) -> None:
    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for i in range(tensors):
            if die_after is not None and i == die_after:
                os._exit(3)
            yield f"w{i}", torch.full((1 << 18,), float(i))

    asyncio.run(BucketedWeightSender(handle, bucket_size_mb=1).async_send_weights(weights()))


def receive(handle: str, die_at: int | None) -> None:
    calls = [0]

    def apply(weights: list[tuple[str, torch.Tensor]], last: bool) -> None:
        calls[0] += 1
        if die_at is not None and calls[0] == die_at:
            os._exit(3)

    BucketedWeightReceiver(handle, torch.device("cpu")).receive_weights(apply)
