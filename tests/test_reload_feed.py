"""A reload fed to the copy engines a chunk at a time from a thread (decision 94).

On the CPU the Offloader's tensors stand in for device ones (``cpu_as_device``). The
feed's pacing is checked with a fake stream whose events complete only when the test
says: ``synchronize_event`` in the feed's thread returns once the feed is told to
stop (or after a bound of five seconds, so that a broken test fails, never hangs).
The rate is the GPU test's and the benchmark's.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hybridmem as hm
from hybridmem import _torch
from hybridmem.memory.reload_feed import FEED_DEPTH, ReloadFeed
from tests.test_offload import assert_bitwise_equal, offloaded_model, snapshot

BOUND_S = 5.0  # the longest a fake event waits for the test: a failure, never a hang


class Paced:
    """A fake stream and its events: the thread's waits after the ``free``-th hold."""

    def __init__(self) -> None:
        self.feed: ReloadFeed | None = None
        self.free = 0  # waits that return at once before the rest hold
        self.waits = 0
        self.queried = 0
        self.gate: threading.Event | None = None  # set: the waits hold on it instead
        self.holding = threading.Event()  # the thread reached a wait that holds

    def synchronize_event(self, event: Any) -> None:
        self.waits += 1
        if self.gate is not None:
            self.gate.wait(BOUND_S)
        elif self.waits > self.free:
            assert self.feed is not None
            self.holding.set()
            self.feed._stop.wait(BOUND_S)  # held until the feed is told to stop

    def query_event(self, event: Any) -> bool:
        self.queried += 1
        return False  # never landed while the caller allocates: it keeps the window


@pytest.fixture
def paced(cpu_as_device: list[int], monkeypatch: pytest.MonkeyPatch) -> Paced:
    """The feed's stream is a fake one (:func:`start`); its events complete when the test says."""
    pace = Paced()
    monkeypatch.setattr(_torch, "release_stream", lambda s: None)
    monkeypatch.setattr(_torch, "wait_stream", lambda a, b: None)
    monkeypatch.setattr(_torch, "synchronize_stream", lambda s: None)
    monkeypatch.setattr(_torch, "stream_scope", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(_torch, "new_event", object)
    monkeypatch.setattr(_torch, "record_event", lambda event, s: None)
    monkeypatch.setattr(_torch, "synchronize_event", pace.synchronize_event)
    monkeypatch.setattr(_torch, "query_event", pace.query_event)
    return pace


def start(off: hm.Offloader, pace: Paced | None = None, **kw: Any) -> ReloadFeed:
    """``off.start_reload(**kw)`` with one storage per chunk, its feed known to ``pace``."""
    kw.setdefault("chunk_bytes", 1)
    if pace is None:
        return off.start_reload(**kw)
    # The thread may wait before start_reload returns: the fake needs the feed first.
    real_start = ReloadFeed.start

    def started(feed: ReloadFeed) -> None:
        pace.feed = feed
        real_start(feed)

    stream = object()  # the feed's alone: the Offloader's own copies stay unpaced
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ReloadFeed, "start", started)
        patch.setattr(_torch, "new_stream", lambda device: stream)
        return off.start_reload(**kw)


@contextlib.contextmanager
def ended(feed: ReloadFeed) -> Iterator[ReloadFeed]:
    """The feed, stopped at the end even if the test failed (its thread must not linger)."""
    try:
        yield feed
    finally:
        if feed.pending:
            with contextlib.suppress(Exception):
                feed.stop()


def test_a_feed_reloads_every_storage_bit_for_bit(cpu_as_device: list[int]) -> None:
    model, optimizer, before, off = offloaded_model()
    feed = start(off)
    report = feed.finish(by="copy_engine")
    assert not off.offloaded_groups
    assert report.tensors == len(off._slots)
    assert report.nbytes == sum(slot.nbytes for slot in off._slots)
    assert feed.report is report
    assert not feed.pending
    assert_bitwise_equal(before, snapshot(model, optimizer))
    off.offload()  # the Offloader is free again, and cycles
    off.start_reload().finish()
    assert_bitwise_equal(before, snapshot(model, optimizer))


def test_the_window_holds_two_chunks_while_the_caller_allocates(paced: Paced) -> None:
    _, _, _, off = offloaded_model()
    with ended(start(off, paced)) as feed:
        # Every storage allocated; copies queued only while the window had room.
        assert all(slot.storage.nbytes() == slot.nbytes for slot in off._slots)
        assert feed.fed_bytes == sum(slot.nbytes for slot in off._slots[:FEED_DEPTH])
        assert paced.queried >= len(off._slots) - FEED_DEPTH  # polled, never waited
        # Allocated already: a room check asks nothing more of the device.
        assert off.reload_bytes() == 0
        assert off.offloaded_groups  # the rest: still the pool's only good copy


def test_finish_copies_the_rest_by_kernel_beside_what_was_fed(
    paced: Paced, cpu_mapping: list[int]
) -> None:
    model, optimizer, before, off = offloaded_model()
    paced.free = 3  # the thread feeds three more chunks, then holds
    feed = start(off, paced)
    assert paced.holding.wait(BOUND_S)
    report = feed.finish(by="kernel")
    fed = FEED_DEPTH + paced.free
    assert len(cpu_mapping) == len(off._slots) - fed  # the rest, by kernel
    assert report.tensors == len(off._slots)
    assert not off.offloaded_groups
    assert_bitwise_equal(before, snapshot(model, optimizer))


def test_stop_keeps_what_was_fed_and_frees_the_rest_for_a_later_reload(paced: Paced) -> None:
    model, optimizer, before, off = offloaded_model()
    feed = start(off, paced)
    report = feed.stop()
    slots = off._slots
    assert report.tensors == FEED_DEPTH
    assert [s.offloaded for s in slots] == [False] * FEED_DEPTH + [True] * (len(slots) - FEED_DEPTH)
    assert all(s.storage.nbytes() == 0 for s in slots[FEED_DEPTH:])  # given back
    assert off.reload_bytes() > 0  # the rest needs the device again
    off.reload()
    assert_bitwise_equal(before, snapshot(model, optimizer))


def test_the_offloader_refuses_other_calls_while_a_feed_runs(paced: Paced) -> None:
    _, _, _, off = offloaded_model()
    with ended(start(off, paced)) as feed:
        for call in (off.reload, off.offload, off.start_offload, off.start_reload, off.close):
            with pytest.raises(RuntimeError, match=r"finish\(\) or stop\(\) on what start_reload"):
                call()
        feed.finish()
    off.offload()  # free again


def test_a_feed_ends_once(paced: Paced) -> None:
    _, _, _, off = offloaded_model()
    feed = start(off, paced)
    feed.stop()
    for end in (feed.stop, feed.finish):
        with pytest.raises(RuntimeError, match="already ended"):
            end()
    off.reload()


def test_nothing_offloaded_gives_an_ended_feed(cpu_as_device: list[int]) -> None:
    _, _, _, off = offloaded_model()
    off.reload()
    feed = off.start_reload()
    assert not feed.pending
    assert feed.report is not None
    assert feed.report.tensors == 0
    off.offload()  # nothing was left in flight
    off.reload()


def test_a_failed_allocation_keeps_what_was_fed_and_leaves_the_rest_offloaded(
    cpu_as_device: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer, before, off = offloaded_model()
    real = _torch.resize_storage
    grown: list[int] = []

    def resize(storage: Any, nbytes: int) -> None:
        if nbytes:
            grown.append(nbytes)
            if len(grown) == 3:
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        real(storage, nbytes)

    monkeypatch.setattr(_torch, "resize_storage", resize)
    with pytest.raises(
        hm.OffloadError, match=r"feed failed at .*OutOfMemoryError.*2 storages were reloaded"
    ):
        off.start_reload(chunk_bytes=1)
    slots = off._slots
    assert [s.offloaded for s in slots[:2]] == [False, False]
    assert all(s.offloaded and s.storage.nbytes() == 0 for s in slots[2:])
    monkeypatch.setattr(_torch, "resize_storage", real)
    off.reload()  # the Offloader is free, and the rest intact in the pool
    assert_bitwise_equal(before, snapshot(model, optimizer))


def test_a_failed_rest_leaves_it_offloaded_and_intact(
    paced: Paced, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer, before, off = offloaded_model()
    feed = start(off, paced)
    host = off._host
    real = type(host).copy_one

    def broken(self: Any, slot: Any, device: Any, **kw: Any) -> None:
        raise RuntimeError("copy failed (injected)")

    monkeypatch.setattr(type(host), "copy_one", broken)
    with pytest.raises(hm.OffloadError, match=r"rest of a feed .* 2 storages were reloaded"):
        feed.finish(by="copy_engine")
    assert not feed.pending
    assert all(s.offloaded and s.storage.nbytes() == 0 for s in off._slots[FEED_DEPTH:])
    monkeypatch.setattr(type(host), "copy_one", real)
    off.reload()
    assert_bitwise_equal(before, snapshot(model, optimizer))


def test_an_error_in_the_thread_leaves_the_rest_to_finish(
    paced: Paced, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="hybridmem")
    model, optimizer, before, off = offloaded_model()
    paced.free = 1000  # the thread never holds
    host = off._host
    real = type(host).copy_one
    calls: list[int] = []

    def flaky(self: Any, slot: Any, device: Any, **kw: Any) -> None:
        calls.append(slot.nbytes)
        if len(calls) == 4:  # the thread's: the caller fed the first two
            raise RuntimeError("copy failed (injected)")
        real(self, slot, device, **kw)

    monkeypatch.setattr(type(host), "copy_one", flaky)
    feed = start(off, paced)
    assert feed._thread is not None
    feed._thread.join(BOUND_S)  # it ended on the error
    report = feed.finish(by="copy_engine")  # the rest, the failed one included
    assert isinstance(feed.error, RuntimeError)
    assert "reload feed stopped early after 3 storages" in caplog.text
    assert report.tensors == len(off._slots)
    assert_bitwise_equal(before, snapshot(model, optimizer))


def test_a_thread_that_does_not_stop_is_an_error_naming_what_remains(paced: Paced) -> None:
    _, _, _, off = offloaded_model()
    paced.gate = threading.Event()  # the thread's wait holds past the stop
    feed = start(off, paced)
    try:
        with pytest.raises(hm.OffloadError, match=r"did not stop within .*2 storages were queued"):
            feed.finish(timeout_s=0.01)
        assert feed.pending  # the Offloader stays busy: the thread may still queue
        with pytest.raises(RuntimeError, match="while a reload is in flight"):
            off.reload()
    finally:
        paced.gate.set()
    feed.stop()  # the wait returned: it stops now
    off.reload()


@pytest.mark.parametrize(("chunk", "error"), [(0, ValueError), (1.5, TypeError), ("1", TypeError)])
def test_a_bad_chunk_is_refused_before_anything_moves(
    cpu_as_device: list[int], chunk: Any, error: type[Exception]
) -> None:
    _, _, _, off = offloaded_model()
    with pytest.raises(error, match="chunk_bytes"):
        off.start_reload(chunk_bytes=chunk)
    assert all(slot.storage.nbytes() == 0 for slot in off._slots)  # nothing allocated
    off.reload()


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    free=st.integers(0, 12),
    chunk=st.sampled_from([1, 256, 4096, 1 << 20]),
    end=st.sampled_from(["finish-kernel", "finish-copy", "stop"]),
)
def test_any_stop_point_and_chunk_keep_every_bit(
    paced: Paced, cpu_mapping: list[int], free: int, chunk: int, end: str
) -> None:
    model, optimizer, before, off = offloaded_model()
    paced.free, paced.waits = free, 0
    paced.holding.clear()
    feed = start(off, paced, chunk_bytes=chunk)
    assert feed._thread is not None
    while feed._thread.is_alive() and not paced.holding.wait(0.01):
        pass  # until it holds, or fed everything (few chunks)
    if end == "stop":
        feed.stop()
        off.reload()
    else:
        feed.finish(by="kernel" if end == "finish-kernel" else "copy_engine")
    assert not off.offloaded_groups
    assert_bitwise_equal(before, snapshot(model, optimizer))
