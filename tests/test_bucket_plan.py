"""Bucket packing plans: every byte placed once, aligned, within the bucket."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridmem.ipc._plan import ALIGN, align_up, plan_batches, plan_group


def check_plan(sizes: list[int], capacity: int) -> None:
    batches = plan_batches(sizes, capacity)
    covered: dict[int, int] = dict.fromkeys(range(len(sizes)), 0)
    seen_zero: set[int] = set()
    order: list[int] = []
    for batch in batches:
        assert batch.pieces, "no empty batches"
        assert batch.used <= capacity
        spans = sorted((p.offset, p.offset + p.nbytes) for p in batch.pieces if p.nbytes)
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start, "pieces overlap"
        for piece in batch.pieces:
            assert piece.offset % ALIGN == 0
            assert piece.offset + piece.nbytes <= capacity
            assert piece.start == covered[piece.index], "a tensor's bytes go in order"
            covered[piece.index] += piece.nbytes
            if piece.nbytes == 0:
                seen_zero.add(piece.index)
            order.append(piece.index)
    assert covered == dict(enumerate(sizes))
    assert seen_zero == {i for i, s in enumerate(sizes) if s == 0}
    assert order == sorted(order), "tensors keep their order"


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 5000), max_size=30),
    capacity=st.integers(1, 20).map(lambda k: k * ALIGN),
)
def test_every_byte_once_aligned_and_in_bounds(sizes: list[int], capacity: int) -> None:
    check_plan(sizes, capacity)


def test_large_tensor_spans_batches() -> None:
    batches = plan_batches([10 * 1024], 4096)
    assert [b.used for b in batches] == [4096, 4096, 2048]
    assert [p.start for b in batches for p in b.pieces] == [0, 4096, 8192]


def test_small_tensors_share_a_batch_at_aligned_offsets() -> None:
    (batch,) = plan_batches([10, 300, 1], 4096)
    assert [p.offset for p in batch.pieces] == [0, 256, 768]
    assert batch.used == 769


def test_tensor_that_does_not_fit_continues_in_next_batch() -> None:
    batches = plan_batches([3000, 3000], 4096)
    assert [(p.index, p.start, p.nbytes, p.offset) for b in batches for p in b.pieces] == [
        (0, 0, 3000, 0),
        (1, 0, 1024, 3072),
        (1, 1024, 1976, 0),
    ]


def test_empty_input_and_empty_tensors() -> None:
    assert plan_batches([], 4096) == []
    (batch,) = plan_batches([0, 0], 4096)
    assert [p.nbytes for p in batch.pieces] == [0, 0]


@pytest.mark.parametrize("capacity", [0, -256, 100])
def test_bad_capacity(capacity: int) -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        plan_batches([1], capacity)


def test_negative_size() -> None:
    with pytest.raises(ValueError, match="negative size"):
        plan_batches([1, -1], 4096)


def test_align_up() -> None:
    assert [align_up(v) for v in (0, 1, 256, 257)] == [0, 256, 256, 512]


@settings(max_examples=300, deadline=None)
@given(
    tensors=st.lists(st.tuples(st.integers(0, 700), st.sampled_from([1, 2, 4, 8])), max_size=12),
    capacity=st.integers(1, 16).map(lambda k: k * ALIGN),
)
def test_a_group_is_one_batch_whenever_it_fits_by_element_alignment(
    tensors: list[tuple[int, int]], capacity: int
) -> None:
    sizes = [count * element for count, element in tensors]
    elements = [element for _, element in tensors]
    tight = 0  # the group's end when each offset is rounded up to its element size only
    for size, element in zip(sizes, elements, strict=True):
        tight = align_up(tight, element) + size
    batches = plan_group(sizes, elements, capacity)
    if not sizes:
        assert batches == []
    elif tight <= capacity:
        (batch,) = batches
        assert [p.index for p in batch.pieces] == list(range(len(sizes)))
        assert [p.nbytes for p in batch.pieces] == sizes
        assert batch.used <= capacity
        spans = [(p.offset, p.offset + p.nbytes) for p in batch.pieces]
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start, "pieces overlap"
        for piece, element in zip(batch.pieces, elements, strict=True):
            assert piece.offset % element == 0, "a receiver views each piece as its dtype"
    else:
        assert batches == plan_batches(sizes, capacity)


def test_a_group_keeps_the_preferred_alignment_when_it_fits_with_it() -> None:
    (batch,) = plan_group([10, 300, 1], [2, 4, 1], 4096)
    assert [p.offset for p in batch.pieces] == [0, 256, 768]


def test_a_group_too_large_for_the_alignment_packs_by_element_size() -> None:
    # At 256-byte offsets the last tensor would start past the bucket; by element size
    # the three end at 252 of 256 bytes.
    (batch,) = plan_group([3, 4, 244], [1, 4, 4], 256)
    assert [p.offset for p in batch.pieces] == [0, 4, 8]
    assert batch.used == 252
    assert len(plan_group([3, 256], [1, 4], 256)) == 2  # 4 + 256 > 256: split


@pytest.mark.parametrize(
    ("elements", "match"), [([3], "divisor of 256"), ([0], "divisor"), ([1, 1], "2 element")]
)
def test_a_group_refuses_bad_element_sizes(elements: list[int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_group([6], elements, 4096)
