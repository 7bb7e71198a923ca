"""Context-parallel packing over gloo: each rank packs its chunks, unpack gathers them.

Usage (one process per rank; tests/test_ranks_gloo.py starts them)::

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p python -m tests.gloo_packing OUT

Each rank writes ``OUT/rank<r>.json``: whether its unpacked output equals the padded
computation, and whether the gradient of its input equals the expected one.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hybridmem.packing import pack, unpack
from tests.gloo_teardown import leave_group


def main(out: Path) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    gen = torch.Generator().manual_seed(0)  # every rank has the same batch
    mask = torch.rand(3, 20, generator=gen) > 0.4
    x = torch.randn(3, 20, 4, generator=gen, dtype=torch.float64).requires_grad_()
    lengths = mask.sum(1).tolist()
    packed = pack(x, mask, lengths=lengths, align=2 * world, cp_size=world, cp_rank=rank)
    back = unpack(packed.tensor * 3.0, packed, seq_len=20, group=dist.group.WORLD)
    expected = torch.where(mask[:, :, None], x * 3.0, 0.0)
    equal = bool(torch.equal(back, expected))
    torch.autograd.backward(back.sum())
    # every rank's loss covers the whole batch, and the gather carries each rank's part
    # of the gradient back to it: summed over ranks, 3 * world where the mask is 1
    grad = x.grad if x.grad is not None else torch.zeros_like(x)
    dist.all_reduce(grad)
    want = torch.where(mask[:, :, None], 3.0 * world, 0.0).to(grad.dtype).expand_as(grad)
    grad_ok = bool(torch.equal(grad, want))
    (out / f"rank{rank}.json").write_text(json.dumps({"equal": equal, "grad": grad_ok}))
    leave_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
