"""What each vLLM release's sleep-mode pool does with the allocator settings, and what applies.

Read in vLLM's wheels (``vllm/device_allocator/cumem.py``, ``alloc_conf.py``,
``sleep_mode_backend.py``; ``pip download --no-deps vllm==X``): 0.8.5, 0.10.0, 0.11.0,
0.14.0, 0.18.0, 0.19.0, 0.22.0 to 0.31.0 each, 0.32.0, 0.33.0 (0.20 and 0.21 not read).
Each release band says:

- ``expandable``: what ``CuMemAllocator.use_memory_pool`` does when expandable segments
  are on (the pool cannot use them, torch#147851): ``"asserts"`` (when
  ``PYTORCH_CUDA_ALLOC_CONF`` contains ``expandable_segments:True``); ``"bare toggle"``
  (when that variable contains it: writes ``expandable_segments:False`` alone entering
  and ``expandable_segments:True`` alone leaving, which resets every other setting to
  torch's default for the rest of the process, and never sees ``PYTORCH_ALLOC_CONF`` or
  a runtime write); ``"keeping toggle"`` (reads the live string, else the first of
  ``PYTORCH_ALLOC_CONF``/``PYTORCH_CUDA_ALLOC_CONF``/``PYTORCH_HIP_ALLOC_CONF`` set,
  turns only that key off, writes back what it read);
- ``asleep_flag``: the pool's records say which allocations sleep (``is_asleep``);
- ``backends``: the pluggable sleep-mode backend factory
  (``vllm/device_allocator/sleep_mode_backend.py``).

Never imports vLLM. Scope: pure data and functions of a version string.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from hybridmem._version import major_minor

__all__ = ["RELEASES", "PoolRelease", "pool_notes", "release_of"]


@dataclasses.dataclass(frozen=True)
class PoolRelease:
    """One band of vLLM releases whose sleep-mode pool behaves alike (see the module)."""

    first: tuple[int, int]
    last: tuple[int, int] | None  # None: up to the newest read
    expandable: str
    asleep_flag: bool
    backends: bool
    read: str  # the releases whose wheels were read

    def name(self) -> str:
        first = "{}.{}".format(*self.first)
        if self.last is None:
            return f"{first}+"
        return first if self.last == self.first else "{}-{}.{}".format(first, *self.last)


RELEASES: tuple[PoolRelease, ...] = (
    PoolRelease((0, 8), (0, 19), "asserts", False, False, "0.8.5, 0.10, 0.11, 0.14, 0.18, 0.19"),
    PoolRelease((0, 22), (0, 24), "bare toggle", False, False, "0.22, 0.23, 0.24"),
    PoolRelease((0, 25), (0, 30), "bare toggle", True, True, "0.25 to 0.30"),
    PoolRelease((0, 31), None, "keeping toggle", True, True, "0.31, 0.32, 0.33"),
)

#: vLLM releases hybridmem's weight-transfer backend runs on (its engine API).
WEIGHT_TRANSFER_FROM = (0, 32)
#: vLLM releases whose sleep-mode backend factory hybridmem's backend was read against
#: (0.32.0's ``sleep_mode_backend.py`` is 0.33.0's, byte for byte).
SLEEP_BACKEND_FROM = (0, 32)


def release_of(version: str) -> PoolRelease | None:
    """The band ``version`` falls in (None: unparsable, or a release not read).

    Example:
        >>> release_of("0.29.0").expandable, release_of("0.31.0").expandable
        ('bare toggle', 'keeping toggle')
    """
    known = major_minor(version)
    if known is None:
        return None
    for band in RELEASES:
        if band.first <= known and (band.last is None or known <= band.last):
            return band
    return None


def pool_notes(version: str, env: Mapping[str, str]) -> list[str]:
    """What the installed vLLM's pool does with this environment's settings, and what applies.

    Args:
        version: the installed vLLM's version.
        env: the environment (``os.environ``).

    Returns:
        One line on what applies, then one per problem the settings meet.

    Example:
        >>> notes = pool_notes("0.29.0", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
        >>> notes[1].startswith("vllm 0.29.0 writes expandable_segments:False alone")
        True
    """
    band = release_of(version)
    if band is None:
        return [f"vllm {version}: a release hybridmem has not read; see docs/backends/vllm.md"]
    known = major_minor(version)
    transfer = known is not None and known >= WEIGHT_TRANSFER_FROM
    sleep_backend = known is not None and known >= SLEEP_BACKEND_FROM
    notes = [
        f"vllm {version} (its sleep-mode pool as in {band.name()}): hybridmem's phases, "
        "VLLMEngine and the TRL drop-in apply; "
        + ("the weight-transfer backend applies" if transfer else "the weight-transfer "
           "backend needs vLLM 0.32+")
        + "; "
        + ("PoolBackup applies" if band.asleep_flag else "PoolBackup needs vLLM 0.25+ "
           "(the pool's records say nothing of what sleeps)")
        + "; "
        + ("--sleep-mode-backend hybridmem applies" if sleep_backend else
           "--sleep-mode-backend hybridmem needs vLLM 0.33")
    ]  # fmt: skip
    cuda = env.get("PYTORCH_CUDA_ALLOC_CONF", "")
    generic = env.get("PYTORCH_ALLOC_CONF", "")
    in_cuda = "expandable_segments:True" in cuda
    on = in_cuda or "expandable_segments:True" in generic
    if not on:
        return notes
    if band.expandable == "asserts" and in_cuda:
        notes.append(
            f"vllm {version} with expandable_segments:True in PYTORCH_CUDA_ALLOC_CONF: its "
            "sleep-mode pool asserts 'Expandable segments are not compatible with memory "
            "pool'. Keep the env off and turn them on for training only (hm.phase('train'))"
        )
    elif band.expandable == "bare toggle" and in_cuda:
        notes.append(
            f"vllm {version} writes expandable_segments:False alone entering its sleep-mode "
            "pool and expandable_segments:True alone leaving it: every other setting of "
            "PYTORCH_CUDA_ALLOC_CONF (max_split_size_mb, garbage_collection_threshold, ...) "
            "is torch's default from then on. hybridmem sees those writes (torch 2.10+) and "
            "leaves them in force; to keep your settings, keep expandable segments out of "
            "the env and turn them on for training only (hm.phase('train'))"
        )
    elif band.expandable != "keeping toggle":
        notes.append(
            f"vllm {version} reads only PYTORCH_CUDA_ALLOC_CONF: with expandable_segments:True "
            "in PYTORCH_ALLOC_CONF it does not turn them off inside its sleep-mode pool, "
            "which cannot use them (torch#147851). Keep them out of the env and turn them on "
            "for training only (hm.phase('train'))"
        )
    else:
        notes.append(
            f"vllm {version} with expandable_segments:True in the env: vLLM turns them off "
            "inside its sleep-mode pool and back on after, keeping your other settings; "
            "hybridmem sees that write and leaves it in force (docs/backends/vllm.md)"
        )
    return notes
