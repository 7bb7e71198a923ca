"""verl's ``BucketedWeightSender`` and ``BucketedWeightReceiver``, over a hybridmem bucket.

Same constructors, methods and callback contract as verl 0.9.1's
(``verl/workers/rollout/vllm_rollout/bucketed_weight_transfer.py``):

- ``BucketedWeightSender(zmq_handle, bucket_size_mb=512, use_shm=False)`` and
  ``await sender.async_send_weights(weights)`` (a generator or async iterator of
  ``(name, tensor)``);
- ``BucketedWeightReceiver(zmq_handle, device, use_shm=False)`` and
  ``receiver.receive_weights(on_bucket_received)``, which calls
  ``on_bucket_received(weights, is_last)`` with exactly the batches verl's own pair
  delivers (:mod:`~hybridmem.integrations.verl.batches`); ``weights`` are valid
  during the callback (clone what you keep, as verl's LoRA path does).

What changes underneath (:mod:`~hybridmem.integrations.verl.link`): the bytes move
through a :class:`~hybridmem.WeightBucket` of three buffers (``HYBRIDMEM_VERL_BUFFERS``)
over a connection each process keeps per ``zmq_handle``. What stays on the devices
after ``update_weights`` returns is what verl's own pair leaves, nothing: the worker
closes its mappings and empties its cache, then the trainer frees the bucket and
empties its cache, as verl's ``_cleanup`` does. ``HYBRIDMEM_VERL_KEEP_BUCKET=1`` (or
``keep_bucket=True``) keeps the bucket instead, made and opened once: faster syncs,
at the price of its buffers on every trainer GPU through the rollout. Its
transport is chosen as the bucket chooses (``cuda``; ``fd`` where ``pidfd_getfd`` is
denied and asked for; ``host`` with ``use_shm``); every wait is bounded
(``HYBRIDMEM_VERL_TIMEOUT``, 120 s), a dead or silent peer is a ``SyncError`` on both
sides; a tensor larger than the bucket is delivered alone, as verl's CUDA-IPC path
delivers it, also with ``use_shm`` (where verl's asserts after it has flushed the
bucket before it, and its receiver then waits forever).

The sender cuts verl's batches by verl's rule (:mod:`~hybridmem.integrations.verl.
batches`) and streams them as one bucket sync (:meth:`~hybridmem.WeightBucket.
send_groups`): a batch is copied into one buffer while the receiver's callback reads the
other, with no stop between batches. The receiver hands each batch to
``on_bucket_received`` as views of the bucket, as verl's hands out views of its
buffer: the bytes are copied once on the way (verl's ``use_shm`` and a worker on
another device: copies, made by the receiver).

The batches are cut on the caller's event loop (verl's weights may be an async
iterator, and a generator that gathers runs where verl runs it) and copied in from one
thread each link keeps (:meth:`~hybridmem.integrations.verl.link.SenderLink.submit`),
which takes each batch from a thread queue, without a trip through the loop.

What the sender holds: the tensors of up to three of verl's batches (one being cut,
one queued, one being copied), where verl's holds one tensor at a time.

Scope: one sync at a time per ``zmq_handle`` and process.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import queue
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import torch

from hybridmem import _torch
from hybridmem._checks import check_bool, check_number
from hybridmem._errors import SyncError
from hybridmem._log import logger
from hybridmem.integrations.verl.batches import Batch, VerlBatches
from hybridmem.integrations.verl.link import made_sender_link, receiver_link, sender_link
from hybridmem.integrations.verl.settings import keep_bucket

__all__ = ["BucketedWeightReceiver", "BucketedWeightSender"]


def _check_handle(zmq_handle: object) -> str:
    if not isinstance(zmq_handle, str) or not zmq_handle:
        raise TypeError(
            f"zmq_handle must be a non-empty str (verl's 'ipc:///tmp/...sock'), got {zmq_handle!r}"
        )
    return zmq_handle


async def _items(weights: Any) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """``weights`` as an async iterator: verl passes a generator or an async iterator."""
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


class _Handover:
    """verl's batches, from the event loop that cuts them to the thread that sends them.

    One batch waits at a time. The sending thread takes it from a thread queue, so a
    batch cut ahead costs it no trip through the event loop; the loop is woken only
    while it waits for room.

    Args:
        loop: the running event loop (the cutting side).
        timeout: the longest the sending thread waits for the next batch, in seconds.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=1)
        self._loop = loop
        self._room = asyncio.Event()
        self._waiting = False  # the loop waits for room: the taker wakes it
        self.timeout = timeout

    async def put(self, item: object, sending: asyncio.Future[Any]) -> None:
        """Queue ``item``, unless the sending thread stopped (then it takes no more)."""
        while not sending.done():
            try:
                self._queue.put_nowait(item)
                return
            except queue.Full:
                pass
            self._room.clear()
            self._waiting = True
            try:
                if self._queue.full():  # still full once the taker can see the flag
                    room = asyncio.ensure_future(self._room.wait())
                    await asyncio.wait({room, sending}, return_when=asyncio.FIRST_COMPLETED)
                    room.cancel()
            finally:
                self._waiting = False

    def take(self) -> Any:
        """The next item, in the sending thread.

        Raises:
            SyncError: nothing came within the timeout (the weights' iterator is stuck).
        """
        try:
            item = self._queue.get(timeout=self.timeout)
        except queue.Empty:
            raise SyncError(
                f"the weights to send gave no tensor for {self.timeout:g} s "
                "(HYBRIDMEM_VERL_TIMEOUT): the iterator is stuck"
            ) from None
        if self._waiting:
            self._loop.call_soon_threadsafe(self._room.set)
        return item


def _checked(item: object) -> tuple[str, torch.Tensor]:
    if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
        raise TypeError(f"weights must yield (name, tensor) pairs, got {item!r}")
    name, tensor = item
    if not isinstance(name, str):
        raise TypeError(f"a weight's name must be a str, got {name!r}")
    return name, tensor.detach().contiguous()


class BucketedWeightSender:
    """verl's sender, over a hybridmem bucket (see the module).

    Args:
        zmq_handle: verl's handle (``ipc:///tmp/rl-colocate-zmq-...sock``).
        bucket_size_mb: the bucket, in MiB (verl's
            ``rollout.checkpoint_engine.update_weights_bucket_megabytes``).
        use_shm: carry the bytes through host shared memory (verl sets it where
            device IPC is not supported).
        keep_bucket: keep the bucket between syncs (made, exported and opened once;
            its memory held on this device and mapped by the worker through the
            rollout). None (default): ``HYBRIDMEM_VERL_KEEP_BUCKET``, unset meaning no:
            the bucket is freed when each sync ends, as verl's own pair frees its
            buffer.

    Raises:
        TypeError, ValueError: a bad argument (the message names it).

    Example:
        A sync through host memory (``use_shm``, as on a machine without a GPU), the
        vLLM worker's side in a thread:

        >>> import asyncio, tempfile, threading, torch
        >>> handle = f"ipc://{tempfile.mkdtemp()}/verl.sock"
        >>> got = []
        >>> def worker():
        ...     receiver = BucketedWeightReceiver(handle, torch.device("cpu"), use_shm=True)
        ...     receiver.receive_weights(lambda batch, last: got.extend(n for n, _ in batch))
        >>> thread = threading.Thread(target=worker)
        >>> thread.start()
        >>> sender = BucketedWeightSender(handle, bucket_size_mb=1, use_shm=True)
        >>> weights = {"embed": torch.ones(8), "head": torch.zeros(4)}
        >>> asyncio.run(sender.async_send_weights(iter(weights.items())))
        >>> thread.join()
        >>> got
        ['embed', 'head']
        >>> from hybridmem.integrations.verl.link import close_links
        >>> close_links()
    """

    def __init__(
        self,
        zmq_handle: str,
        bucket_size_mb: int = 512,
        use_shm: bool = False,
        *,
        keep_bucket: bool | None = None,
    ) -> None:
        self.zmq_handle = _check_handle(zmq_handle)
        self.bucket_size_mb = int(
            check_number(
                "bucket_size_mb",
                bucket_size_mb,
                integer=True,
                minimum=1,
                maximum=1 << 20,
                expected="a whole number of MiB from 1 to 1048576",
            )
        )
        self.bucket_size = self.bucket_size_mb << 20
        self.use_shm = check_bool("use_shm", use_shm)
        self.keep_bucket = None if keep_bucket is None else check_bool("keep_bucket", keep_bucket)

    async def async_send_weights(self, weights: Any) -> None:
        """Send every ``(name, tensor)`` of ``weights``; return once the receiver took them all.

        Args:
            weights: a generator or async iterator of ``(name, tensor)``.

        Raises:
            TypeError: an item is not a ``(name, tensor)`` pair.
            SyncError: the receiver did not connect, died, went silent, or its
                ``on_bucket_received`` raised (its error in the message).
        """
        keep = keep_bucket() if self.keep_bucket is None else self.keep_bucket
        stream = _items(weights)
        try:
            first = await anext(stream, None)
            device = torch.device("cpu") if first is None else _checked(first)[1].device
        except BaseException as exc:  # before the first tensor: the worker is told too
            await self._stop(f"{type(exc).__name__}: {exc}")
            raise
        link = made_sender_link(self.zmq_handle)
        if link is None:  # the first sync makes it (a socket: not on the event loop)
            link = await asyncio.to_thread(
                sender_link, self.zmq_handle, self.bucket_size, self.use_shm, device
            )
        # verl's batches, cut here by verl's rule; one queued while the link sends another.
        batches = _Handover(asyncio.get_running_loop(), link.timeout)

        def produced() -> Iterator[Batch]:
            while True:
                item = batches.take()
                if isinstance(item, BaseException):
                    raise item  # the weights' iterator failed: the link tells the receiver
                yield item
                if item[1]:
                    return

        # The weights are written on this thread's current stream; the link's thread
        # orders its copies after that stream's work (and that stream's later work after
        # the copies), whichever stream the caller runs verl's update on.
        caller = _torch.current_stream(device)
        sending = asyncio.wrap_future(link.submit(produced(), self.bucket_size, caller, keep))
        cut: list[Batch] = []
        cutter = VerlBatches(self.bucket_size, lambda weights, last: cut.append((weights, last)))
        try:
            pending = first
            while pending is not None and not sending.done():  # a failed link: stop feeding
                cutter.add(*_checked(pending))
                for batch in cut:
                    await batches.put(batch, sending)
                cut.clear()
                pending = await anext(stream, None)
            cutter.finish()
            for batch in cut:
                await batches.put(batch, sending)
        except BaseException as exc:
            if not sending.done():
                await batches.put(exc, sending)
            with contextlib.suppress(BaseException):
                await sending
            raise
        sent = await sending
        logger.debug("verl drop-in: sent %d tensors over %s", sent, self.zmq_handle)

    async def _stop(self, reason: str) -> None:
        """Tell the worker this sync failed before its first tensor; its error is kept."""
        link = made_sender_link(self.zmq_handle)
        with contextlib.suppress(Exception):  # the weights' error is the one to raise
            if link is None:
                link = await asyncio.to_thread(
                    sender_link, self.zmq_handle, self.bucket_size, self.use_shm, None
                )
            await asyncio.to_thread(link.stop, reason)


class BucketedWeightReceiver:
    """verl's receiver, over the sender's hybridmem bucket (see the module).

    Args:
        zmq_handle: verl's handle (the sender's).
        device: where the received tensors go.
        use_shm: verl's flag; the sender's bucket says how the bytes come, so it
            only has to match the sender's.

    Raises:
        TypeError, ValueError: a bad argument (the message names it).
    """

    def __init__(self, zmq_handle: str, device: torch.device, use_shm: bool = False) -> None:
        self.zmq_handle = _check_handle(zmq_handle)
        if isinstance(device, str):
            device = torch.device(device)
        elif isinstance(device, int) and not isinstance(device, bool):
            device = torch.device("cuda", device)
        if not isinstance(device, torch.device):
            raise TypeError(f"device must be a torch.device, got {device!r}")
        self.device = device
        self.use_shm = check_bool("use_shm", use_shm)

    def receive_weights(self, on_bucket_received: Any) -> None:
        """Receive one sync, calling ``on_bucket_received(weights, is_last)`` per verl batch.

        Raises:
            TypeError: ``on_bucket_received`` is not callable.
            SyncError: the sender died or went silent; what was delivered before
                stays delivered (as with verl's), nothing more comes.
        """
        if not callable(on_bucket_received):
            raise TypeError(f"on_bucket_received must be callable, got {on_bucket_received!r}")
        if inspect.iscoroutinefunction(on_bucket_received):
            raise TypeError("on_bucket_received is called synchronously, as verl's receiver does")
        link = receiver_link(self.zmq_handle, self.device)
        link.receive(on_bucket_received)


def _pairs(weights: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """For tests and tools: ``weights`` checked as the sender checks them."""
    return [_checked(item) for item in weights]
