"""The timeline: what each phase and primitive did to memory, and when.

A process-wide, thread-safe recorder that costs one bool check when off. Turned on
by :func:`record` (context manager and decorator) or ``HYBRIDMEM_TIMELINE=path``
(from import until exit). Events carry the name, the backend, the start (wall
clock, comparable between processes of one host), the duration, the device, the
rank, the process (pid and a label such as ``trainer`` or ``engine``), and
allocated / reserved / device-free memory before and after. Export as JSON lines
(one event per line) and as a Chrome trace (``chrome://tracing`` and Perfetto load
it), one file per process; ``hybridmem plot`` merges the files of several processes
(a trainer and its engine, several ranks) on one time axis.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ParamSpec, TypeVar, overload

from hybridmem import _torch
from hybridmem._checks import is_bare_decoration
from hybridmem._files import TIMELINE_ENV, FileProblem, check_writable, timeline_env_problem
from hybridmem._log import logger, warn_once
from hybridmem._names import suggests_keywords
from hybridmem._scope import ScopedContext
from hybridmem.observe.memory import MemoryInfo, memory_info

__all__ = [
    "TIMELINE_ENV",
    "Event",
    "Recording",
    "Timeline",
    "begin",
    "chrome_trace",
    "end",
    "get_timeline",
    "process_label",
    "record",
    "recording",
    "traced",
]

_P = ParamSpec("_P")
_R = TypeVar("_R")
_Decorated = TypeVar("_Decorated", bound=Callable[..., Any])

MEMORY_KEYS = ("allocated", "reserved", "free", "used")


@dataclass(frozen=True)
class Event:
    """One recorded span.

    Attributes:
        name: what ran (``"phase:rollout"``, ``"release_cache"``, ``"offload"``,
            ``"stage:wake_kv"``, ``"weight_sync.send"``...).
        kind: ``"phase"``, ``"stage"`` or ``"primitive"``.
        backend: the backend of a phase or stage, else None.
        start: wall-clock start (``time.time()``), seconds.
        duration: seconds.
        device: the CUDA device measured (None without one).
        rank: the process's rank (``torch.distributed``, else ``RANK``, else 0).
        pid, thread: where it ran.
        before, after: ``allocated``, ``reserved``, device ``free`` and ``used``
            (total minus free, every process) bytes; empty when no device has a
            context.
        args: anything else worth keeping (bytes moved, tags...).
        process: what this process is (``"trainer"``, ``"engine"``; empty when
            nobody said: see :func:`record`).
    """

    name: str
    kind: str
    backend: str | None
    start: float
    duration: float
    device: int | None
    rank: int
    pid: int
    thread: int
    before: dict[str, int] = field(default_factory=dict)
    after: dict[str, int] = field(default_factory=dict)
    args: dict[str, Any] = field(default_factory=dict)
    process: str = ""

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


def _multi_process() -> bool:
    if _torch.dist_initialized():
        return True
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def _memory(
    device: int | None, info: MemoryInfo | None = None
) -> tuple[int | None, dict[str, int]]:
    info = memory_info(device) if info is None else info
    if not info.available or info.free is None or info.total is None:
        return (device if device is not None else _torch.current_device()), {}
    figures = {
        "allocated": info.allocated,
        "reserved": info.reserved,
        "free": info.free,
        "used": info.total - info.free,
    }
    if info.communicators and info.nccl is not None:  # what NCCL says its groups hold
        figures["nccl"] = info.nccl
    return info.device, figures


@dataclass
class _Open:
    name: str
    kind: str
    backend: str | None
    device: int | None
    start: float
    clock: float
    before: dict[str, int]
    args: dict[str, Any]


class Timeline:
    """The recorder: keeps events in memory; exports them on demand.

    Thread-safe (one lock around the list). Listeners (``add_listener``) are called
    with each finished event, in the thread that finished it.
    """

    def __init__(self) -> None:
        self._events: list[Event] = []
        self._lock = threading.Lock()
        self._listeners: list[Callable[[Event], None]] = []
        #: what this process is, put on every event (``record(process=...)``).
        self.process = ""

    def add(self, event: Event) -> None:
        """Keep ``event`` and tell the listeners."""
        with self._lock:
            self._events.append(event)
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(event)
            except Exception:  # a listener must not break the code it observes
                logger.exception("timeline listener %r failed", listener)

    def add_listener(self, listener: Callable[[Event], None]) -> None:
        """Call ``listener(event)`` for every event recorded from now on."""
        with self._lock:
            self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[Event], None]) -> None:
        """Stop calling ``listener`` (no error if it was not added)."""
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def events(self) -> list[Event]:
        """A copy of the events recorded so far, in the order they finished."""
        with self._lock:
            return list(self._events)

    def clear(self) -> None:
        """Forget the recorded events."""
        with self._lock:
            self._events.clear()

    def paths(self, path: str | os.PathLike[str]) -> tuple[Path, Path]:
        """Where :meth:`save` writes for ``path``: (JSON lines, Chrome trace) of this rank."""
        base = Path(path)
        stem = base.name.removesuffix(".jsonl").removesuffix(".json")
        if _multi_process():
            stem = f"{stem}.rank{_torch.process_rank()}"
        return base.with_name(f"{stem}.jsonl"), base.with_name(f"{stem}.trace.json")

    def save(self, path: str | os.PathLike[str]) -> tuple[Path, Path]:
        """Write the events as JSON lines and as a Chrome trace; return both paths.

        ``path`` may end in ``.jsonl`` or not; with more than one process (a
        ``torch.distributed`` group or ``WORLD_SIZE`` > 1) the rank goes into the
        file names (``timeline.rank3.jsonl``).
        """
        lines, trace = self.paths(path)
        lines.parent.mkdir(parents=True, exist_ok=True)
        events = self.events()
        with open(lines, "w") as fh:
            for event in events:
                fh.write(json.dumps(event.as_dict()) + "\n")
        trace.write_text(json.dumps(chrome_trace(events)))
        logger.info("timeline: %d events written to %s and %s", len(events), lines, trace)
        return lines, trace


def process_label(event: dict[str, Any]) -> str:
    """How a row is named: ``"engine (rank 0, pid 812)"``, or ``"rank 0, pid 812"``."""
    where = f"rank {event.get('rank', 0)}, pid {event.get('pid', 0)}"
    return f"{event['process']} ({where})" if event.get("process") else where


def chrome_trace(events: list[Event] | list[dict[str, Any]]) -> dict[str, Any]:
    """The Chrome trace-event form: one complete event per span, memory as counters.

    One trace process per OS process (named by :func:`process_label`), so the files
    of a trainer and its engine, or of several ranks, merge on one time axis (start
    times are wall clock, comparable between the processes of one host).
    """
    rows = [e.as_dict() if isinstance(e, Event) else e for e in events]
    trace: list[dict[str, Any]] = []
    named: set[int] = set()
    for event in rows:
        pid = int(event.get("pid", 0))
        if pid not in named:
            named.add(pid)
            trace.append(
                {
                    "name": "process_name",
                    "ph": "M",
                    "pid": pid,
                    "args": {"name": process_label(event)},
                }
            )
        start_us = event["start"] * 1e6
        trace.append(
            {
                "name": event["name"],
                "cat": event.get("kind", ""),
                "ph": "X",
                "ts": start_us,
                "dur": event["duration"] * 1e6,
                "pid": pid,
                "tid": event.get("thread", 0),
                "args": {
                    "backend": event.get("backend"),
                    "device": event.get("device"),
                    "rank": event.get("rank", 0),
                    **(event.get("args") or {}),
                },
            }
        )
        for stamp, memory in (
            (start_us, event.get("before") or {}),
            (start_us + event["duration"] * 1e6, event.get("after") or {}),
        ):
            if memory:
                trace.append(
                    {
                        "name": "memory (GiB)",
                        "ph": "C",
                        "ts": stamp,
                        "pid": pid,
                        "args": {k: v / 2**30 for k, v in memory.items()},
                    }
                )
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


_TIMELINE = Timeline()
# Read on every primitive call: a plain module-level bool is the cheapest check.
_enabled = False
_depth = 0
_state_lock = threading.Lock()


@suggests_keywords
def get_timeline() -> Timeline:
    """The process-wide :class:`Timeline`."""
    return _TIMELINE


def recording() -> bool:
    """Whether events are being recorded now."""
    return _enabled


def begin(
    name: str,
    kind: str = "primitive",
    *,
    backend: str | None = None,
    device: int | None = None,
    memory: MemoryInfo | None = None,
    **args: Any,
) -> _Open | None:
    """Start a span; returns None (and costs nothing else) when not recording.

    ``memory``: a reading the caller just made for ``device``, used instead of a new one.
    """
    if not _enabled:
        return None
    index, before = _memory(device, memory)
    return _Open(name, kind, backend, index, time.time(), time.perf_counter(), before, args)


def end(span: _Open | None, *, memory: MemoryInfo | None = None, **args: Any) -> None:
    """Finish a span from :func:`begin` and record it (None: nothing to do).

    ``memory``: a reading the caller just made for the span's device, used as is.
    """
    if span is None:
        return
    duration = time.perf_counter() - span.clock
    _, after = _memory(span.device, memory)
    _TIMELINE.add(
        Event(
            name=span.name,
            kind=span.kind,
            backend=span.backend,
            start=span.start,
            duration=duration,
            device=span.device,
            rank=_torch.process_rank(),
            pid=os.getpid(),
            thread=threading.get_ident(),
            before=span.before,
            after=after,
            args={**span.args, **args},
            process=_TIMELINE.process,
        )
    )


def traced(
    name: str, summary: Callable[[Any], dict[str, Any]] | None = None
) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Record every call of the decorated function as a ``primitive`` span.

    ``summary(result)`` adds a few figures of the result to the event (bytes moved).
    Off, the wrapper costs one bool check.
    """

    def decorate(fn: Callable[_P, _R]) -> Callable[_P, _R]:
        @functools.wraps(fn)
        def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            if not _enabled:
                return fn(*args, **kwargs)
            span = begin(name)
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:
                end(span, error=repr(exc))
                raise
            end(span, **(summary(result) if summary is not None else {}))
            return result

        return wrapper

    return decorate


class Recording(ScopedContext):
    """Record events while active (see :func:`record`)."""

    def __init__(
        self, path: str | os.PathLike[str] | None = None, *, process: str | None = None
    ) -> None:
        super().__init__()
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise TypeError(
                f"record's path must be a str, an os.PathLike or None, got {path!r} "
                f"({type(path).__name__}); for example hm.record('out/timeline')"
            )
        self.path = None if path is None else Path(path)
        if process is not None and not isinstance(process, str):
            raise TypeError(f"process must be a str or None, got {process!r}")
        self.process = process

    def __repr__(self) -> str:
        return f"record({str(self.path) if self.path else ''})"

    def _enter(self) -> object:
        global _enabled, _depth
        if self.path is not None:
            for target in _TIMELINE.paths(self.path):  # checked now, not at the exit
                try:
                    check_writable(target, "the timeline")
                except FileProblem as exc:
                    raise ValueError(f"{self!r}: {exc}; give a path that can be written") from None
        with _state_lock:
            _depth += 1
            _enabled = True
            if self.process is not None:
                _TIMELINE.process = self.process
        return None

    def _exit(self, token: object, exc: BaseException | None) -> None:
        global _enabled, _depth
        with _state_lock:
            _depth -= 1
            _enabled = _depth > 0 or _env_path is not None
        if self.path is not None:
            try:
                _TIMELINE.save(self.path)
            except OSError as error:  # the path was checked at entry: a full disk, say
                logger.error("%r: could not write the timeline: %s", self, error)
                if exc is None:  # never hide the block's own exception behind this one
                    raise ValueError(f"{self!r}: could not write the timeline: {error}") from None


@overload
def record(
    path: str | os.PathLike[str] | None = None, *, process: str | None = None
) -> Recording: ...


@overload
def record(path: _Decorated, /) -> _Decorated: ...


@suggests_keywords
def record(path: Any = None, *, process: str | None = None) -> Any:
    """Record a timeline of phases and primitives for a block or call.

    ``@hm.record`` without parentheses records each call of what it decorates, in
    memory, as ``@hm.record()`` does.

    Args:
        path: where to write when the scope ends (JSON lines plus a Chrome trace,
            see :meth:`Timeline.save`); None keeps the events in memory only
            (:func:`events`).
        process: what this process is (``"trainer"``, ``"engine"``): the name of
            its row when ``hybridmem plot`` merges several processes' files (from
            entry on, for the whole process).

    Returns:
        A :class:`Recording` (context manager and decorator in every form).

    Raises:
        TypeError: ``path`` is not a str, an os.PathLike or None, or ``process``
            not a str or None.

    Scope: process-wide (every thread records while any scope is active); nests.
    Each event costs two memory readings (a few microseconds); off, a primitive
    pays one bool check.

    Example:
        >>> with hm.record("out/timeline"):      # doctest: +SKIP
        ...     for step in range(steps):
        ...         train_step(); rollout()
    """
    if is_bare_decoration(path):
        return Recording(process=process)(path)
    return Recording(path, process=process)


def _save_from_env() -> None:
    if _env_path is not None:
        try:
            _TIMELINE.save(_env_path)
        except OSError as exc:  # pragma: no cover - the process is exiting
            logger.warning("could not write the timeline to %s: %s", _env_path, exc)


def _start_from_env() -> None:
    """Recording from the env starts at import: its path is checked then, not at exit."""
    global _env_path, _enabled
    raw = os.environ.get(TIMELINE_ENV) or None
    if raw is None:
        return
    problem = timeline_env_problem(raw)
    if problem is not None:
        warn_once("timeline-env", f"{problem}; nothing is recorded")
        return
    _env_path = raw
    _enabled = True
    atexit.register(_save_from_env)


_env_path: str | None = None
_start_from_env()


def _reset_for_tests() -> None:
    global _enabled, _depth, _env_path
    with _state_lock:
        _depth = 0
        _env_path = None
        _enabled = False
    _TIMELINE.clear()
    _TIMELINE.process = ""
    with _TIMELINE._lock:
        _TIMELINE._listeners.clear()


def iter_jsonl(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Read events back from a JSON-lines timeline file."""
    with open(path) as fh:
        for line in fh:
            if line.strip():
                yield json.loads(line)
