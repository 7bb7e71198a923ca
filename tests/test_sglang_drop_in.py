"""The SGLang drop-in's payload, loaded by SGLang's own code (its wheel) as per tensor.

For every batch (dtypes, shapes incl. 0-d, strided views, odd sizes next to wider
dtypes), SGLang's own ``_update_weights_from_flattened_bucket`` rebuilding the
drop-in's payload must load exactly the tensors SGLang's per-tensor path loads (each
tensor as it is), bit for bit. SGLang's own ``FlattenedTensorBucket`` cannot carry
three of those batches; the drop-in can.
"""

from __future__ import annotations

import asyncio
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridmem.integrations import sglang
from tests import sglang_oracle


@pytest.fixture
def oracle() -> types.SimpleNamespace:
    if sglang_oracle.wheel() is None:
        if sglang_oracle.required():
            pytest.fail(sglang_oracle.missing_reason() + " (HYBRIDMEM_REQUIRE_SGLANG=1)")
        pytest.skip(sglang_oracle.missing_reason())
    return sglang_oracle.load()


@pytest.fixture(autouse=True)
def _fresh_buffers() -> Iterator[None]:
    yield
    sglang.release_buffers()


DTYPES = [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int8, torch.int64, torch.bool]


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int, strided: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    full = (*shape[:-1], shape[-1] * 2) if strided and shape else shape
    count = int(torch.Size(full).numel())
    high = 2 if dtype == torch.bool else 256  # a bool's byte is 0 or 1
    raw = torch.randint(0, high, (count * dtype.itemsize,), generator=gen).to(torch.uint8)
    tensor = raw.view(dtype).reshape(full)
    return tensor[..., ::2] if strided and shape else tensor


def per_tensor_loads(
    oracle: Any, batch: list[tuple[str, torch.Tensor]]
) -> list[tuple[str, torch.Tensor]]:
    """What SGLang's per-tensor path loads: each tensor unwrapped by its own _unwrap_tensor."""
    return [(name, oracle.unwrap(tensor, tp_rank=0, device="cpu")) for name, tensor in batch]


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's values as bytes, whatever its strides (a fresh dense copy)."""
    return torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor).reshape(-1).view(torch.uint8)


def same(a: list[tuple[str, torch.Tensor]], b: list[tuple[str, torch.Tensor]]) -> None:
    assert [n for n, _ in a] == [n for n, _ in b]
    for (name, x), (_, y) in zip(a, b):
        assert x.dtype == y.dtype, name
        assert x.shape == y.shape, name
        assert torch.equal(_bytes(x), _bytes(y)), name


@settings(max_examples=60, deadline=None)
@given(
    batch=st.lists(
        st.tuples(
            st.sampled_from(DTYPES),
            st.lists(st.integers(1, 7), min_size=0, max_size=3).map(tuple),
            st.booleans(),
        ),
        min_size=1,
        max_size=30,
    ),
    seed=st.integers(0, 1000),
)
def test_sglangs_server_loads_what_the_per_tensor_path_loads(batch: list[Any], seed: int) -> None:
    oracle = sglang_oracle.load() if sglang_oracle.wheel() else pytest.skip("no wheel")
    named = [(f"t{i}", _tensor(d, s, seed + i, strided)) for i, (d, s, strided) in enumerate(batch)]
    payload = sglang.flattened_payload(named, oracle.FlattenedTensorMetadata)
    same(sglang_oracle.server_loads(oracle, payload), per_tensor_loads(oracle, named))


def test_what_sglangs_own_bucket_cannot_carry(oracle: Any) -> None:
    odd = [("scale_inv", torch.arange(3, dtype=torch.int8)), ("scale", torch.ones(2))]
    strided = [("w", torch.arange(12.0).reshape(3, 4)[:, ::2])]
    with pytest.raises(RuntimeError):  # unaligned: the fp32 starts at byte 3
        oracle.FlattenedTensorBucket(named_tensors=odd).reconstruct_tensors()
    with pytest.raises(RuntimeError):  # a strided view flattened and viewed as bytes
        oracle.FlattenedTensorBucket(named_tensors=strided)
    with pytest.raises(ValueError, match="empty"):
        oracle.FlattenedTensorBucket(named_tensors=[])
    for batch in (odd, strided):
        payload = sglang.flattened_payload(batch, oracle.FlattenedTensorMetadata)
        same(sglang_oracle.server_loads(oracle, payload), per_tensor_loads(oracle, batch))


def test_one_buffer_made_once_and_reused(oracle: Any) -> None:
    batch = [("a", torch.ones(1000)), ("b", torch.zeros(10, dtype=torch.int8))]
    first = sglang.flattened_payload(batch, oracle.FlattenedTensorMetadata)["flattened_tensor"]
    again = sglang.flattened_payload(batch, oracle.FlattenedTensorMetadata)["flattened_tensor"]
    assert first.untyped_storage().data_ptr() == again.untyped_storage().data_ptr()
    bigger = sglang.flattened_payload([("c", torch.ones(5000))], oracle.FlattenedTensorMetadata)[
        "flattened_tensor"
    ]
    assert bigger.numel() == 20_000  # grown once, to what this batch needs


def test_bad_batches_are_typed_errors(oracle: Any) -> None:
    with pytest.raises(ValueError, match="empty batch"):
        sglang.flattened_payload([], oracle.FlattenedTensorMetadata)
    with pytest.raises(TypeError, match=r"\(name, tensor\) pairs"):
        sglang.flattened_payload([("a", 1)], oracle.FlattenedTensorMetadata)  # type: ignore[list-item]


def test_update_weights_sends_one_flattened_request_on_sglangs_path(
    oracle: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang's modules around the call are stand-ins (SGLang's runtime does not install
    here); the payload is the one the tests above hold against SGLang's own code."""
    sent: list[Any] = []
    per_tensor: list[Any] = []

    class Engine:
        async def update_weights_from_tensor(self, request: Any) -> Any:
            sent.append(request)
            return True, "Success"

    async def original(*args: Any) -> str:
        per_tensor.append(args)
        return "per-tensor"

    modules = {
        "sglang": types.ModuleType("sglang"),
        "sglang.srt": types.ModuleType("sglang.srt"),
        "sglang.srt.weight_sync": types.ModuleType("sglang.srt.weight_sync"),
        "sglang.srt.weight_sync.utils": types.SimpleNamespace(
            update_weights=original, _preprocess_tensor_for_update_weights=lambda t: t
        ),
        "sglang.srt.weight_sync.tensor_bucket": types.SimpleNamespace(
            FlattenedTensorMetadata=oracle.FlattenedTensorMetadata
        ),
        "sglang.srt.managers.io_struct": types.SimpleNamespace(
            UpdateWeightsFromTensorReqInput=lambda **kw: types.SimpleNamespace(**kw)
        ),
        "sglang.srt.utils": types.SimpleNamespace(
            MultiprocessingSerializer=types.SimpleNamespace(serialize=lambda obj: obj)
        ),
        "sglang.srt.utils.patch_torch": types.SimpleNamespace(
            monkey_patch_torch_reductions=lambda: None
        ),
    }
    modules["sglang.srt.weight_sync"].utils = modules["sglang.srt.weight_sync.utils"]  # type: ignore[attr-defined]
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(
        torch.distributed,
        "gather_object",
        lambda obj, object_gather_list, dst, group: object_gather_list.__setitem__(0, obj),
    )
    monkeypatch.setattr(torch.distributed, "barrier", lambda group=None: None)
    mesh = types.SimpleNamespace(
        mesh=torch.tensor([0]), get_local_rank=lambda: 0, get_group=lambda: None
    )
    batch = [("a", torch.arange(3, dtype=torch.int8)), ("b", torch.ones(4))]
    answer = asyncio.run(sglang.update_weights(Engine(), batch, "tp", {"tp": mesh}))
    assert answer == (True, "Success")
    assert sent[0].load_format == "flattened_bucket"
    same(sglang_oracle.server_loads(oracle, sent[0].serialized_named_tensors[0]), batch)
    assert asyncio.run(sglang.update_weights(Engine(), [], "tp", {"tp": mesh})) == "per-tensor"
    asyncio.run(sglang.update_weights(Engine(), batch, "tp", {"tp": mesh}, "direct"))
    assert len(per_tensor) == 2  # empty batches and other formats: SGLang's own way
