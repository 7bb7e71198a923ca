"""Sequence packing on the GPU: the sync budget in torch's sync-debug "error" mode, gradients.

torch's sync debug mode turns every synchronising CUDA call (``.item()``,
``.tolist()`` of a device tensor, a boolean-mask index, a blocking copy) into an
error in "error" mode and a warning in "warn" mode: the budget is checked by torch
itself, and a control shows that the mode catches a sync.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from hybridmem.packing import PackedBatch, pack, unpack
from hybridmem.packing import verl as hm_verl
from tests import verl_oracle
from tests.verl_oracle import FakeMegatron

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True, params=["triton", "torch"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs on both paths: Triton's kernels (where installed) and torch's calls."""
    monkeypatch.setenv("HYBRIDMEM_PACKING_TRITON", "1" if request.param == "triton" else "0")
    return str(request.param)


@contextlib.contextmanager
def sync_errors() -> Iterator[None]:
    """Every synchronising CUDA call in the block raises (the inputs are made before)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def count_syncs(fn: Callable[[], object]) -> int:
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(w.message) for w in caught)


def batch(rows: int = 16, seq_len: int = 512, hidden: int = 64) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(rows + seq_len)
    lengths = torch.randint(0, seq_len + 1, (rows,), generator=gen)
    lengths[0], lengths[1] = 0, seq_len  # an empty row and a full one
    right = torch.arange(seq_len)[None, :] < lengths[:, None]
    scrambled = torch.stack([r[torch.randperm(seq_len, generator=gen)] for r in right])
    mask = torch.where(torch.arange(rows)[:, None] % 2 == 0, right, scrambled).cuda()
    x = torch.randn(rows, seq_len, hidden, device="cuda", dtype=torch.bfloat16)
    return x, mask, lengths


def test_the_mode_catches_a_sync() -> None:
    """Control: without it the budget tests below could not fail."""
    x, mask, _ = batch()
    with sync_errors(), pytest.raises(RuntimeError, match="synchronizing"):
        x[0, mask[0]]


@pytest.mark.parametrize("cp_size", [1, 2])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_zero_syncs_with_host_lengths(cp_size: int, as_tensor: bool) -> None:
    x, mask, lengths = batch()
    host = lengths if as_tensor else lengths.tolist()
    width = mask.shape[1]
    with sync_errors():
        ranks = [
            pack(x, mask, lengths=host, align=8, cp_size=cp_size, cp_rank=r) for r in range(cp_size)
        ]
        back = unpack([p.tensor * 2 for p in ranks], ranks[0], seq_len=width)
        wider = unpack([p.tensor for p in ranks], ranks[-1], seq_len=width + 64)
    keep = mask[:, :, None]
    assert torch.equal(back, torch.where(keep, x * 2, torch.zeros_like(x)))
    assert torch.equal(wider[:, :width] * 2, back)
    assert not wider[:, width:].any()


def test_one_sync_from_the_mask_and_none_in_unpack_after() -> None:
    x, mask, _ = batch()
    made: list[PackedBatch] = []
    assert count_syncs(lambda: made.append(pack(x, mask, align=8))) == 1
    packed = made[0]
    assert count_syncs(lambda: unpack(packed.tensor, packed, seq_len=512)) == 0
    # and the hand-written pattern, for scale: one sync per sample and more
    assert count_syncs(lambda: [x[i, mask[i]] for i in range(mask.shape[0])]) >= mask.shape[0]


def test_equal_to_the_per_sample_reference_on_the_gpu() -> None:
    x, mask, lengths = batch(rows=32, seq_len=1024, hidden=16)
    packed = pack(x, mask, lengths=lengths.tolist(), align=16)
    pieces = []
    for i in range(mask.shape[0]):
        row = x[i][mask[i]]
        size = -(-row.shape[0] // 16) * 16
        pieces.append(torch.cat([row, row.new_zeros(size - row.shape[0], 16)]))
    assert torch.equal(packed.tensor[0], torch.cat(pieces))
    assert packed.cu_seqlens_padded.device.type == "cuda"
    assert packed.cu_seqlens_padded.dtype == torch.int32


def test_a_backward_through_pack_and_unpack() -> None:
    x, mask, lengths = batch(hidden=32)
    x = x.float().requires_grad_()
    weight = torch.randn(32, 32, device="cuda")
    packed = pack(x, mask, lengths=lengths.tolist(), align=8, cp_size=2, cp_rank=0)
    other = pack(x, mask, lengths=lengths.tolist(), align=8, cp_size=2, cp_rank=1)
    out = unpack([packed.tensor @ weight, other.tensor @ weight], packed, seq_len=512)
    torch.autograd.backward(out.sum())
    assert x.grad is not None
    expected = torch.where(mask[:, :, None], weight.sum(1).expand_as(x), torch.zeros_like(x))
    torch.testing.assert_close(x.grad, expected)


@pytest.fixture
def stand_in_megatron(monkeypatch: pytest.MonkeyPatch) -> FakeMegatron:
    """Megatron's parallel state stood in for (tp 8, no context parallelism)."""
    fake = FakeMegatron()
    fake.set(8, 1, 0)
    for name, module in fake.modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    return fake


@pytest.mark.parametrize("fp8", [False, True])
def test_the_verl_pair_makes_no_sync_with_host_lengths(
    fp8: bool, stand_in_megatron: FakeMegatron
) -> None:
    x, mask, lengths = batch()
    with sync_errors():
        out, params = hm_verl.preprocess_packed_seqs(x, mask, True, fp8, lengths=lengths.tolist())
        back = hm_verl.postprocess_packed_seqs(out * 2, params, mask, *mask.shape)
    assert torch.equal(back, torch.where(mask[:, :, None], x * 2, torch.zeros_like(x)))


def test_the_verl_pair_makes_one_sync_from_the_mask(stand_in_megatron: FakeMegatron) -> None:
    x, mask, _ = batch()
    made: list[Any] = []
    assert count_syncs(lambda: made.append(hm_verl.preprocess_packed_seqs(x, mask))) == 1
    out, params = made[0]
    assert count_syncs(lambda: hm_verl.postprocess_packed_seqs(out, params, mask, 16, 512)) == 0


@pytest.mark.parametrize("fp8", [False, True])
def test_the_verl_pair_equals_verls_own_on_the_gpu(fp8: bool) -> None:
    fake = FakeMegatron()
    module = verl_oracle.load(fake)
    if module is None:
        pytest.skip(verl_oracle.missing_reason())
    x, mask, _ = batch(rows=8, seq_len=1024, hidden=64)
    mask = mask.bool()
    with verl_oracle.installed(fake.modules()):
        for cp in (1, 2):
            outs = []
            for rank in range(cp):
                fake.set(2, cp, rank)
                theirs, their_params = module.preprocess_packed_seqs(x, mask, True, fp8)
                ours, our_params = hm_verl.preprocess_packed_seqs(x, mask, True, fp8)
                assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16))
                for name in ("cu_seqlens_q", "cu_seqlens_kv_padded"):
                    assert torch.equal(getattr(our_params, name), getattr(their_params, name))
                assert our_params.max_seqlen_q == their_params.max_seqlen_q
                outs.append((ours, our_params, their_params))
            if cp == 1:
                ours, our_params, their_params = outs[0]
                want = module.postprocess_packed_seqs(ours, their_params, mask, 8, 1024)
                got = hm_verl.postprocess_packed_seqs(ours, our_params, mask, 8, 1024)
                assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_a_plan_packs_again_and_unpacks_without_a_sync() -> None:
    x, mask, lengths = batch()
    packed = pack(x, mask, lengths=lengths.tolist(), align=8)
    with sync_errors():
        again = packed.pack(x * 3)
        back = unpack(again, packed, seq_len=512)
    assert torch.equal(back, torch.where(mask[:, :, None], x * 3, torch.zeros_like(x)))


@pytest.mark.parametrize(("cp", "total"), [(1, None), (1, 256), (2, None), (4, 512)])
def test_the_two_paths_agree_bit_for_bit(path: str, cp: int, total: int | None) -> None:
    if path == "torch":
        pytest.skip("compares the paths: runs once")
    x, mask, lengths = batch(rows=32, seq_len=1024, hidden=96)
    host = lengths.tolist()
    for rank in range(cp):
        args: dict[str, Any] = {
            "align": 8 * cp,
            "total_align": total,
            "cp_size": cp,
            "cp_rank": rank,
        }
        fast = pack(x, mask, lengths=host, **args)
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("HYBRIDMEM_PACKING_TRITON", "0")
            slow = pack(x, mask, lengths=host, **args)
            want = unpack(slow.tensor, slow, seq_len=1100) if cp == 1 else None
        assert torch.equal(fast.tensor.view(torch.int16), slow.tensor.view(torch.int16))
        if want is not None:
            got = unpack(fast.tensor, fast, seq_len=1100)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))
