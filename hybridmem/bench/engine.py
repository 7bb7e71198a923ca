"""The bench's rollout engine: a process that sleeps, wakes and generates on the same GPU.

It holds a copy of the trainer's weights and a KV cache of a fixed fraction of the
device, frees both when it sleeps and takes them back when it wakes, by tag, the way
SGLang does (torch_memory_saver regions) or vLLM does (its sleep-mode pool, at level 2 or
1), or by hand where neither is there: see :mod:`hybridmem.bench.engine_memory`. The KV cache it
obtains is what the trainer's switch left it. Weights arrive three ways: per-tensor
CUDA IPC exports, a fresh exported buffer per batch, or a
:class:`hybridmem.WeightBucket`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from hybridmem import _torch
from hybridmem._format import first_line
from hybridmem.bench.anatomy import cache_anatomy, kept_page_bytes
from hybridmem.bench.engine_memory import EngineMemory, make_engine_memory, preload_env
from hybridmem.ipc._wire import Peer, recv_within
from hybridmem.ipc.receiver import BucketReceiver
from hybridmem.observe import timeline as _timeline
from hybridmem.observe.memory import memory_info
from hybridmem.observe.timeline import record

__all__ = [
    "BoundedConn",
    "EngineClient",
    "EngineOutOfMemory",
    "answer",
    "serve",
    "start_engine",
]

#: The longest the trainer waits for one answer of the engine process (seconds).
ENGINE_TIMEOUT_S = 600.0


class BoundedConn:
    """The trainer's pipe end to the engine: no wait outlasts the engine or a timeout.

    The trainer holds the engine's end of the pipe too (it made the pipe), so an engine
    that dies never produces EOF; each wait polls and watches the engine's pid.
    """

    def __init__(self, conn: Connection, pid: int | None, timeout: float = ENGINE_TIMEOUT_S):
        self.conn = conn
        self.peer = Peer(pid, "bench engine")
        self.timeout = timeout

    def send(self, obj: Any) -> None:
        self.conn.send(obj)

    def poll(self, timeout: float) -> bool:
        return self.conn.poll(timeout)

    def recv(self) -> Any:
        return recv_within(self.conn, self.timeout, self.peer, "an answer")


class EngineOutOfMemory(RuntimeError):
    """The engine process ran out of device memory in a command, and went on serving.

    A real engine fails the request, not the process: the bench's engine answers
    ``("oom", message)`` and the trainer records it for the cycle (what a strategy
    that left the rollout too little memory shows), instead of losing the engine.
    """


GiB = 2**30
Weights = dict[str, torch.Tensor]


def _sync_bucket(receiver: BucketReceiver, conn: Connection, weights: Weights) -> None:
    for _ in receiver.receive(conn, out=weights):
        pass


def _sync_tensors(exports: dict[str, Any], weights: Weights, device: int) -> None:
    """Per-tensor exports, as ``torch.multiprocessing`` sends them."""
    for name, (rebuild, export) in exports.items():
        weights[name].copy_(_torch.import_cuda_tensor(rebuild, export, device))
    torch.cuda.synchronize()
    _torch.ipc_collect()


def _sync_fresh(conn: Connection, weights: Weights, device: int) -> None:
    """A fresh exported buffer per batch."""
    while True:
        message = conn.recv()
        if message[0] == "end":
            return
        _, (rebuild, export), entries = message
        buffer = _torch.import_cuda_tensor(rebuild, export, device)
        for name, start, nbytes, offset in entries:
            flat = weights[name].view(-1).view(torch.uint8)
            flat[start : start + nbytes].copy_(buffer[offset : offset + nbytes])
        torch.cuda.synchronize()
        del buffer  # dropped at once, before the next batch arrives


def _generate(weights: Weights, kv: torch.Tensor, width: int) -> None:
    """A decode-like loop that reads weights and writes the KV cache."""
    hidden = torch.randn(64, width, device="cuda")
    matrices = [
        w for w in weights.values() if w.dim() == 2 and w.shape[1] == width and w.shape[0] >= width
    ][:8]
    for step in range(16):
        for matrix in matrices:
            hidden = torch.nn.functional.gelu((hidden @ matrix.t())[:, :width])
            hidden = hidden / (hidden.norm() + 1.0)
        span = max(kv.numel() - hidden.nbytes, 1)
        offset = step * hidden.nbytes % span
        kv[offset : offset + hidden.nbytes].copy_(hidden.reshape(-1).view(torch.uint8))
    torch.cuda.synchronize()


def _warm_up() -> None:
    """Run :func:`_generate` once on small tensors, then let them go.

    As an engine's profile run does before it sizes its KV cache: the kernels and the
    cuBLAS handle a first generation loads into the context are loaded before the
    trainer measures what is free (the bench sizes ``--need``'s KV cache from it), not
    after the first cycle, where they would make a rollout sized to lack nothing lack
    them.
    """
    weights = {"w": torch.randn(64, 64, device="cuda")}
    kv = torch.empty(64 * 64 * 4, dtype=torch.uint8, device="cuda")
    _generate(weights, kv, 64)
    del weights, kv
    torch.cuda.empty_cache()


def start_engine(
    ctx: Any, target: Callable[..., None], args: tuple[Any, ...], memory_kind: str
) -> Any:
    """Start the engine process, daemonic: it never outlives a trainer that fails.

    A trainer that raises keeps its end of the pipe alive in the traceback it prints,
    and at exit multiprocessing joins every child that is not daemonic: an engine
    waiting on that pipe would never end, and the bench would kill the silent
    strategy :data:`~hybridmem.bench.peers.CHILD_SILENCE_S` later with its error
    lost. A daemonic child is terminated at that exit instead; a normal run stops it
    with ``("stop",)`` first. SGLang's engine runs with torch_memory_saver's
    ``LD_PRELOAD``: ``memory_kind`` ``tms`` starts it so.

    Args:
        ctx: a ``multiprocessing`` context (the bench's is ``spawn``).
        target, args: what the process runs (:func:`hybridmem.bench.engine.serve`).
        memory_kind: the engine's memory (:data:`~hybridmem.bench.plan.ENGINES`).

    Returns:
        The started process.

    Example:
        >>> import multiprocessing as mp
        >>> start_engine(mp.get_context("spawn"), serve, args, "tms")  # doctest: +SKIP
    """
    process = ctx.Process(target=target, args=args, daemon=True)
    with preload_env(memory_kind):
        process.start()
    return process


def serve(
    conn: Connection,
    device: int,
    kv_target: int,
    shapes: dict[str, Any],
    memory_kind: str = "handmade",
    anatomy: bool = False,
    timeline: str | None = None,
) -> None:
    """The engine process's loop (the target of a ``spawn`` process).

    Each command runs in its own function: a loop variable left in this frame (a
    view of the last weight synced) would keep that weight alive through the next
    sleep, and its memory would show up as the engine's cache after the next wake.
    With ``timeline``, every command is an ``engine:COMMAND`` phase span, written
    there (``hybridmem plot`` merges it with the trainer's file).
    """
    recording = record(timeline, process="engine") if timeline else contextlib.nullcontext()
    with recording:
        _serve(conn, device, kv_target, shapes, memory_kind, anatomy)


def _serve(
    conn: Connection,
    device: int,
    kv_target: int,
    shapes: dict[str, Any],
    memory_kind: str,
    anatomy: bool,
) -> None:
    torch.cuda.set_device(device)
    if anatomy:
        _torch.record_memory_history(True)
    torch.zeros(1, device="cuda")
    _warm_up()
    engine = _Engine(make_engine_memory(memory_kind, shapes, kv_target, device), conn, device)
    conn.send(("ready", torch.cuda.memory_reserved(), engine.memory.name))
    while True:
        command, *args = conn.recv()
        if command == "stop":
            conn.send(("ok",))
            return
        span = _timeline.begin(f"engine:{command}", "phase", backend="bench")
        try:
            reply = answer(engine, command, args)
        finally:
            _timeline.end(span)
        conn.send(reply)


def answer(engine: Any, command: str, args: list[Any]) -> tuple[Any, ...]:
    """Run one command on ``engine``; its answer, a failure included, never a dead engine.

    Out of device memory: ``("oom", first line)``, the cache the failed command left
    given back (the engine serves on, as a real one fails a request); any other
    exception: ``("error", "Type: message")``. The trainer raises either
    (:meth:`EngineClient.call`), so a failure is said where it happened rather than as
    an engine that died while the trainer waited.

    Example:
        >>> class Failing:
        ...     def run(self, command, args):
        ...         raise ValueError("no such weight")
        >>> answer(Failing(), "sync_tensors", [])
        ('error', 'ValueError: no such weight')
    """
    try:
        reply: tuple[Any, ...] = engine.run(command, args)
    except torch.OutOfMemoryError as exc:
        torch.cuda.empty_cache()
        # torch's first line runs on through every process's use: up to what was free
        said, free, _ = first_line(exc).partition(" is free.")
        return ("oom", said + free)
    except Exception as exc:
        return ("error", f"{type(exc).__name__}: {exc}")
    return reply


class _Engine:
    """The engine's state between commands: its memory and the bucket it receives from."""

    def __init__(self, memory: EngineMemory, conn: Connection, device: int) -> None:
        self.memory = memory
        self.conn = conn
        self.device = device
        self.receiver: BucketReceiver | None = None

    def run(self, command: str, args: list[Any]) -> tuple[Any, ...]:
        """Run one command; return the answer to send."""
        memory = self.memory
        if command == "wake":
            return ("ok", memory.wake(list(args[0])))
        if command == "sleep":
            memory.sleep()
        elif command == "stats":
            return ("ok", *memory.held())
        elif command == "kv_target":  # before the first KV wake (--need sizes it then)
            memory.kv_target = int(args[0])
        elif command == "pack_weights":  # the weights made from now on (a hybridmem user's)
            memory.pack = True
        elif command == "pack_report":
            return ("ok", memory.pack_report)
        elif command == "anatomy":
            return ("ok", cache_anatomy())
        elif command == "bucket":
            self.receiver = BucketReceiver(args[0])
        elif command == "sync_bucket":
            assert self.receiver is not None
            assert memory.weights is not None
            _sync_bucket(self.receiver, self.conn, memory.weights)
            torch.cuda.synchronize()
        elif command == "sync_tensors":
            assert memory.weights is not None
            _sync_tensors(args[0], memory.weights, self.device)
        elif command == "sync_fresh":
            assert memory.weights is not None
            _sync_fresh(self.conn, memory.weights, self.device)
        elif command == "generate":
            assert memory.weights is not None
            assert memory.kv is not None
            started = time.perf_counter()
            _generate(memory.weights, memory.kv, int(args[0]))
            return ("ok", time.perf_counter() - started)
        else:
            return ("error", f"unknown command {command!r}")
        return ("ok",)


class EngineClient:
    """The trainer's handle on the engine process, with SGLang's method names.

    ``release_memory_occupation()`` and ``resume_memory_occupation(tags)``, as an
    ``sglang.Engine`` has them, so strategies drive it through
    :class:`hybridmem.SGLangEngine`; the hand-back is read after the switch, with what
    the KV wake took given back (:meth:`read_handback`).
    """

    def __init__(
        self, conn: BoundedConn, context_bytes: int, total_bytes: int, *, anatomy: bool = False
    ) -> None:
        self.anatomy = anatomy
        self.last_anatomy: dict[str, Any] = {}
        self.conn = conn
        self.context_bytes = context_bytes
        self.total_bytes = total_bytes
        self.engine_seconds = 0.0
        #: seconds in the engine's own memory calls (``wake``, ``sleep``) since reset
        self.memory_seconds = 0.0
        self.last_kv = 0
        #: ``--need`` runs: what the rollout needs on the device (its weights and KV
        #: cache), which the ``planned`` strategy's switch is told; None otherwise.
        self.rollout_need: int | None = None
        self.last_handback = 0.0
        #: the hand-back with the trainer's pages that hold live state counted as not
        #: reclaimable (None where it cannot be read: no snapshot, or a paused region)
        self.last_handback_pages: float | None = None
        self.last_missing: dict[str, int] = {}
        #: what the last KV wake took of device free memory, and the engine's
        #: ``(allocated, reserved)`` before it (:meth:`read_handback` reads them)
        self._before_kv: tuple[int, int, int] | None = None
        #: ``(allocated, reserved)`` torch counted for the trainer's torch_memory_saver
        #: region when it was made (the ``tms`` strategy), and what of it is paused now:
        #: torch keeps counting a paused region, though its memory is back on the device.
        self.trainer_region = (0, 0)
        self.trainer_hidden = (0, 0)

    def call(self, *command: Any) -> tuple[Any, ...]:
        started = time.perf_counter()
        self.conn.send(command)
        reply = self.conn.recv()
        seconds = time.perf_counter() - started
        self.engine_seconds += seconds
        if command[0] in ("wake", "sleep"):  # the engine's own memory calls
            self.memory_seconds += seconds
        if reply[0] == "oom":
            raise EngineOutOfMemory(
                f"the engine ran out of device memory in {command[0]!r}: {reply[1]}"
            )
        if reply[0] != "ok":
            raise RuntimeError(f"engine answered {reply!r}")
        return tuple(reply)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Wake ``tags`` (``weights``, ``kv_cache``; None: both); note what the KV wake took.

        No synchronize here: the trainer's offload may still be copying under the KV
        wake. :meth:`read_handback` reads the hand-back once the switch
        is done.
        """
        tags = list(tags) if tags is not None else ["weights", "kv_cache"]
        if "kv_cache" not in tags:
            self.call("wake", tags)
            return
        _, engine_allocated, engine_reserved = self.call("stats")
        device = _torch.current_device()
        assert device is not None  # the trainer has made its state on the GPU
        free_before = _torch.mem_get_info(device)[0]
        answer = self.call("wake", tags)
        self.last_kv = int(answer[1])
        took = free_before - _torch.mem_get_info(device)[0]
        self._before_kv = (took, engine_allocated, engine_reserved)

    def read_handback(self) -> None:
        """The hand-back, read after the switch to rollout, as if just before the KV wake.

        Device free memory over what could be free, with what the KV wake took (device
        free memory it used; what the engine counted before it) given back: the
        moment the trainer state has gone and the engine has yet to take its cache,
        whether or not the offload's copies still ran under the KV wake (where they
        did, that moment never exists; its landing frees are counted here). Sets
        :attr:`last_handback`, :attr:`last_handback_pages` and :attr:`last_missing`
        (and :attr:`last_anatomy`);
        nothing when no KV wake was seen since the last reading.
        """
        if self._before_kv is None:
            return
        took, engine_allocated, engine_reserved = self._before_kv
        self._before_kv = None
        device = _torch.current_device()
        assert device is not None
        _torch.synchronize(device)  # the switch is done: nothing of it waits on this
        info = memory_info(device)  # one reading: the allocator's counters and the device's
        assert info.free is not None  # this process has a context: a full reading
        assert info.total is not None
        free, total = info.free + took, info.total
        allocated = info.allocated - self.trainer_hidden[0]
        reserved = info.reserved - self.trainer_hidden[1]
        live = allocated + engine_allocated
        # The contexts as they are now: lazily loaded kernels and library
        # workspaces grow them after the start, and no switch can free them.
        context = (total - free) - reserved - engine_reserved
        # What the trainer's NCCL communicators hold and a suspend would give back
        # (ncclCommMemStats): not context, since it could be free; 0 with none, with
        # them suspended, or where NCCL cannot say (then it stays in the context).
        communicators = sum(c.suspendable or 0 for c in info.communicators if c.suspended is False)
        context -= communicators
        from hybridmem.bench.figures import handback_ratio

        self.last_handback = handback_ratio(free, total, live, context)
        # torch counts a paused torch_memory_saver region as allocated: its pages are
        # not the trainer's to keep, so the page count is read only without one.
        kept = kept_page_bytes() if self.trainer_hidden == (0, 0) else None
        self.last_handback_pages = (
            None if kept is None else handback_ratio(free, total, live + kept, context)
        )
        # What kept the hand-back below 1: caches either process kept, communicators.
        self.last_missing = {
            "trainer_cached": reserved - allocated,
            "engine_cached": engine_reserved - engine_allocated,
            "communicators": communicators,
            "context_growth": context - self.context_bytes,
        }
        if self.anatomy:  # what those caches are made of, and who holds them
            seconds = self.engine_seconds
            self.last_anatomy = {"trainer": cache_anatomy(), "engine": self.call("anatomy")[1]}
            self.engine_seconds = seconds  # untimed, as the reading is

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Put the engine to sleep (its regions paused, or its tensors freed)."""
        self.call("sleep")
