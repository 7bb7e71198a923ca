"""The verl pair over a real gloo group: hybridmem's against verl's own, every rank.

Usage (one process per rank; tests/test_ranks_gloo.py starts them)::

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p \
        python -m tests.gloo_packing_verl OUT WHEEL

Each rank is one context-parallel rank (tp 1, cp = the world). It packs with
``hybridmem.packing.verl``, gathers through ``torch.distributed`` in
``postprocess_packed_seqs`` and backpropagates; where verl's wheel is given (WHEEL, or
``-`` for none) verl's own pair does the same on the same batch. Each rank writes
``OUT/rank<r>.json``: whether the output equals the padded computation, whether it and
this rank's gradient equal verl's (null without verl).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hybridmem.packing import verl as hm_verl
from tests import verl_oracle
from tests.gloo_teardown import leave_group
from tests.verl_oracle import FakeMegatron


def round_trip(pre: Any, post: Any, x: torch.Tensor, mask: torch.Tensor) -> tuple[Any, ...]:
    """(unpacked output, this rank's packed output's gradient) of one pre/post pair."""
    packed, params = pre(x, mask)
    leaf = (packed.to(torch.float64) * 3.0).requires_grad_()
    out = post(leaf, params, mask, *mask.shape)
    weights = torch.arange(out.numel(), dtype=torch.float64).view_as(out)
    (out * weights).sum().backward()
    return out.detach(), leaf.grad


def main(out_dir: Path, wheel: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    fake = FakeMegatron()
    fake.set(1, world, rank, group=dist.group.WORLD)
    gen = torch.Generator().manual_seed(0)  # every rank has the same batch
    mask = torch.rand(3, 21, generator=gen) > 0.4
    x = torch.randn(3, 21, generator=gen, dtype=torch.float64)
    with verl_oracle.installed(fake.modules()):
        ours, our_grad = round_trip(
            hm_verl.preprocess_packed_seqs, hm_verl.postprocess_packed_seqs, x, mask
        )
        found: dict[str, Any] = {
            "equal": bool(torch.equal(ours, torch.where(mask, x * 3.0, 0.0))),
            "verl": None,
            "verl_grad": None,
        }
        if wheel != "-":
            os.environ["HYBRIDMEM_VERL_WHEEL"] = wheel
            module = verl_oracle.load(fake)
            assert module is not None, wheel
            theirs, their_grad = round_trip(
                module.preprocess_packed_seqs, module.postprocess_packed_seqs, x, mask
            )
            found["verl"] = bool(torch.equal(ours, theirs))
            found["verl_grad"] = bool(torch.equal(our_grad, their_grad))
    (out_dir / f"rank{rank}.json").write_text(json.dumps(found))
    # every rank leaves its last collective before any tears its connections down: a
    # rank that destroyed the group while its peer was still finishing a gather aborted
    # the peer ("terminate called without an active exception", seen once in CI)
    leave_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
