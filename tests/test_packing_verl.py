"""hybridmem.packing.verl against verl 0.9.1's own functions: every field, every rank, bit for bit.

verl's ``verl/models/mcore/util.py`` is read from the user's copy of verl's wheel
(tests/verl_oracle.py); its Megatron calls and ours both read one stand-in parallel
state, so hybridmem's Megatron path is the one under test. With ``cp > 1``,
``torch.distributed.all_gather`` hands every rank's output to both (the real
collective is tested over gloo in test_ranks_gloo.py).
"""

from __future__ import annotations

import random
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from hybridmem.packing import fp8_alignment, pack, plan, unpack
from hybridmem.packing import verl as hm_verl
from tests import verl_oracle
from tests.verl_oracle import FakeMegatron

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
]


@pytest.fixture(scope="module")
def fake() -> FakeMegatron:
    return FakeMegatron()


@pytest.fixture(scope="module")
def verl(fake: FakeMegatron) -> types.ModuleType:
    module = verl_oracle.load(fake)
    if module is None:
        if verl_oracle.required():
            pytest.fail(verl_oracle.missing_reason() + " (HYBRIDMEM_REQUIRE_VERL=1)")
        pytest.skip(verl_oracle.missing_reason())
    return module


@pytest.fixture
def megatron(fake: FakeMegatron, monkeypatch: pytest.MonkeyPatch) -> FakeMegatron:
    """The stand-in Megatron, installed for hybridmem too (it imports on each call)."""
    for name, module in fake.modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    return fake


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    if a.dtype == torch.bool:
        return bool(torch.equal(a, b))
    return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


FIELDS = (
    "qkv_format",
    "cu_seqlens_q",
    "cu_seqlens_kv",
    "cu_seqlens_q_padded",
    "cu_seqlens_kv_padded",
    "max_seqlen_q",
    "max_seqlen_kv",
)


def same_params(ours: Any, theirs: Any) -> list[str]:
    """The fields that differ (names), comparing tensors bit for bit and ints exactly."""
    wrong = []
    for name in FIELDS:
        a, b = getattr(ours, name), getattr(theirs, name)
        if isinstance(b, torch.Tensor):
            if not (isinstance(a, torch.Tensor) and same_bits(a, b)):
                wrong.append(name)
        elif type(a) is not type(b) or a != b:
            wrong.append(name)
    return wrong


@dataclass
class Case:
    seed: int
    batch: int
    seq_len: int
    tp: int
    cp: int
    kind: str  # "right" (response only) or "prompt+response"
    dtype: torch.dtype
    rest: tuple[int, ...]
    fp8: bool

    def make(self) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed)
        rows = []
        for _ in range(self.batch):
            if self.kind == "right":
                n = int(torch.randint(0, self.seq_len + 1, (), generator=gen))
                rows.append([True] * n + [False] * (self.seq_len - n))
            else:  # a left-padded prompt, then a right-padded response
                half = self.seq_len // 2
                p = int(torch.randint(0, half + 1, (), generator=gen))
                r = int(torch.randint(0, self.seq_len - half + 1, (), generator=gen))
                prompt = [False] * (half - p) + [True] * p
                rows.append(prompt + [True] * r + [False] * (self.seq_len - half - r))
        mask = torch.tensor(rows, dtype=torch.bool)
        shape = (self.batch, self.seq_len, *self.rest)
        if self.dtype.is_floating_point:
            x = torch.randn(shape, generator=gen).to(self.dtype)
        else:
            x = torch.randint(1, 100, shape, generator=gen).to(self.dtype)
        return x, mask


def cases(count: int = 120) -> Iterator[Case]:
    pick = random.Random(24)
    for i in range(count):
        yield Case(
            seed=i,
            batch=pick.randint(1, 8),
            seq_len=pick.choice([1, 7, 16, 37, 64, 130]),
            tp=pick.choice([1, 2]),
            cp=pick.choice([1, 2, 4]),
            kind=pick.choice(["right", "prompt+response"]),
            dtype=DTYPES[i % len(DTYPES)],
            rest=pick.choice([(), (3,), (2, 2)]),
            fp8=pick.random() < 0.3,
        )


CASES = list(cases())


def fake_all_gather(outputs: list[torch.Tensor]) -> Any:
    def all_gather(out: list[torch.Tensor], tensor: torch.Tensor, group: Any = None) -> None:
        for slot, value in zip(out, outputs):
            slot.copy_(value)

    return all_gather


@pytest.mark.parametrize("case", CASES, ids=[f"case{c.seed}" for c in CASES])
def test_pre_and_post_equal_verls_on_every_rank(
    case: Case, verl: types.ModuleType, megatron: FakeMegatron, monkeypatch: pytest.MonkeyPatch
) -> None:
    x, mask = case.make()
    packed_ours, packed_theirs, params_ours = [], [], []
    for rank in range(case.cp):
        megatron.set(case.tp, case.cp, rank, group="cp-group")
        theirs, their_params = verl.preprocess_packed_seqs(x, mask, True, case.fp8)
        ours, our_params = hm_verl.preprocess_packed_seqs(x, mask, True, case.fp8)
        assert same_bits(ours, theirs), (case, rank)
        assert same_params(our_params, their_params) == [], (case, rank)
        assert type(our_params) is type(their_params)  # Megatron's class where installed
        # a later pipeline stage: the input back unchanged, the same params
        theirs_late, their_late = verl.preprocess_packed_seqs(x, mask, False, case.fp8)
        ours_late, our_late = hm_verl.preprocess_packed_seqs(x, mask, False, case.fp8)
        assert ours_late is x
        assert theirs_late is x
        assert same_params(our_late, their_late) == []
        packed_ours.append(ours)
        packed_theirs.append(theirs)
        params_ours.append((our_params, their_params, our_late))
    # post: each rank's model output (another trailing shape and dtype than the input's)
    gen = torch.Generator().manual_seed(case.seed + 1000)
    outputs = [torch.randn((*p.shape[:2], 5), generator=gen) for p in packed_ours]
    monkeypatch.setattr(torch.distributed, "all_gather", fake_all_gather(outputs))
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: case.cp)
    for rank in range(case.cp):
        megatron.set(case.tp, case.cp, rank, group="cp-group")
        our_params, their_params, our_late = params_ours[rank]
        theirs = verl.postprocess_packed_seqs(
            outputs[rank], their_params, mask, case.batch, case.seq_len
        )
        ours = hm_verl.postprocess_packed_seqs(
            outputs[rank], our_params, mask, case.batch, case.seq_len
        )
        assert same_bits(ours, theirs), (case, rank)
        # the params of a pipeline stage that did not pack unpack the same
        late = hm_verl.postprocess_packed_seqs(
            outputs[rank], our_late, mask, case.batch, case.seq_len
        )
        assert same_bits(late, theirs)
        # verl's own params (no plan on them): replanned from their offsets, same answer
        replanned = hm_verl.postprocess_packed_seqs(
            outputs[rank], their_params, mask, case.batch, case.seq_len
        )
        assert same_bits(replanned, theirs), (case, rank)
        skipped = hm_verl.postprocess_packed_seqs(
            outputs[rank], our_params, mask, case.batch, case.seq_len, False
        )
        assert skipped is outputs[rank]


@pytest.mark.parametrize("cp", [2, 4])
def test_post_keeps_only_this_ranks_gradient_as_verl(
    cp: int, verl: types.ModuleType, megatron: FakeMegatron, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = Case(7, 4, 33, 2, cp, "prompt+response", torch.float64, (3,), False)
    x, mask = case.make()
    packed = []
    for rank in range(cp):
        megatron.set(case.tp, cp, rank, group="g")
        packed.append(hm_verl.preprocess_packed_seqs(x, mask)[1])
    gen = torch.Generator().manual_seed(3)
    values = [
        torch.randn(1, (p.cu_seqlens_q_padded[-1] // cp).item(), 3, generator=gen) for p in packed
    ]
    monkeypatch.setattr(torch.distributed, "all_gather", fake_all_gather(values))
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: cp)
    weights = torch.randn(case.batch, case.seq_len, 3, generator=gen, dtype=torch.float64)
    for rank in range(cp):
        megatron.set(case.tp, cp, rank, group="g")
        grads = []
        for fn in (verl.postprocess_packed_seqs, hm_verl.postprocess_packed_seqs):
            leaf = values[rank].clone().requires_grad_()
            params = (
                packed[rank] if fn is hm_verl.postprocess_packed_seqs else _their(verl, x, mask)
            )
            (fn(leaf, params, mask, case.batch, case.seq_len) * weights).sum().backward()
            grads.append(leaf.grad)
        assert grads[0] is not None
        assert grads[1] is not None
        assert same_bits(grads[1], grads[0]), rank


def _their(verl: types.ModuleType, x: torch.Tensor, mask: torch.Tensor) -> Any:
    return verl.preprocess_packed_seqs(x, mask)[1]


def test_equivalence_covers_what_the_issue_names() -> None:
    """The cases span batch 1-8, tp 1/2, cp 1/2/4, both mask kinds, 8 dtypes, FP8 on and off."""
    assert {c.batch for c in CASES} == set(range(1, 9))
    assert {c.tp for c in CASES} == {1, 2}
    assert {c.cp for c in CASES} == {1, 2, 4}
    assert {c.kind for c in CASES} == {"right", "prompt+response"}
    assert {c.dtype for c in CASES} == set(DTYPES)
    assert {c.fp8 for c in CASES} == {True, False}
    assert {(c.cp, c.fp8) for c in CASES} >= {(cp, f) for cp in (1, 2, 4) for f in (True, False)}


# --- without verl: the layout itself, the keyword path, errors ---------------------------


def test_fp8_padding_pads_each_sequence_and_the_total() -> None:
    align, total = fp8_alignment(2)
    assert (align, total) == (16, 256)
    assert fp8_alignment(3) == (48, 384)
    mask = torch.tensor([[1] * 5 + [0] * 15, [1] * 20], dtype=torch.bool)
    x = torch.arange(1, 41).view(2, 20)
    packed = pack(x, mask, lengths=[5, 20], align=align, total_align=total)
    assert packed.padded == [16, 240]  # 16 + 32 = 48, the last takes the rest of 256
    assert packed.cu_seqlens_padded.tolist() == [0, 16, 256]
    assert packed.max_seqlen == 240
    assert packed.tensor.shape == (1, 256)
    back = unpack(packed.tensor, packed, seq_len=20)
    assert torch.equal(back, torch.where(mask, x, 0))
    split = [
        pack(x, mask, lengths=[5, 20], align=align, total_align=total, cp_size=2, cp_rank=r)
        for r in range(2)
    ]
    assert all(s.tensor.shape == (1, 128) for s in split)
    assert torch.equal(unpack([s.tensor for s in split], split[0], seq_len=20), back)


def test_keyword_layout_without_megatron(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "megatron", None)  # an import of it fails
    ids = torch.tensor([[5, 6, 7, 0]])
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    packed, params = hm_verl.preprocess_packed_seqs(ids, mask, tp_size=2)
    assert isinstance(params, hm_verl.PackedSeqParams)
    # the issue's smallest case: verl's cu_seqlens_q is [0, 4], the padded offsets
    assert params.cu_seqlens_q is not None
    assert params.cu_seqlens_q_padded is not None
    assert params.cu_seqlens_q.tolist() == [0, 4]
    assert params.cu_seqlens_q_padded.tolist() == [0, 4]
    assert packed.tolist() == [[5, 6, 7, 0]]
    back = hm_verl.postprocess_packed_seqs(packed * 2, params, mask, 1, 4)
    assert back.tolist() == [[10, 12, 14, 0]]
    with pytest.raises(ValueError, match=r"Megatron is not installed.*tp_size="):
        hm_verl.preprocess_packed_seqs(ids, mask)
    with pytest.raises(ValueError, match="cp_size=2 this rank's cp_rank= must be given"):
        hm_verl.preprocess_packed_seqs(ids, mask, tp_size=1, cp_size=2)
    with pytest.raises(ValueError, match="cp_rank must be in"):
        hm_verl.preprocess_packed_seqs(ids, mask, tp_size=1, cp_size=2, cp_rank=2)
    split, split_params = hm_verl.preprocess_packed_seqs(ids, mask, tp_size=1, cp_size=2, cp_rank=1)
    assert split.tolist() == [[6, 7]]
    with pytest.raises(ValueError, match="pass cp_group="):
        hm_verl.postprocess_packed_seqs(split, split_params, mask, 1, 4)


def test_a_megatron_without_parallel_state_says_how_to_fix_it(
    megatron: FakeMegatron, monkeypatch: pytest.MonkeyPatch
) -> None:
    def not_ready() -> int:
        raise AssertionError("tensor model parallel group is not initialized")

    megatron.set(1, 1, 0)
    monkeypatch.setattr(megatron.mpu, "get_tensor_model_parallel_world_size", not_ready)
    mask = torch.ones(1, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"initialise it .* or pass them as keyword arguments"):
        hm_verl.preprocess_packed_seqs(torch.zeros(1, 4), mask)
    out, _ = hm_verl.preprocess_packed_seqs(torch.zeros(1, 4), mask, tp_size=4)  # given: not read
    assert out.shape == (1, 4)
    # no context-parallel group to be had: packing works, post-processing names the fix
    monkeypatch.setattr(megatron.mpu, "get_context_parallel_group", not_ready)
    split, params = hm_verl.preprocess_packed_seqs(
        torch.zeros(1, 4), mask, tp_size=1, cp_size=2, cp_rank=0
    )
    with pytest.raises(ValueError, match="pass cp_group="):
        hm_verl.postprocess_packed_seqs(split, params, mask, 1, 4)


def test_post_refuses_a_mask_or_size_that_is_not_the_packed_one() -> None:
    mask = torch.ones(2, 4, dtype=torch.bool)
    out, params = hm_verl.preprocess_packed_seqs(torch.zeros(2, 4), mask, tp_size=1)
    with pytest.raises(
        ValueError, match=r"attention_mask is \(2, 4\) but batch_size, seq_len = 3, 4"
    ):
        hm_verl.postprocess_packed_seqs(out, params, mask, 3, 4)
    with pytest.raises(TypeError, match="cu_seqlens_q_padded of 2 offsets"):
        hm_verl.postprocess_packed_seqs(out, object(), mask[:1], 1, 4)
    with pytest.raises(TypeError, match="post_process must be True or False"):
        hm_verl.postprocess_packed_seqs(out, params, mask, 2, 4, 1)  # type: ignore[arg-type]


def test_plan_takes_a_layout_made_elsewhere_and_refuses_a_short_one() -> None:
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    made = plan(mask, lengths=[3, 1], padded=[4, 8], check=True)
    assert made.cu_seqlens_padded.tolist() == [0, 4, 12]
    assert made.pack(torch.tensor([[1, 2, 3, 9], [4, 9, 9, 9]])).tolist() == [
        [1, 2, 3, 0, 4, 0, 0, 0, 0, 0, 0, 0]
    ]
    with pytest.raises(ValueError, match=r"padded\[0\] = 2 must be >= lengths\[0\] = 3"):
        plan(mask, padded=[2, 8])
    with pytest.raises(ValueError, match=r"padded\[1\] = 6 must be a multiple of 4 and >= "):
        plan(mask, padded=[4, 6], cp_size=2, align=4)
    with pytest.raises(ValueError, match="padded has 1 entries for a batch of 2"):
        plan(mask, padded=[4])


def test_seq_params_names_its_choices() -> None:
    packed = pack(torch.zeros(1, 3), torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"cu_seqlens must be 'padded' .* or 'valid'"):
        packed.seq_params(cu_seqlens="exact")  # type: ignore[arg-type]


def test_pack_again_moves_another_tensor_by_the_same_plan() -> None:
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    ids = torch.arange(8).view(2, 4)
    packed = pack(ids, mask, align=2, cp_size=1)
    labels = ids * 10
    assert torch.equal(packed.pack(labels), pack(labels, mask, align=2).tensor)
    with pytest.raises(ValueError, match=r"values must be \[batch, seq_len, \*rest\] = \[2, 4"):
        packed.pack(torch.zeros(2, 5))
    with pytest.raises(TypeError, match="values must be a tensor"):
        packed.pack([1])  # type: ignore[arg-type]
