"""Two gloo ranks, rank 1 failing on purpose: before it is done, or after (the runner's test).

Usage: ``python -m tests.gloo_abort before|after`` as each rank (``start_ranks``).
"""

from __future__ import annotations

import datetime
import os
import sys

import torch.distributed as dist

from tests.gloo_teardown import leave_group


def main(when: str) -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    if rank == 1 and when == "before":
        sys.exit(3)  # a real failure: the peer's barrier ends with an error too
    leave_group()
    if rank == 1 and when == "after":
        os.abort()  # as gloo's teardown aborts, after everything was done


if __name__ == "__main__":
    main(sys.argv[1])
