"""How a gloo rank started by ``tests/test_ranks_gloo.py`` leaves its group.

It meets every peer at a barrier first (no rank tears the group down while a peer is
still in a collective with it), then says it is done (the file named by
``HYBRIDMEM_RANK_DONE``: its results are written and its peers have met it), then
destroys the group. The runner reads the mark to tell a failure of the test from an
abort in gloo's own teardown after everything was done.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist

DONE_ENV = "HYBRIDMEM_RANK_DONE"


def leave_group() -> None:
    """Barrier, mark this rank done, destroy the process group."""
    dist.barrier()
    done = os.environ.get(DONE_ENV)
    if done:
        Path(done).write_text("done\n")
    dist.destroy_process_group()
