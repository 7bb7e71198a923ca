"""Triton's kernels against the torch path on random batches, under Triton's interpreter.

Usage: ``TRITON_INTERPRET=1 python -m tests.triton_packing SEED CASES`` (test_packing_triton.py
starts it: the interpreter must be chosen before the kernels are defined). Prints one
line per disagreement and ends with ``checked N, differing M, triton K``.
"""

from __future__ import annotations

import os
import random
import sys
from typing import Any

import torch

from hybridmem.packing import pack, plan, unpack
from hybridmem.packing._triton import usable


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def with_path(triton: bool) -> None:
    os.environ["HYBRIDMEM_PACKING_TRITON"] = "1" if triton else "0"


def main(seed: int, count: int) -> None:
    pick = random.Random(seed)
    checked = differing = fast = 0
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.float64, torch.bool]
    for case in range(count):
        batch, seq_len = pick.randint(1, 5), pick.randint(1, 40)
        mask = (
            torch.rand(batch, seq_len, generator=torch.Generator().manual_seed(case))
            > pick.random()
        )
        if pick.random() < 0.3:
            mask[pick.randrange(batch)] = False  # an empty row
        if pick.random() < 0.3:
            mask[pick.randrange(batch)] = True  # a full one
        cp = pick.choice([1, 1, 2, 3])
        align = 2 * cp * pick.randint(1, 3) if cp > 1 else pick.randint(1, 5)
        total = align * pick.choice([1, 3, 7]) if pick.random() < 0.4 else None
        rest = pick.choice([(), (3,), (4, 2), (1,)])
        dtype = pick.choice(dtypes)
        x = (torch.randn(batch, seq_len, *rest) * 50).to(dtype)
        lengths = mask.sum(1).tolist() if pick.random() < 0.5 else None
        packs = []
        for rank in range(cp):
            args: dict[str, Any] = {
                "align": align,
                "total_align": total,
                "cp_size": cp,
                "cp_rank": rank,
            }
            with_path(True)
            fast += usable(x, batch)
            a = pack(x, mask, lengths=lengths, **args)
            again = a.pack(x)
            later = plan(mask, lengths=lengths, **args).pack(x)
            with_path(False)
            b = pack(x, mask, lengths=lengths, **args)
            checked += 1
            if not (same(a.tensor, b.tensor) and same(again, b.tensor) and same(later, b.tensor)):
                differing += 1
                print("pack differs:", case, rank, batch, seq_len, cp, align, total, rest, dtype)
            packs.append(b)
        if cp == 1:
            out = (torch.randn(1, packs[0].tensor.shape[1], 5) * 9).to(pick.choice(dtypes))
            for width in (seq_len, seq_len + 3):
                with_path(True)
                got = unpack(out, packs[0], seq_len=width)
                with_path(False)
                want = unpack(out, packs[0], seq_len=width)
                checked += 1
                if not same(got, want):
                    differing += 1
                    print("unpack differs:", case, width, batch, seq_len, rest, dtype)
    print(f"checked {checked}, differing {differing}, triton {fast}")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
