"""Groups through a WeightBucket: whole, with their tags, as views where they fit one buffer.

On the CPU the bucket is host shared memory (the seam treats CPU tensors as device
tensors), so :meth:`WeightBucket.send_groups` and :meth:`BucketReceiver.receive_groups`
run for real in two threads; the device hand-off (interprocess events) is played by
fakes of the seam, and each protocol step by a scripted peer.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hybridmem as hm
from hybridmem import _torch
from tests.channels import ScriptedChannel

KiB = 1024
Group = tuple[list[tuple[str, torch.Tensor]], Any]


def _receive_in_thread(
    handle: hm.BucketHandle, conn: Connection, *, views: bool = True
) -> tuple[threading.Thread, dict[str, Any]]:
    """Receive one sync of groups in a thread: each group's clones, tag, and whether views."""
    result: dict[str, Any] = {"groups": []}

    def target() -> None:
        try:
            with hm.BucketReceiver(handle) as receiver:
                spans = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in receiver._buffers]
                for tensors, tag in receiver.receive_groups(conn, views=views):
                    inside = [
                        any(lo <= t.data_ptr() < hi for lo, hi in spans)
                        for _, t in tensors
                        if t.numel()
                    ]
                    clones = [(name, t.clone()) for name, t in tensors]
                    result["groups"].append((clones, tag, inside))
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    return thread, result


def _same(got: list[tuple[str, torch.Tensor]], sent: list[tuple[str, torch.Tensor]]) -> None:
    assert [name for name, _ in got] == [name for name, _ in sent]
    for (name, a), (_, b) in zip(got, sent, strict=True):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), name
        assert torch.equal(a, b), name


def test_groups_arrive_whole_with_their_tags_as_views_where_they_fit(
    cpu_as_device: list[int], pipe: tuple[Connection, Connection]
) -> None:
    torch.manual_seed(0)
    groups: list[Group] = [
        ([("q", torch.randn(100)), ("k", torch.randn(7).to(torch.bfloat16))], "layer0"),
        ([("fp8", torch.randint(-8, 8, (3,), dtype=torch.int8)), ("scale", torch.rand(1))], 1),
        ([("embed", torch.randn(3000))], ("big", True)),  # 12000 B: over the 4 KiB buffer
        ([], None),  # an empty group still arrives, with its tag
        ([("step", torch.tensor(7)), ("none", torch.empty(0, 3))], "last"),
    ]
    with hm.WeightBucket(4 * KiB) as bucket:
        thread, result = _receive_in_thread(bucket.handle, pipe[1])
        report = bucket.send_groups(iter(groups), pipe[0])
        thread.join(timeout=60)
    assert "error" not in result, result.get("error")
    got = result["groups"]
    assert [tag for _, tag, _ in got] == [tag for _, tag in groups]
    for (tensors, _, _), (sent, _) in zip(got, groups, strict=True):
        _same(tensors, sent)
    views = [inside for _, _, inside in got]
    assert views == [[True, True], [True, True], [False], [], [True]]
    assert report.tensors == 7
    assert report.nbytes == sum(t.nbytes for sent, _ in groups for _, t in sent)


def test_a_group_that_fits_only_by_element_size_still_comes_as_views(
    cpu_as_device: list[int], pipe: tuple[Connection, Connection]
) -> None:
    # 3 + 4 + 4076 bytes: past 4096 at 256-byte offsets, 4084 at element-size ones.
    group = [
        ("a", torch.ones(3, dtype=torch.int8)),
        ("b", torch.full((1,), 2.0)),
        ("c", torch.arange(1019, dtype=torch.float32)),
    ]
    with hm.WeightBucket(4 * KiB) as bucket:
        thread, result = _receive_in_thread(bucket.handle, pipe[1])
        bucket.send_groups([(group, "g")], pipe[0])
        thread.join(timeout=60)
    ((tensors, tag, inside),) = result["groups"]
    _same(tensors, group)
    assert (tag, inside) == ("g", [True, True, True])


def test_copies_when_views_are_not_asked_for(
    cpu_as_device: list[int], pipe: tuple[Connection, Connection]
) -> None:
    group = [("w", torch.arange(10.0))]
    with hm.WeightBucket(4 * KiB) as bucket:
        thread, result = _receive_in_thread(bucket.handle, pipe[1], views=False)
        bucket.send_groups([(group, 0)], pipe[0])
        thread.join(timeout=60)
    ((tensors, _, inside),) = result["groups"]
    _same(tensors, group)
    assert inside == [False]


_dtypes = st.sampled_from([torch.int8, torch.bfloat16, torch.float32, torch.float64])
_tensor = st.tuples(_dtypes, st.integers(0, 700))


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(layout=st.lists(st.lists(_tensor, max_size=5), max_size=6), seed=st.integers(0, 9))
def test_any_groups_arrive_as_sent(
    cpu_as_device: list[int], layout: list[list[tuple[torch.dtype, int]]], seed: int
) -> None:
    torch.manual_seed(seed)
    groups: list[Group] = [
        (
            [
                (f"g{g}.t{i}", (torch.randn(n) * 50).to(dtype))
                for i, (dtype, n) in enumerate(tensors)
            ],
            g,
        )
        for g, tensors in enumerate(layout)
    ]
    a, b = mp.Pipe()
    try:
        with hm.WeightBucket(2 * KiB) as bucket:
            thread, result = _receive_in_thread(bucket.handle, b)
            bucket.send_groups(iter(groups), a)
            thread.join(timeout=60)
    finally:
        a.close()
        b.close()
    assert "error" not in result, result.get("error")
    assert [tag for _, tag, _ in result["groups"]] == list(range(len(groups)))
    for (tensors, _, _), (sent, _) in zip(result["groups"], groups, strict=True):
        _same(tensors, sent)


def test_a_producer_reads_its_groups_one_at_a_time_as_it_sends(
    cpu_as_device: list[int], pipe: tuple[Connection, Connection]
) -> None:
    made: list[int] = []

    def layers() -> Iterator[Group]:
        for layer in range(6):
            made.append(layer)
            yield [(f"l{layer}", torch.full((200,), float(layer)))], layer

    with hm.WeightBucket(1 * KiB) as bucket:
        thread, result = _receive_in_thread(bucket.handle, pipe[1])
        bucket.send_groups(layers(), pipe[0])
        thread.join(timeout=60)
    assert made == list(range(6))
    assert [float(t[0][1][0]) for t, _, _ in result["groups"]] == [0, 1, 2, 3, 4, 5]


def _entry(name: str, tensor: torch.Tensor, offset: int = 0) -> tuple[Any, ...]:
    return (name, str(tensor.dtype), tuple(tensor.shape), 0, tensor.nbytes, offset, tensor.nbytes)


def test_views_are_acknowledged_only_once_the_next_group_is_asked_for(
    cpu_as_device: list[int],
) -> None:
    with hm.WeightBucket(4 * KiB) as bucket, hm.BucketReceiver(bucket.handle) as receiver:
        small, big = torch.zeros(4), torch.zeros(600)
        first = ("b", "torch.float32", (600,), 0, 1200, 0, 2400)  # b, split in two batches
        second = ("b", "torch.float32", (600,), 1200, 1200, 0, 2400)
        channel = ScriptedChannel(
            [
                ("begin", 1),
                ("batch", 1, 1, 0, (_entry("a", small),), ("group", "views")),
                ("batch", 1, 2, 1, (first,), None),
                ("batch", 1, 3, 0, (second,), ("group", "copies")),
                ("end", 1, 4, 2, small.nbytes + big.nbytes),
            ]
        )
        groups = receiver.receive_groups(channel)
        _, tag = next(groups)
        assert tag == "views"
        assert [m[0] for m in channel.sent] == ["hello"]
        _, tag = next(groups)  # the views' batch acknowledged before the next is read
        assert tag == "copies"
        assert [m[:3] for m in channel.sent[1:]] == [
            ("ack", 1, 1),
            ("ack", 1, 2),
            ("ack", 1, 3),
        ]
        assert next(groups, None) is None
        assert channel.sent[-1] == ("ack", 1, 4)


def test_each_side_names_the_other_call_when_they_do_not_match(cpu_as_device: list[int]) -> None:
    with hm.WeightBucket(4 * KiB) as bucket, hm.BucketReceiver(bucket.handle) as receiver:
        group_sync = ScriptedChannel([("begin", 1), ("group", 1, 1, "t")])
        with pytest.raises(RuntimeError, match="receive_groups"):
            list(receiver.receive(group_sync))
        plain_sync = ScriptedChannel(
            [("begin", 2), ("batch", 2, 1, 0, (_entry("a", torch.zeros(2)),))]
        )
        with pytest.raises(RuntimeError, match=r"BucketReceiver\.receive\b"):
            list(receiver.receive_groups(plain_sync))
        assert plain_sync.sent[-1][0] == "abort"
        with pytest.raises(TypeError, match=r"\(named_tensors, tag\) pairs"):
            bucket.send_groups([{"w": torch.ones(2)}], ScriptedChannel())  # type: ignore[list-item]


class _Events:
    """The seam's interprocess events, faked: what is opened, waited on and recorded."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.opened: list[Any] = []
        self.waited: list[Any] = []
        self.recorded: list[Any] = []
        monkeypatch.setattr(_torch, "open_ipc_event", self.open)
        monkeypatch.setattr(_torch, "ipc_event_handle", lambda event: f"handle-{event}")
        monkeypatch.setattr(_torch, "wait_event", lambda stream, e: self.waited.append(e))
        monkeypatch.setattr(_torch, "record_event", lambda e, stream: self.recorded.append(e))

    def open(self, index: int, handle: Any) -> Any:
        self.opened.append(handle)
        return handle


def _device_receiver(message: Any) -> list[Any]:
    """A receiver that hands off on the device: its events in every hello, every batch acked."""
    if message[0] == "begin":
        return [("hello", message[1], 4242, ["drained0", "drained1"])]
    if message[0] in ("batch", "end"):
        return [("ack", message[1], message[2])]
    return []


def test_a_producer_opens_the_receivers_events_once_and_waits_for_them_after_a_failed_sync(
    cpu_as_device: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    events = _Events(monkeypatch)
    tensors = {"a": torch.ones(300), "b": torch.ones(300)}  # two batches of 2 KiB
    with hm.WeightBucket(2 * KiB) as bucket:
        bucket._filled = ["filled0", "filled1"]  # as a device bucket's
        bucket._peer.track = lambda pid: None  # type: ignore[method-assign]
        channel = ScriptedChannel(answer=_device_receiver)
        bucket.send(tensors, channel)
        bucket.send(tensors, channel)
        assert events.opened == ["drained0", "drained1"]  # opened once, sent every sync
        assert events.waited == ["drained0", "drained1"] * 2  # each fill after the reads
        bucket._forget_receiver(None, None)  # what a failed sync does
        events.waited.clear()
        bucket.send(tensors, channel)
        assert events.waited == ["drained0", "drained1"]  # the hello came before any fill
        assert events.opened[2:] == ["drained0", "drained1"]


def test_a_receiver_sends_its_events_with_every_hello_and_records_them_when_stopped(
    cpu_as_device: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    events = _Events(monkeypatch)
    monkeypatch.setattr(_torch, "wait_stream", lambda a, b: None)
    with hm.WeightBucket(4 * KiB) as bucket, hm.BucketReceiver(bucket.handle) as receiver:
        receiver._drained = ["e0", "e1"]  # as a receiver on the bucket's own device
        receiver._filled = ["f0", "f1"]
        for sync in (1, 2):
            channel = ScriptedChannel([("begin", sync), ("end", sync, 1, 0, 0)])
            assert list(receiver.receive_groups(channel)) == []
            assert channel.sent[0] == (
                "hello",
                sync,
                channel.sent[0][2],
                ["handle-e0", "handle-e1"],
            )
        channel = ScriptedChannel(
            [("begin", 3), ("batch", 3, 1, 0, (_entry("a", torch.zeros(4)),), ("group", 0))]
        )
        groups = receiver.receive_groups(channel)
        next(groups)
        events.recorded.clear()
        groups.close()  # the user stops with views in hand
        assert events.recorded == ["e0", "e1"]  # the producer's next fills wait for them
        assert channel.sent[-1] == ("abort", 3, "the receiver stopped before the end")
