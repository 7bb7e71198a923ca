"""Sequence packing (THD): round trips, the CP split, a per-sample reference, gradients, errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridmem import _torch
from hybridmem.packing import PackedBatch, pack, unpack


def reference_pack(
    x: torch.Tensor, mask: torch.Tensor, align: int, total_align: int | None = None
) -> torch.Tensor:
    """The straightforward per-sample version: each row's valid tokens, zero-padded.

    With ``total_align`` the last row takes the padding that makes the total a multiple.
    """
    pieces = []
    for i in range(x.shape[0]):
        row = x[i][mask[i].bool()]
        size = -(-row.shape[0] // align) * align
        pad = torch.zeros((size - row.shape[0], *x.shape[2:]), dtype=x.dtype)
        pieces.append(torch.cat([row, pad]))
    if total_align is not None:
        extra = -sum(p.shape[0] for p in pieces) % total_align
        pieces[-1] = torch.cat([pieces[-1], torch.zeros((extra, *x.shape[2:]), dtype=x.dtype)])
    return torch.cat(pieces).unsqueeze(0)


def reference_cp(full: torch.Tensor, padded: list[int], cp_size: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s chunks ``rank`` and ``2 cp - 1 - rank`` of every padded sequence."""
    if cp_size == 1:
        return full
    out, start = [], 0
    for size in padded:
        chunk = size // (2 * cp_size)
        seq = full[0, start : start + size]
        out += [seq[rank * chunk : (rank + 1) * chunk]]
        other = 2 * cp_size - 1 - rank
        out += [seq[other * chunk : (other + 1) * chunk]]
        start += size
    return torch.cat(out).unsqueeze(0)


@st.composite
def batches(draw: Any) -> tuple[torch.Tensor, int, int, tuple[int, ...]]:
    batch = draw(st.integers(1, 6))
    seq_len = draw(st.integers(1, 12))
    kinds = st.sampled_from(["right", "left", "random", "full", "empty"])
    rows = []
    for _ in range(batch):
        kind = draw(kinds)
        n = draw(st.integers(0, seq_len))
        if kind == "right":
            row = [1] * n + [0] * (seq_len - n)
        elif kind == "left":
            row = [0] * (seq_len - n) + [1] * n
        elif kind == "full":
            row = [1] * seq_len
        elif kind == "empty":
            row = [0] * seq_len
        else:
            row = draw(st.lists(st.integers(0, 1), min_size=seq_len, max_size=seq_len))
        rows.append(row)
    mask = torch.tensor(rows, dtype=draw(st.sampled_from([torch.bool, torch.int64, torch.uint8])))
    cp_size = draw(st.integers(1, 4))
    align = 2 * cp_size * draw(st.integers(1, 3)) if cp_size > 1 else draw(st.integers(1, 5))
    rest = draw(st.sampled_from([(), (3,), (2, 2)]))
    return mask, cp_size, align, rest


@settings(max_examples=150, deadline=None)
@given(batches(), st.booleans(), st.sampled_from([None, 1, 2, 5]))
def test_unpack_of_pack_is_the_input_where_the_mask_is_one(
    case: tuple[torch.Tensor, int, int, tuple[int, ...]],
    host_lengths: bool,
    total_factor: int | None,
) -> None:
    mask, cp_size, align, rest = case
    total_align = None if total_factor is None else align * total_factor
    batch, seq_len = mask.shape
    x = torch.randn(batch, seq_len, *rest, dtype=torch.float64) + 5  # never 0 by chance
    lengths = (mask != 0).sum(1).tolist() if host_lengths else None
    ranks = [
        pack(
            x,
            mask,
            lengths=lengths,
            align=align,
            total_align=total_align,
            cp_size=cp_size,
            cp_rank=r,
        )
        for r in range(cp_size)
    ]
    full = reference_pack(x, mask, align, total_align)
    padded = [-(-n // align) * align for n in (mask != 0).sum(1).tolist()]
    padded[-1] += full.shape[1] - sum(padded)  # the total's padding, on the last row
    for r, packed in enumerate(ranks):
        assert packed.tensor.shape == (1, full.shape[1] // cp_size, *rest)
        assert torch.equal(packed.tensor, reference_cp(full, padded, cp_size, r))
        assert packed.cu_seqlens_padded.dtype == torch.int32
        assert packed.cu_seqlens_padded.tolist() == [sum(padded[:i]) for i in range(batch + 1)]
        assert packed.max_seqlen == max(padded)
    if cp_size == 1:
        assert torch.equal(ranks[0].tensor, full)
    # every rank's chunks together are the unsplit packing, rearranged
    together = torch.cat([p.tensor for p in ranks], dim=1)
    assert torch.equal(together.sort(dim=1).values, full.sort(dim=1).values)
    back = unpack([p.tensor for p in ranks], ranks[0], seq_len=seq_len)
    keep = (mask != 0).view(batch, seq_len, *([1] * len(rest)))
    assert torch.equal(back, torch.where(keep, x, torch.zeros_like(x)))
    wider = unpack([p.tensor for p in ranks], ranks[-1], seq_len=seq_len + 3)
    assert torch.equal(wider[:, :seq_len], back)
    assert not wider[:, seq_len:].any()


def test_the_layout_in_one_small_case() -> None:
    ids = torch.arange(1, 13).view(2, 6)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 1, 1]])
    packed = pack(ids, mask, lengths=[3, 5], align=4)
    assert packed.tensor.tolist() == [[1, 2, 3, 0, 8, 9, 10, 11, 12, 0, 0, 0]]
    assert packed.cu_seqlens_padded.tolist() == [0, 4, 12]
    assert packed.cu_seqlens.tolist() == [0, 3, 8]
    assert packed.max_seqlen == 8
    assert packed.lengths == [3, 5]
    params = packed.seq_params()  # verl's: the padded offsets in cu_seqlens_q/kv too
    assert params["qkv_format"] == "thd"
    assert params["cu_seqlens_q"] is params["cu_seqlens_kv"] is packed.cu_seqlens_padded
    assert params["cu_seqlens_q_padded"] is packed.cu_seqlens_padded
    assert params["max_seqlen_q"] == params["max_seqlen_kv"] == 8
    valid = packed.seq_params(cu_seqlens="valid")  # for backends with padding between
    assert valid["cu_seqlens_q"] is valid["cu_seqlens_kv"] is packed.cu_seqlens
    assert valid["cu_seqlens_kv_padded"] is packed.cu_seqlens_padded
    rank0 = pack(ids, mask, align=4, cp_size=2, cp_rank=0)
    rank1 = pack(ids, mask, align=4, cp_size=2, cp_rank=1)
    assert rank0.tensor.tolist() == [[1, 0, 8, 9, 0, 0]]  # chunks 0 and 3 of each sequence
    assert rank1.tensor.tolist() == [[2, 3, 10, 11, 12, 0]]  # chunks 1 and 2


def test_lengths_as_a_cpu_tensor_and_zero_and_full_rows() -> None:
    x = torch.arange(12.0).view(3, 4)
    mask = torch.tensor([[0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 0, 1]], dtype=torch.bool)
    packed = pack(x, mask, lengths=torch.tensor([0, 4, 2]))
    assert packed.tensor.tolist() == [[4.0, 5.0, 6.0, 7.0, 9.0, 11.0]]
    assert packed.cu_seqlens_padded.tolist() == [0, 0, 4, 6]


def test_gradients_flow_through_pack_and_unpack() -> None:
    mask = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 0]])
    x = torch.randn(2, 4, 3, dtype=torch.float64, requires_grad=True)

    def round_trip(t: torch.Tensor) -> torch.Tensor:
        packed = pack(t, mask, lengths=[3, 2], align=4)
        return unpack(packed.tensor * 2.0, packed, seq_len=4)

    assert torch.autograd.gradcheck(round_trip, (x,))

    def split(t: torch.Tensor) -> torch.Tensor:
        ranks = [pack(t, mask, align=4, cp_size=2, cp_rank=r) for r in range(2)]
        return unpack([p.tensor.sin() for p in ranks], ranks[0], seq_len=5)

    assert torch.autograd.gradcheck(split, (x,))


def test_one_rank_output_is_gathered_through_the_group(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.arange(1.0, 13.0).view(2, 6)
    mask = torch.ones(2, 6, dtype=torch.bool)
    ranks = [pack(x, mask, align=4, cp_size=2, cp_rank=r) for r in range(2)]
    seen: list[object] = []

    def gather(tensor: torch.Tensor, group: object) -> list[torch.Tensor]:
        seen.append(group)
        return [ranks[0].tensor, ranks[1].tensor]

    monkeypatch.setattr(_torch, "dist_all_gather_tensors", gather)
    back = unpack(ranks[1].tensor, ranks[1], seq_len=6, group="cp-group")
    assert seen == ["cp-group"]
    assert torch.equal(back, x)


def bad_pack(**kw: Any) -> PackedBatch:
    args: dict[str, Any] = {"input_ids": torch.zeros(2, 4), "attention_mask": torch.ones(2, 4)}
    args["attention_mask"] = args["attention_mask"].long()
    args.update(kw)
    return pack(args.pop("input_ids"), args.pop("attention_mask"), **args)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"input_ids": [1, 2]}, TypeError, "input_ids must be a tensor"),
        ({"attention_mask": torch.ones(2, 4)}, TypeError, "bool or an integer 0/1 mask"),
        ({"attention_mask": torch.ones(2, 4, 1).long()}, ValueError, r"\[batch, seq_len\]"),
        ({"input_ids": torch.zeros(3, 4)}, ValueError, "with the mask's"),
        (
            {"input_ids": torch.zeros(0, 4), "attention_mask": torch.ones(0, 4).long()},
            ValueError,
            "empty",
        ),
        ({"lengths": [4]}, ValueError, "lengths has 1 entries for a batch of 2"),
        ({"lengths": [4, 5]}, ValueError, r"lengths\[1\] must be between 0 and 4"),
        ({"lengths": [4, -1]}, ValueError, r"lengths\[1\] must be between 0 and 4"),
        ({"lengths": [4, 2.5]}, TypeError, r"lengths\[1\] must be an int"),
        ({"lengths": [4, 3]}, ValueError, "row 1 has 4 valid tokens but lengths\\[1\\] = 3"),
        ({"lengths": "44"}, TypeError, "lengths must be a list of ints"),
        ({"lengths": torch.tensor([4.0, 4.0])}, TypeError, "1-D integer tensor"),
        ({"align": 0}, ValueError, "align must be >= 1"),
        ({"align": True}, TypeError, "align must be an int"),
        ({"cp_size": 0}, ValueError, "cp_size must be >= 1"),
        (
            {"cp_size": 2, "cp_rank": 2, "align": 4},
            ValueError,
            r"cp_rank must be in \[0, cp_size\)",
        ),
        ({"cp_size": 2, "cp_rank": -1, "align": 4}, ValueError, "cp_rank must be in"),
        ({"cp_size": 2, "align": 2}, ValueError, "align must be a multiple of 4"),
        ({"check": 1}, TypeError, "check must be True or False"),
    ],
)
def test_bad_arguments_name_the_value(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        bad_pack(**kwargs)


def test_unpack_checks_what_it_is_given() -> None:
    mask = torch.ones(2, 4, dtype=torch.bool)
    packed = pack(torch.zeros(2, 4), mask)
    split = pack(torch.zeros(2, 4), mask, align=4, cp_size=2)
    with pytest.raises(TypeError, match="what pack\\(\\) returned"):
        unpack(packed.tensor, "x", seq_len=4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seq_len must be >= 4"):
        unpack(packed.tensor, packed, seq_len=3)
    with pytest.raises(ValueError, match=r"must be \[1, 8, \*rest\]"):
        unpack(torch.zeros(1, 7), packed, seq_len=4)
    with pytest.raises(ValueError, match="pass every rank's output"):
        unpack(split.tensor, split, seq_len=4)
    with pytest.raises(ValueError, match="expected 2 rank output"):
        unpack([split.tensor], split, seq_len=4)
    with pytest.raises(TypeError, match="a tensor or a list of tensors"):
        unpack([1, 2], packed, seq_len=4)  # type: ignore[list-item]


def test_lengths_on_the_device_are_refused_with_the_fix() -> None:
    mask = torch.ones(1, 2, dtype=torch.bool, device="meta")
    with pytest.raises(TypeError, match=r"lengths must be on the host.*lengths=None"):
        pack(torch.zeros(1, 2, device="meta"), mask, lengths=torch.tensor([2], device="meta"))
