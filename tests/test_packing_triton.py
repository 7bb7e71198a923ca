"""hybridmem.packing's Triton kernels equal the torch path, checked on CPU by Triton's interpreter.

The kernels run on CUDA tensors in use; here ``TRITON_INTERPRET=1`` runs the same kernel
source on CPU tensors, in a child process (the interpreter is chosen when the kernels
are defined). tests/gpu/test_packing_gpu.py runs both paths on the GPU.
"""

from __future__ import annotations

import importlib.util
import os
import random

import pytest

from tests.helpers import run_python

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or importlib.util.find_spec("numpy") is None,
    reason="needs Triton (it comes with torch's CUDA builds on Linux) and numpy",
)


def test_the_kernels_equal_the_torch_path_on_random_batches() -> None:
    seed = int(os.environ.get("HYBRIDMEM_TRITON_SEED", random.randrange(1 << 30)))
    done = run_python(
        "-m", "tests.triton_packing", str(seed), "80", env={"TRITON_INTERPRET": "1"}, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    checked, differing, fast = (int(part.split()[-1]) for part in last.split(", "))
    assert differing == 0, f"seed {seed} (HYBRIDMEM_TRITON_SEED replays it):\n{done.stdout}"
    assert checked > 80
    assert fast > 0, "the kernels never ran: the interpreter did not take CPU tensors"


def test_the_switch_turns_the_kernels_off() -> None:
    done = run_python(
        "-c",
        "from hybridmem.packing._triton import enabled, usable; import torch; "
        "print(enabled(), usable(torch.zeros(1), 1))",
        env={"TRITON_INTERPRET": "1", "HYBRIDMEM_PACKING_TRITON": "0"},
    )
    assert done.stdout.split() == ["False", "False"], done.stderr


def test_batches_past_the_grid_limit_take_the_torch_path() -> None:
    done = run_python(
        "-c",
        "from hybridmem.packing._triton import MAX_BATCH, usable; import torch; "
        "print(usable(torch.zeros(1), MAX_BATCH), usable(torch.zeros(1), MAX_BATCH + 1))",
        env={"TRITON_INTERPRET": "1"},
    )
    assert done.stdout.split() == ["True", "False"], done.stderr
