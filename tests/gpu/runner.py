"""Run GPU scenarios in fresh interpreters, and sample device memory only when alone on it.

Allocator state is process-global, so every GPU scenario runs in a fresh interpreter
(:func:`run_scenario`); it prints its facts as JSON and the test asserts on them.

Device-wide free memory (``cudaMemGetInfo``) counts every process on the GPU. A
process of an earlier scenario that is still exiting (a consumer its scenario
started, say) gives back its context and tensors at some moment during the next
scenario, and a test comparing two samples then sees memory appear or vanish that
is not its own (issue #25: +1,293 MiB "drift" in a bucket test). So:

- every process this test run starts carries :data:`MARK` in its environment (set
  here once, inherited by the scenario and by everything it spawns);
- before a scenario starts, and before every sample a scenario compares
  (:func:`settled_free`), the caller waits (bounded) until no other marked process
  holds the GPU, except the ones it names as its own (its live consumer);
- a process holds the GPU while it has ``/dev/nvidia*`` open: the driver tears its
  context down when the last of those fds is closed, so once they are gone (a
  zombie has none), so is its memory;
- a process that is exiting holds it too, marked or not, until it is a zombie: Linux
  releases its memory map before its files, and its files' final close (the driver's
  teardown) runs last, so while it exits its environment reads empty (its mark is
  gone) and then its fd table does (its GPU fds are gone), before the driver has let
  go of its memory. Only processes whose fds this user may read count (its own).

Processes of other users, or not started by this test run, are not waited for: they
cannot be ours, and a shared GPU is not a place to compare device memory anyway.
"""

from __future__ import annotations

import json
import os
import re
import select
import statistics
import subprocess
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.helpers import run_python

__all__ = [
    "MARK",
    "gpu_holders",
    "off_the_median",
    "run_alone",
    "run_scenario",
    "settled_free",
    "wait_until_alone",
    "window_drift",
]

# Not HYBRIDMEM_*: tests.helpers.clean_env drops those from a child's environment.
MARK = "HM_GPU_TEST_RUN"
os.environ.setdefault(MARK, uuid.uuid4().hex)  # this run's token, inherited by its children

_WAIT_S = 60.0  # a CUDA process exits in seconds; one that takes longer is stuck
# A GPU's own node (/dev/nvidia0...): /dev/nvidiactl or /dev/nvidia-uvm alone hold no
# device memory.
_GPU_NODE = re.compile(r"/dev/nvidia\d+$")


def _holds_gpu(pid: str) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # gone, or not ours to read
        return False
    for fd in fds:
        try:
            if _GPU_NODE.match(os.readlink(f"/proc/{pid}/fd/{fd}")):
                return True
        except OSError:
            continue
    return False


_PF_EXITING = 0x4  # include/linux/sched.h: set at the start of do_exit()


def _parse_stat(text: str) -> tuple[str, int]:
    """``(state, flags)`` from a ``/proc/PID/stat`` line (its command may hold ``)`` and spaces)."""
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[6])


def _exiting(pid: str) -> bool:
    """Whether ``pid`` is in ``do_exit`` and not yet a zombie (its driver teardown may run)."""
    try:
        state, flags = _parse_stat(Path(f"/proc/{pid}/stat").read_text())
        os.listdir(f"/proc/{pid}/fd")  # this user's process (another user's is not ours)
    except (OSError, ValueError, IndexError):
        return False
    return bool(flags & _PF_EXITING) and state not in ("Z", "X", "x")


def _marked(pid: str, token: bytes) -> bool:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return token in environ.split(b"\0")


def _ancestors() -> set[int]:
    """This process's parents up to init: they wait for it, so never wait for them."""
    found: set[int] = set()
    pid = os.getppid()
    while pid > 1 and pid not in found:
        found.add(pid)
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            break
        pid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
    return found


def gpu_holders(allowed: Iterable[int] = ()) -> dict[int, str]:
    """Processes of this test run that hold the GPU: not this one, its parents or ``allowed``.

    Returns:
        ``{pid: command line}``.
    """
    token = f"{MARK}={os.environ[MARK]}".encode()
    skip = {os.getpid(), *_ancestors(), *allowed}
    found: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in skip:
            continue
        if _marked(entry, token) and _holds_gpu(entry):
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:  # gone
                continue
            found[int(entry)] = cmdline.decode(errors="replace").strip()
        elif _exiting(entry):
            found[int(entry)] = "(exiting: its mark and fds may be gone before its memory)"
    return found


def wait_until_alone(allowed: Iterable[int] = (), timeout: float = _WAIT_S) -> None:
    """Wait until no other process of this test run holds the GPU (bounded).

    Waits on each holder's pidfd (no polling loop of sleeps), then looks again: a
    holder may have started another process before it exited.

    Raises:
        AssertionError: some still hold it after ``timeout`` seconds (named).
    """
    allowed = set(allowed)
    deadline = time.monotonic() + timeout
    while True:
        holders = gpu_holders(allowed)
        if not holders:
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(
                f"processes of this test run still hold the GPU after {timeout:g} s: "
                f"{holders} (a device-memory sample now would count them)"
            )
        fds = []
        for pid in holders:
            try:
                fds.append(os.pidfd_open(pid))
            except OSError:  # exited already
                continue
        try:
            if fds:
                select.select(fds, [], [], min(left, 1.0))  # any one exiting wakes us
        finally:
            for fd in fds:
                os.close(fd)


def settled_free(index: int | None = None, allowed: Iterable[int] = ()) -> int:
    """Device free bytes, sampled once no other process of this run holds the GPU.

    Args:
        index: the device (None: the current one).
        allowed: pids of this scenario's own live processes (a consumer it compares
            with itself), which are counted as they are.
    """
    import torch

    wait_until_alone(allowed)
    torch.cuda.synchronize(index)
    return int(torch.cuda.mem_get_info(index)[0])


def run_alone(
    *args: str, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """:func:`tests.helpers.run_python`, started once no earlier process holds the GPU."""
    wait_until_alone()
    return run_python(*args, timeout=timeout, env=env)


def artifacts_dir(tmp_path: Path) -> Path:
    """Where a GPU test keeps its results: ``$HYBRIDMEM_GPU_ARTIFACTS``, else ``tmp_path``.

    Set it to keep a run's raw results for docs/benchmarks.md and the results' READMEs.
    """
    keep = os.environ.get("HYBRIDMEM_GPU_ARTIFACTS")
    return Path(keep) if keep else tmp_path


def run_scenario(name: str, module: str = "tests.gpu.scenarios", **env: str) -> dict[str, Any]:
    """Run ``python -m module name`` alone on the GPU; return the facts it printed as JSON.

    The scenario starts only once every process of an earlier one has let go of the
    GPU. With ``$OUT`` set, the facts are appended to ``$OUT/gpu_facts.jsonl``.
    """
    result = run_alone("-m", module, name, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    facts: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    out_dir = os.environ.get("OUT")
    if out_dir:  # keep the raw facts for the issue note
        with open(Path(out_dir) / "gpu_facts.jsonl", "a") as fh:
            fh.write(json.dumps({"scenario": name, "env": env, "facts": facts}) + "\n")
    return facts


def window_drift(samples: Sequence[Mapping[str, int]], window: int = 10) -> dict[str, int]:
    """Each key's drift over a run: the median of the last ``window`` samples minus the first's.

    A leak moves every later sample, so it moves the last window's median; a moment
    when memory was held for a while (issue #25: about 650 MiB from cycle 1's reload
    until the engine slept in cycle 2; every boundary of the way back agreed within
    2 MiB over cycles 2-50) moves only the samples it lasts for, and a median of ten
    ignores up to four of them. The first and last samples alone made such a moment
    the whole run's "drift".

    Raises:
        ValueError: fewer than two windows of samples.
    """
    if len(samples) < 2 * window:
        raise ValueError(f"window_drift needs at least {2 * window} samples, got {len(samples)}")
    first, last = samples[:window], samples[-window:]
    return {
        key: statistics.median_low(s[key] for s in last)
        - statistics.median_low(s[key] for s in first)
        for key in samples[0]
    }


def off_the_median(
    samples: Sequence[Mapping[str, int]], tolerance: int
) -> list[tuple[int, str, int]]:
    """The samples more than ``tolerance`` off their key's median: ``(index, key, off by)``.

    What :func:`window_drift` does not count as drift, said rather than hidden.
    """
    medians = {key: statistics.median_low(s[key] for s in samples) for key in samples[0]}
    return [
        (index, key, sample[key] - medians[key])
        for index, sample in enumerate(samples)
        for key in sample
        if abs(sample[key] - medians[key]) > tolerance
    ]
