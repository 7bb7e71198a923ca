"""The verl drop-in against verl's own bucketed weight transfer, read from verl's wheel.

Every model (dtypes bf16, fp8, ints, bool; shapes 0-d to 3-d, strided views; a tensor
larger than the bucket; none at all; several syncs in a row) goes through verl 0.9.1's
own sender and receiver (:mod:`tests.verl_transfer_oracle`) and through the drop-in:
``on_bucket_received`` must see the same calls, the same names in each, the same
``is_last``, and the same tensors bit for bit. Then what verl's pair does not do:
a tensor over the bucket with ``use_shm``, a peer that dies or fails on either side
(a typed error on both ends, within the timeout), and 100 syncs that leave no fd,
``/dev/shm`` entry or thread behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridmem import SyncError, _torch
from hybridmem.integrations.verl import link
from hybridmem.integrations.verl import settings as verl_settings
from hybridmem.integrations.verl.batches import VerlBatches
from hybridmem.integrations.verl.transfer import BucketedWeightReceiver, BucketedWeightSender
from hybridmem.ipc.bucket import WeightBucket
from tests import verl_oracle, verl_transfer_oracle
from tests.conftest import patch_seam
from tests.helpers import fds_opened_since, mappings_added_since, open_fds, shared_mappings

Weights = list[tuple[str, torch.Tensor]]
Callbacks = list[tuple[Weights, bool]]
MiB = 1 << 20

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float8_e4m3fn,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.float64,
]


def _oracle() -> Any:
    if verl_transfer_oracle.transfer_source() is None:
        if verl_oracle.required():
            pytest.fail(verl_oracle.missing_reason() + " (HYBRIDMEM_REQUIRE_VERL=1)")
        pytest.skip(verl_oracle.missing_reason())
    return verl_transfer_oracle


@pytest.fixture(autouse=True)
def _fresh_links() -> Iterator[None]:
    yield
    link.close_links()


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int, strided: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    full = shape if not strided or not shape else (*shape[:-1], shape[-1] * 2)
    high = 2 if dtype == torch.bool else 256  # a bool's byte is 0 or 1
    raw = torch.randint(0, high, (max(1, int(torch.Size(full).numel())) * 8,), generator=gen)
    base = raw.to(torch.uint8)[: torch.Size(full).numel() * dtype.itemsize]
    tensor = base.view(dtype).reshape(full) if full else base.view(dtype).reshape(())
    return tensor[..., ::2] if strided and shape else tensor


def ours(
    weights: Weights, bucket_size_mb: int, *, use_shm: bool = False, bucket_bytes: int | None = None
) -> Callbacks:
    """The drop-in's callbacks for one sync (sender here, receiver in a thread)."""
    handle = f"ipc:///tmp/hybridmem-verl-test-{os.getpid()}-{threading.get_ident()}.sock"
    seen: Callbacks = []
    failed: list[BaseException] = []

    def receive() -> None:
        try:
            receiver = BucketedWeightReceiver(handle, torch.device("cpu"), use_shm=use_shm)
            receiver.receive_weights(
                lambda batch, last: seen.append(([(n, t.clone()) for n, t in batch], last))
            )
        except BaseException as exc:  # reported below
            failed.append(exc)

    thread = threading.Thread(target=receive)
    thread.start()
    sender = BucketedWeightSender(handle, bucket_size_mb=bucket_size_mb, use_shm=use_shm)
    if bucket_bytes is not None:  # as the oracle sets verl's: the same attribute
        sender.bucket_size = bucket_bytes
    asyncio.run(sender.async_send_weights(iter(weights)))
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert not failed, failed
    return seen


def same(theirs: Callbacks, mine: Callbacks) -> None:
    assert [([n for n, _ in b], last) for b, last in mine] == [
        ([n for n, _ in b], last) for b, last in theirs
    ]
    for (their_batch, _), (my_batch, _) in zip(theirs, mine):
        for (name, a), (_, b) in zip(their_batch, my_batch):
            assert a.dtype == b.dtype, name
            assert a.shape == b.shape, name
            assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), (
                name
            )


models = st.lists(
    st.tuples(
        st.sampled_from(DTYPES),
        st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple),
        st.booleans(),
    ),
    min_size=0,
    max_size=40,
)


@settings(max_examples=40, deadline=None)
@given(model=models, seed=st.integers(0, 1000))
def test_the_callbacks_are_verls_own_bit_for_bit(model: list[Any], seed: int) -> None:
    oracle = _oracle()
    weights = [
        (f"layer{i}.w", _tensor(dtype, shape, seed + i, strided))
        for i, (dtype, shape, strided) in enumerate(model)
    ]
    # A bucket of 1 MiB holds a few of these; one tensor in three models is larger.
    if seed % 3 == 0:
        weights.insert(
            seed % (len(weights) + 1), ("huge", _tensor(torch.float32, (300_000,), seed, False))
        )
    theirs, error = oracle.verl_callbacks(weights, 1)
    assert error is None
    same(theirs, ours(weights, 1))


@settings(max_examples=60, deadline=None)
@given(
    model=st.lists(st.tuples(st.sampled_from(DTYPES), st.integers(0, 40)), min_size=0, max_size=40),
    bucket_bytes=st.sampled_from([8, 37, 64, 100, 256, 1000]),
    seed=st.integers(0, 1000),
)
def test_small_buckets_cut_where_verls_cut(model: list[Any], bucket_bytes: int, seed: int) -> None:
    """Many cuts, each where alignment to the element size decides whether a tensor fits."""
    oracle = _oracle()
    weights = [
        (f"w{i}", _tensor(dtype, (n,), seed + i, False)) for i, (dtype, n) in enumerate(model)
    ]
    theirs, error = oracle.verl_callbacks(weights, 1, bucket_bytes=bucket_bytes)
    assert error is None
    same(theirs, ours(weights, 1, bucket_bytes=bucket_bytes))


@pytest.mark.parametrize("count", [1, 500])
def test_many_tensors_and_small_buckets(count: int) -> None:
    oracle = _oracle()
    weights = [
        (f"p{i}", _tensor(DTYPES[i % len(DTYPES)], (i % 7, 301), i, False)) for i in range(count)
    ]
    theirs, error = oracle.verl_callbacks(weights, 1)
    assert error is None
    same(theirs, ours(weights, 1))


def test_an_empty_model_is_one_empty_last_callback() -> None:
    theirs, error = _oracle().verl_callbacks([], 4)
    assert error is None
    assert [(b, last) for b, last in theirs] == [([], True)]
    assert [(b, last) for b, last in ours([], 4)] == [([], True)]


def test_repeated_syncs_reuse_one_bucket_and_deliver_each_sync() -> None:
    oracle = _oracle()
    for step in range(3):
        weights = [(f"w{i}", torch.full((1000 * (i + 1),), float(step))) for i in range(5)]
        theirs, _ = oracle.verl_callbacks(weights, 1)
        same(theirs, ours(weights, 1))
    assert len(link._senders) == 1  # one link, one bucket, for every sync


def test_a_tensor_over_the_bucket_with_shared_memory_is_delivered_where_verls_asserts() -> None:
    weights = [("a", torch.ones(10)), ("huge", torch.arange(300_000, dtype=torch.float32))]
    theirs, error = _oracle().verl_callbacks(weights, 1, use_shm=True)
    assert isinstance(error, AssertionError)  # verl: after flushing "a"; its receiver waits
    assert [([n for n, _ in b], last) for b, last in theirs] == [(["a"], False)]
    mine = ours(weights, 1, use_shm=True)
    assert [([n for n, _ in b], last) for b, last in mine] == [
        (["a"], False),
        (["huge"], False),
        ([], True),
    ]
    assert torch.equal(mine[1][0][0][1], weights[1][1])


def test_the_batching_rule_by_hand() -> None:
    calls: list[tuple[list[str], bool]] = []
    batches = VerlBatches(16, lambda w, last: calls.append(([n for n, _ in w], last)))
    batches.add("i8", torch.zeros(3, dtype=torch.int8))  # offset 3
    batches.add("f32", torch.zeros(3))  # aligned to 4: 4..16, fits exactly
    batches.add("next", torch.zeros(1, dtype=torch.int8))  # 16 + 1 > 16: flush
    batches.finish()
    assert calls == [(["i8", "f32"], False), (["next"], True)]
    with pytest.raises(ValueError, match="bucket_size must be a whole number"):
        VerlBatches(0, lambda w, last: None)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: BucketedWeightSender("", 1), TypeError, "zmq_handle"),
        (lambda: BucketedWeightSender("ipc:///x", 0), ValueError, "bucket_size_mb"),
        (lambda: BucketedWeightSender("ipc:///x", 1, use_shm=1), TypeError, "use_shm"),  # type: ignore[arg-type]
        (lambda: BucketedWeightReceiver("ipc:///x", "cpu", use_shm="no"), TypeError, "use_shm"),  # type: ignore[arg-type]
        (lambda: BucketedWeightReceiver("ipc:///x", 3.5), TypeError, "device"),  # type: ignore[arg-type]
    ],
)
def test_bad_arguments_are_typed_errors(call: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        call()


def test_a_failing_callback_fails_both_sides_and_the_next_sync_works() -> None:
    handle = f"ipc:///tmp/hybridmem-verl-fail-{os.getpid()}.sock"
    weights = [(f"w{i}", torch.full((100_000,), float(i))) for i in range(8)]
    failures: list[BaseException] = []

    def receive(fail: bool) -> None:
        def apply(batch: Weights, last: bool) -> None:
            if fail:
                raise KeyError("model has no parameter w3")

        try:
            BucketedWeightReceiver(handle, torch.device("cpu")).receive_weights(apply)
        except BaseException as exc:
            failures.append(exc)

    thread = threading.Thread(target=receive, args=(True,))
    thread.start()
    with pytest.raises(SyncError, match="on_bucket_received failed: KeyError"):
        asyncio.run(
            BucketedWeightSender(handle, bucket_size_mb=1).async_send_weights(iter(weights))
        )
    thread.join(timeout=60)
    assert isinstance(failures[0], KeyError)
    thread = threading.Thread(target=receive, args=(False,))  # the link stays usable
    thread.start()
    asyncio.run(BucketedWeightSender(handle, bucket_size_mb=1).async_send_weights(iter(weights)))
    thread.join(timeout=60)
    assert len(failures) == 1


@pytest.mark.parametrize("before", [0, 1, 4])
def test_a_sender_whose_weights_fail_stops_the_receiver(before: int) -> None:
    # Failing before the bucket is sized (the first batches are looked at first) or
    # after: the receiver is told either way, within the sync.
    handle = f"ipc:///tmp/hybridmem-verl-gen-{os.getpid()}.sock"
    failures: list[BaseException] = []

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for index in range(before):
            yield f"w{index}", torch.ones(400_000)
        raise RuntimeError("FSDP gather failed")

    def receive() -> None:
        try:
            BucketedWeightReceiver(handle, torch.device("cpu")).receive_weights(
                lambda batch, last: None
            )
        except BaseException as exc:
            failures.append(exc)

    thread = threading.Thread(target=receive)
    thread.start()
    with pytest.raises(RuntimeError, match="FSDP gather failed"):
        asyncio.run(BucketedWeightSender(handle, bucket_size_mb=1).async_send_weights(weights()))
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert isinstance(failures[0], SyncError)
    assert "FSDP gather failed" in str(failures[0])


def test_no_receiver_is_a_bounded_sync_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDMEM_VERL_TIMEOUT", "0.5")
    sender = BucketedWeightSender(f"ipc:///tmp/hybridmem-verl-alone-{os.getpid()}.sock", 1)
    with pytest.raises(SyncError, match=r"no verl receiver connected .* within 0\.5 s"):
        asyncio.run(sender.async_send_weights(iter([("w", torch.ones(4))])))
    with pytest.raises(SyncError, match=r"no verl sender listens .* after 0\.5 s"):
        BucketedWeightReceiver("ipc:///tmp/nobody.sock", torch.device("cpu")).receive_weights(
            lambda batch, last: None
        )


@pytest.mark.parametrize("value", ["ipc", "CUDA", "1"])
def test_an_unknown_transport_names_the_allowed_ones(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("HYBRIDMEM_VERL_TRANSPORT", value)
    with pytest.raises(ValueError, match=r"HYBRIDMEM_VERL_TRANSPORT=.*'auto', 'cuda', 'fd'"):
        verl_settings.transport()


@pytest.mark.parametrize("value", ["", " host ", "auto"])
def test_a_named_transport_is_the_buckets(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("HYBRIDMEM_VERL_TRANSPORT", value)
    assert verl_settings.transport() == (value.strip() or "auto")


def test_a_hundred_syncs_leave_no_fd_shm_or_thread_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    from multiprocessing import shared_memory

    weights = [(f"w{i}", torch.full((50_000,), float(i))) for i in range(6)]
    ours(weights, 1)  # the link made once
    fds = open_fds()
    mapped = shared_mappings()
    threads = threading.active_count()
    # The names this process makes from now on; other tests' processes (xdist's other
    # workers) make and remove names in /dev/shm at the same time.
    created: list[str] = []
    real = shared_memory.SharedMemory

    def recorded(*args: Any, **kwargs: Any) -> Any:
        made = real(*args, **kwargs)
        if kwargs.get("create"):
            created.append(made.name)
        return made

    monkeypatch.setattr(shared_memory, "SharedMemory", recorded)
    for _ in range(100):
        ours(weights, 1)
    assert fds_opened_since(fds) == {}
    assert mappings_added_since(mapped) == {}
    assert [n for n in created if os.path.exists(f"/dev/shm/{n.lstrip('/')}")] == []
    assert threading.active_count() <= threads + 1  # asyncio's default executor, at most


@pytest.mark.parametrize("value", ["0", "9", "two", "-1", "1.5"])
def test_a_bad_buffer_count_names_the_allowed_ones(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("HYBRIDMEM_VERL_BUFFERS", value)
    with pytest.raises(ValueError, match=r"HYBRIDMEM_VERL_BUFFERS=.*a whole number from 1 to 8"):
        verl_settings.buffers()
    sender = BucketedWeightSender(f"ipc:///tmp/hybridmem-verl-buffers-{os.getpid()}.sock")
    with pytest.raises(ValueError, match="HYBRIDMEM_VERL_BUFFERS"):  # before any wait
        asyncio.run(sender.async_send_weights(iter([("w", torch.ones(4))])))


@pytest.mark.parametrize(
    ("value", "keep", "count"), [("", "0", 2), ("", "1", 3), ("1", "0", 1), ("3", "0", 3)]
)
def test_the_buffer_count_is_the_buckets(
    monkeypatch: pytest.MonkeyPatch, value: str, keep: str, count: int
) -> None:
    monkeypatch.setenv("HYBRIDMEM_VERL_BUFFERS", value)
    monkeypatch.setenv("HYBRIDMEM_VERL_KEEP_BUCKET", keep)
    made = _buckets_made(monkeypatch)
    weights = [(f"w{i}", torch.full((200_000,), float(i))) for i in range(5)]  # 5 batches
    callbacks = ours(weights, 1)
    assert [[n for n, _ in batch] for batch, _ in callbacks] == [[f"w{i}"] for i in range(5)]
    assert [last for _, last in callbacks] == [False] * 4 + [True]
    assert all(torch.equal(t, dict(weights)[n]) for batch, _ in callbacks for n, t in batch)
    assert [bucket.buffers for bucket in made] == [count]


def test_a_sync_known_whole_gets_a_bucket_of_its_own_size(monkeypatch: pytest.MonkeyPatch) -> None:
    # A LoRA adapter's sync in verl's 512 MiB bucket: one buffer, the adapter's bytes
    # (each tensor at a 256-byte offset: 4 x 4096), not two of 512 MiB; a sync larger than the
    # buffers gets verl's bucket size.
    monkeypatch.delenv("HYBRIDMEM_VERL_KEEP_BUCKET", raising=False)
    made = _buckets_made(monkeypatch)
    adapter = [(f"lora_{i}", torch.full((1000 + i,), float(i))) for i in range(4)]
    callbacks = ours(adapter, 512)
    assert [[n for n, _ in batch] for batch, _ in callbacks] == [[n for n, _ in adapter]]
    assert all(torch.equal(t, dict(adapter)[n]) for batch, _ in callbacks for n, t in batch)
    assert [(b.buffers, b.nbytes) for b in made] == [(1, 4 * 4096)]  # 4000-4012 bytes each
    large = [(f"w{i}", torch.full((200_000,), float(i))) for i in range(5)]  # 5 batches of 1 MiB
    ours(large, 1)
    assert (made[-1].buffers, made[-1].nbytes) == (2, 1 << 20)


def _buckets_made(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every bucket the sender's link makes from now on, in order."""
    made: list[Any] = []
    real = WeightBucket

    def recorded(*args: Any, **kwargs: Any) -> Any:
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(link, "WeightBucket", recorded)
    return made


def _closings(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``"receiver"`` and ``"bucket"`` each time either side lets go of a sync's bucket."""
    from hybridmem.ipc.receiver import BucketReceiver

    order: list[str] = []
    for cls, name in ((BucketReceiver, "receiver"), (WeightBucket, "bucket")):
        real = cls.close

        def close(self: Any, _real: Any = real, _name: str = name) -> None:
            if not getattr(self, "_closed", True):
                order.append(_name)
            _real(self)

        monkeypatch.setattr(cls, "close", close)
    return order


def test_by_default_nothing_of_a_sync_stays_after_it_on_either_side(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As verl's own pair: each sync makes its bucket; the worker lets go of it before it
    # answers, then the trainer frees it, so nothing is held through the rollout.
    monkeypatch.delenv("HYBRIDMEM_VERL_KEEP_BUCKET", raising=False)
    order = _closings(monkeypatch)
    made = _buckets_made(monkeypatch)
    weights = [(f"w{i}", torch.full((200_000,), float(i))) for i in range(5)]
    for step in range(3):
        callbacks = ours([(n, t + step) for n, t in weights], 1)
        assert all(torch.equal(t, dict(weights)[n] + step) for b, _ in callbacks for n, t in b)
        (sender,) = link._senders.values()
        (receiver,) = link._receivers.values()
        assert sender.bucket is None
        assert receiver.receiver is None
    assert len(made) == 3  # one a sync
    assert order == ["receiver", "bucket"] * 3  # the worker first, every sync


@pytest.mark.parametrize("how", ["env", "argument"])
def test_a_kept_bucket_is_made_once_and_held_until_close_links(
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    if how == "env":
        monkeypatch.setenv("HYBRIDMEM_VERL_KEEP_BUCKET", "1")
    else:
        monkeypatch.setenv("HYBRIDMEM_VERL_KEEP_BUCKET", "0")
        monkeypatch.setattr(
            BucketedWeightSender,
            "__init__",
            _with_keep(BucketedWeightSender.__init__),
        )
    order = _closings(monkeypatch)
    made = _buckets_made(monkeypatch)
    weights = [(f"w{i}", torch.full((200_000,), float(i))) for i in range(5)]
    for step in range(3):
        callbacks = ours([(n, t + step) for n, t in weights], 1)
        assert all(torch.equal(t, dict(weights)[n] + step) for b, _ in callbacks for n, t in b)
    (sender,) = link._senders.values()
    (receiver,) = link._receivers.values()
    assert len(made) == 1
    assert sender.bucket is made[0]
    assert receiver.receiver is not None
    assert order == []
    link.close_links()
    assert sorted(order) == ["bucket", "receiver"]


def _with_keep(init: Any) -> Any:
    def keeping(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, keep_bucket=True, **kwargs)

    return keeping


@pytest.mark.parametrize("value", ["2", "maybe", "keep"])
def test_a_bad_keep_bucket_value_names_the_allowed_ones(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("HYBRIDMEM_VERL_KEEP_BUCKET", value)
    with pytest.raises(ValueError, match=r"HYBRIDMEM_VERL_KEEP_BUCKET=.*'1' keeps the bucket"):
        verl_settings.keep_bucket()
    sender = BucketedWeightSender(f"ipc:///tmp/hybridmem-verl-keep-{os.getpid()}.sock")
    with pytest.raises(ValueError, match="HYBRIDMEM_VERL_KEEP_BUCKET"):  # before any wait
        asyncio.run(sender.async_send_weights(iter([("w", torch.ones(4))])))
    with pytest.raises(TypeError, match="keep_bucket"):
        BucketedWeightSender("ipc:///tmp/x.sock", keep_bucket="yes")  # type: ignore[arg-type]


def test_a_failed_callback_still_frees_both_ends_and_the_next_sync_goes_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("HYBRIDMEM_VERL_KEEP_BUCKET", raising=False)
    order = _closings(monkeypatch)
    handle = f"ipc:///tmp/hybridmem-verl-fails-{os.getpid()}.sock"
    weights = [(f"w{i}", torch.full((200_000,), float(i))) for i in range(5)]
    failed: list[BaseException] = []

    def receive() -> None:
        def load(batch: Weights, last: bool) -> None:
            if batch[0][0] == "w2":
                raise ValueError("the engine's loader failed")

        try:
            BucketedWeightReceiver(handle, torch.device("cpu")).receive_weights(load)
        except BaseException as exc:  # checked below
            failed.append(exc)

    thread = threading.Thread(target=receive)
    thread.start()
    sender = BucketedWeightSender(handle, bucket_size_mb=1)
    with pytest.raises(SyncError, match="the engine's loader failed"):
        asyncio.run(sender.async_send_weights(iter(weights)))
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert [type(e) for e in failed] == [ValueError]
    (sender_link,) = link._senders.values()
    (receiver_link,) = link._receivers.values()
    assert sender_link.bucket is None
    assert receiver_link.receiver is None
    assert sorted(order) == ["bucket", "receiver"]
    callbacks = ours(weights, 1)  # the next sync on the same connection
    assert [[n for n, _ in batch] for batch, _ in callbacks] == [[f"w{i}"] for i in range(5)]


def test_a_trainer_that_frees_its_bucket_between_syncs_syncs_again() -> None:
    # The trainer's close_links() between syncs (its memory back for a rollout); the
    # worker's end still holds the old link and connects anew at the next sync.
    weights = [(f"w{i}", torch.full((1000,), float(i))) for i in range(3)]
    first = ours(weights, 1)
    with link._senders_lock:
        for sender in link._senders.values():
            sender.close()
        link._senders.clear()
    assert len(link._receivers) == 1
    again = ours([(n, t + 1) for n, t in weights], 1)
    same(first, [([(n, t - 1) for n, t in batch], last) for batch, last in again])


def test_a_receiver_waiting_for_its_sender_does_not_hold_up_another_handles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Handle A's worker waits for a trainer that has not started; handle B's sync in the
    # same process goes through meanwhile, and A's once its trainer comes.
    monkeypatch.setenv("HYBRIDMEM_VERL_TIMEOUT", "30")  # held up, B would fail in 30 s
    handle = f"ipc:///tmp/hybridmem-verl-late-{os.getpid()}.sock"
    seen: list[Any] = []
    failed: list[BaseException] = []
    connecting = threading.Event()
    real_init = link.ReceiverLink.__init__

    def init(self: Any, zmq_handle: str, device: torch.device) -> None:
        if zmq_handle == handle:
            connecting.set()  # A now waits for its sender, its link being made
        real_init(self, zmq_handle, device)

    monkeypatch.setattr(link.ReceiverLink, "__init__", init)

    def wait_for_late_trainer() -> None:
        try:
            receiver = BucketedWeightReceiver(handle, torch.device("cpu"))
            receiver.receive_weights(lambda batch, last: seen.append([n for n, _ in batch]))
        except BaseException as exc:  # reported below
            failed.append(exc)

    waiting = threading.Thread(target=wait_for_late_trainer, daemon=True)
    waiting.start()
    assert connecting.wait(timeout=30)
    weights = [(f"w{i}", torch.full((1000,), float(i))) for i in range(3)]
    assert [n for n, _ in ours(weights, 1)[0][0]] == ["w0", "w1", "w2"]
    assert waiting.is_alive()  # B went through while A still waited
    assert seen == []
    asyncio.run(BucketedWeightSender(handle, bucket_size_mb=1).async_send_weights(iter(weights)))
    waiting.join(timeout=60)
    assert not waiting.is_alive()
    assert not failed, failed
    assert seen == [["w0", "w1", "w2"]]


def _sender_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("hybridmem-verl-sender")}


def test_a_link_sends_from_one_thread_of_its_own_kept_across_syncs_and_event_loops() -> None:
    weights = [(f"w{i}", torch.full((1000,), float(i))) for i in range(4)]
    before = _sender_threads()
    ours(weights, 1)  # a new sender object and event loop each sync, as verl makes them
    made = _sender_threads() - before
    assert len(made) == 1
    for _ in range(3):
        ours(weights, 1)
    assert _sender_threads() - before == made  # no thread made or left per sync
    link.close_links()
    (thread,) = made
    thread.join(timeout=30)
    assert not thread.is_alive()  # closing the link ends its thread


def test_the_copies_wait_for_the_stream_the_weights_were_written_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The sending thread is not the one that wrote the weights: it must order its copies
    # after the writer's current stream, not its own (a trainer on a stream of its own).
    entered: list[tuple[Any, str]] = []
    real_scope = _torch.stream_scope

    def current_stream(device: torch.device) -> Any:
        return ("the current stream of", threading.get_ident())

    def stream_scope(stream: Any) -> Any:
        if isinstance(stream, tuple):
            entered.append((stream, threading.current_thread().name))
            return contextlib.nullcontext()
        return real_scope(stream)

    patch_seam(monkeypatch, "current_stream", current_stream)
    patch_seam(monkeypatch, "stream_scope", stream_scope)
    weights = [(f"w{i}", torch.full((1000,), float(i))) for i in range(3)]
    ((got, last),) = ours(weights, 1)
    assert last
    assert [n for n, _ in got] == ["w0", "w1", "w2"]
    writer = ("the current stream of", threading.get_ident())  # this thread wrote them
    in_sender = [stream for stream, name in entered if name.startswith("hybridmem-verl-sender")]
    assert in_sender == [writer], entered


def _child(target: Any, *args: Any) -> Any:
    import multiprocessing as mp

    process = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
    process.start()
    return process


def test_a_sender_that_dies_mid_sync_is_a_sync_error_in_the_receiver() -> None:
    from tests import verl_peer

    handle = f"ipc:///tmp/hybridmem-verl-dies-{os.getpid()}.sock"
    sender = _child(verl_peer.send, handle, 40, 20)
    delivered: list[bool] = []
    with pytest.raises(SyncError, match=r"died|closed|gone"):
        BucketedWeightReceiver(handle, torch.device("cpu")).receive_weights(
            lambda batch, last: delivered.append(last)
        )
    sender.join(timeout=30)
    assert sender.exitcode == 3
    assert delivered
    assert not any(delivered)
    assert link._receivers[handle].closed  # the next receive connects anew


def test_a_receiver_that_dies_mid_sync_is_a_sync_error_in_the_sender() -> None:
    from tests import verl_peer

    handle = f"ipc:///tmp/hybridmem-verl-rx-dies-{os.getpid()}.sock"
    receiver = _child(verl_peer.receive, handle, 3)
    weights = [(f"w{i}", torch.full((1 << 18,), float(i))) for i in range(40)]
    with pytest.raises(SyncError, match=r"died|closed|gone"):
        asyncio.run(
            BucketedWeightSender(handle, bucket_size_mb=1).async_send_weights(iter(weights))
        )
    receiver.join(timeout=30)
    assert receiver.exitcode == 3
    survivor = _child(verl_peer.receive, handle, None)  # a new worker: the link takes it
    asyncio.run(BucketedWeightSender(handle, bucket_size_mb=1).async_send_weights(iter(weights)))
    survivor.join(timeout=30)
    assert survivor.exitcode == 0
