"""torch's allocator-settings rules, version by version, and a model of its parser.

hybridmem never guesses what torch will do with a settings string: it runs this
model first. :class:`TorchRules` says, for one torch version and build, which
environment variable torch reads, which keys it knows, and :meth:`TorchRules.run`
replays torch's parser on a string: the state torch is left in, or the reason it
refuses the string and the part it kept (torch applies a string key by key, so a
refused string is half applied).

The model was written from torch's headers and checked against the parsers of
torch 2.4.1, 2.5.1, 2.6.0, 2.7.1, 2.8.0, 2.9.1, 2.10.0, 2.11.0, 2.12.0 and 2.13.0
themselves: each CUDA wheel's ``libc10``/``libc10_cuda`` driven by a small C++
program, no GPU needed (``tests/torch_parser/``; the recorded answers are
``tests/torch_parser/recorded.json`` and ``tests/test_torch_rules.py`` replays
them). The families it encodes:

- **torch <= 2.9** (one CUDA parser): only ``PYTORCH_CUDA_ALLOC_CONF`` is read
  (2.9 ignores ``PYTORCH_ALLOC_CONF`` for CUDA: pytorch#183387); separators are
  checked (``a:b,,c:d`` is refused); only spaces are dropped; sizes are read with
  ``stoi``; ``max_split_size_mb`` and ``max_non_split_rounding_mb`` must be > 20.
- **torch >= 2.10** (a generic parser, then the CUDA one as a hook):
  ``PYTORCH_CUDA_ALLOC_CONF`` when it is set (even empty), else
  ``PYTORCH_ALLOC_CONF``, whole: the other variable is ignored. Separators are
  counted, not checked (``expandable_segments,True`` reads as ``:True``); all
  whitespace is dropped, inside tokens too (``3 0`` is 30); sizes are read with
  ``stoull`` (``-5`` is a huge number, ``25.5`` is 25); the generic keys of a
  string are applied before its CUDA keys are looked at. From 2.11,
  ``large_segment_size_mb`` exists, is read first, and is the minimum of
  ``max_split_size_mb`` and ``max_non_split_rounding_mb``, which every call resets
  to it.
- Every version resets ``max_split_size_mb``, ``garbage_collection_threshold``
  and ``roundup_power2_divisions`` at the start of every call; every other key
  keeps its value when a string omits it.
- A CPU-only build (2.10+) has no CUDA parser: unknown and CUDA keys are skipped
  unread.

Pure Python, no torch import: the tests replay every recorded version anywhere.

The two parsers are in :mod:`hybridmem.allocator.parsers`, what they share (units,
aliases, C's number readers) in :mod:`hybridmem.allocator.cparse`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from hybridmem.allocator.cparse import (
    INTERVALS,
    MB,
    PINNED_MAX_KEYS,
    RESERVE_KEYS,
    Refused,
)
from hybridmem.allocator.parsers import StrictParse, TokenParse, split

__all__ = [
    "ALLOC_CONF",
    "CUDA_ALLOC_CONF",
    "MB",
    "RECORDED_VERSIONS",
    "Outcome",
    "TorchRules",
    "default_state",
]

#: The releases whose own parsers answered the recorded strings (tests/torch_parser):
#: the model is checked against each; a newer torch is judged by its own setter.
RECORDED_VERSIONS = (
    "2.4.1", "2.5.1", "2.6.0", "2.7.1", "2.8.0", "2.9.1", "2.10.0", "2.11.0", "2.12.0",
    "2.13.0", "2.14.1", "2.15.0",
)  # fmt: skip
CUDA_ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
ALLOC_CONF = "PYTORCH_ALLOC_CONF"

# --------------------------------------------------------------------------- #
# State
# --------------------------------------------------------------------------- #


def default_state(version: tuple[int, int], device: bool = True) -> dict[str, Any]:
    """torch's settings before any string: ``{key: value}`` in torch's own units.

    Sizes are MB (``max_split_size_mb`` None = unlimited); the roundup setting is
    its 16 divisions (1 MiB ... 32 GiB); switches are bools.
    """
    return dict(TorchRules(version, device).defaults)


_DEFAULTS: dict[str, Any] = {
    "max_non_split_rounding_mb": 20,
    "large_segment_size_mb": 20,
    "pinned_use_background_threads": False,
    "release_lock_on_cudamalloc": False,
    "pinned_use_cuda_host_register": False,
    "pinned_num_register_threads": 1,
    "pinned_reserve_segment_size_mb": 0,
    "graph_capture_record_stream_reuse": False,
    "per_process_memory_fraction": 1.0,
    "pinned_free_catch_all": False,
    "throw_on_cudamalloc_oom": False,
    "pinned_max_round_threshold_mb": None,
    "pinned_max_cached_size_mb": None,
    # (is_fraction, value) once a valid reserve is read: unset (9/8 of the device) until
    # then, and no text unsets it; per class, every string replaces the whole list
    "expandable_segments_reserve": None,
    "expandable_segments_reserve_by_class": (),
}


@dataclass(frozen=True)
class Outcome:
    """What torch does with one settings string.

    Attributes:
        state: torch's settings afterwards (for a refused string: the part it
            kept, which is not the state before).
        error: why torch refuses the string, or None when it takes it.
        items: ``(key, value text)`` as torch reads them, in order (aliases
            resolved; whitespace dropped as torch drops it; lists as ``[...]``).
        notes: things torch reads differently from how they look (a ``,``
            where ``:`` belongs, ``25.5`` read as 25), for a warning.
        aborts: torch kills the process instead of refusing: an env string whose
            index runs past its last token aborts a CUDA build of 2.10+ at
            ``import torch`` (its CUDA library parses the env while it loads).
    """

    state: dict[str, Any]
    error: str | None
    items: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = field(default=())
    aborts: bool = False

    @property
    def accepted(self) -> bool:
        """Whether torch takes the string."""
        return self.error is None


# --------------------------------------------------------------------------- #
# The rules of one version
# --------------------------------------------------------------------------- #

_STRICT_KEYS_24 = (
    "max_split_size_mb",
    "garbage_collection_threshold",
    "roundup_power2_divisions",
    "backend",
    "expandable_segments",
    "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register",
    "pinned_num_register_threads",
)
_GENERIC_KEYS = (
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "garbage_collection_threshold",
    "roundup_power2_divisions",
    "expandable_segments",
    "pinned_use_background_threads",
)
_DEVICE_KEYS_210 = (
    "backend",
    "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register",
    "pinned_num_register_threads",
    "pinned_reserve_segment_size_mb",
    "graph_capture_record_stream_reuse",
    "per_process_memory_fraction",
)


@dataclass(frozen=True)
class TorchRules:
    """torch's allocator-settings rules for one version and build.

    Args:
        version: torch's ``(major, minor)``.
        device: a CUDA build (its CUDA parser judges CUDA keys and refuses
            unknown ones); False for a CPU-only build.
        backend: the allocator backend running, which a string may name but not
            change; None at start-up, where the env chooses it.

    Example:
        >>> rules = TorchRules((2, 11))
        >>> rules.run("large_segment_size_mb:64,max_split_size_mb:32").error
        'torch 2.11 refuses max_split_size_mb:32: must be >= 64 (large_segment_size_mb)'
    """

    version: tuple[int, int]
    device: bool = True
    backend: str | None = "native"

    # ------------------------------------------------------------------ #
    # What this version has
    # ------------------------------------------------------------------ #
    @property
    def label(self) -> str:
        """``"torch 2.11"``."""
        return f"torch {self.version[0]}.{self.version[1]}"

    @property
    def recorded(self) -> bool:
        """Whether this minor version's parser was recorded (the model checked against it)."""
        return any(v.startswith(f"{self.version[0]}.{self.version[1]}.") for v in RECORDED_VERSIONS)

    @property
    def tokenizer(self) -> bool:
        """True from 2.10: the lenient tokenizer and the generic + CUDA parsers."""
        return self.version >= (2, 10)

    @functools.cached_property
    def generic_keys(self) -> frozenset[str]:
        """Keys of the generic parser (2.10+) or of the one CUDA parser (<= 2.9)."""
        if not self.tokenizer:
            keys = set(_STRICT_KEYS_24)
            if self.version >= (2, 6):
                keys |= {"max_non_split_rounding_mb", "pinned_use_background_threads"}
            if self.version >= (2, 9):
                keys.add("graph_capture_record_stream_reuse")
            return frozenset(keys)
        keys = set(_GENERIC_KEYS)
        if self.version >= (2, 11):
            keys.add("large_segment_size_mb")
        if self.version >= (2, 13):
            keys |= set(PINNED_MAX_KEYS)
        return frozenset(keys)

    @functools.cached_property
    def device_keys(self) -> frozenset[str]:
        """Keys of the CUDA parser hook (2.10+ CUDA builds only)."""
        if not (self.tokenizer and self.device):
            return frozenset()
        keys = set(_DEVICE_KEYS_210)
        if self.version >= (2, 12):
            keys |= {"pinned_free_catch_all", "throw_on_cudamalloc_oom"}
        if self.version >= (2, 15):
            keys |= set(RESERVE_KEYS)
        return frozenset(keys)

    @property
    def keys(self) -> frozenset[str]:
        """Every key this torch reads (canonical spellings)."""
        return self.generic_keys | self.device_keys

    @functools.cached_property
    def reset_keys(self) -> frozenset[str]:
        """Keys every setter call puts back to their default unless it names them."""
        keys = {"max_split_size_mb", "garbage_collection_threshold", "roundup_power2_divisions"}
        if self.version >= (2, 11):
            keys.add("max_non_split_rounding_mb")  # reset to large_segment_size_mb
        return frozenset(keys)

    @functools.cached_property
    def kept_keys(self) -> frozenset[str]:
        """Keys torch keeps when a string omits them (and that a string may change)."""
        return self.keys - self.reset_keys - {"backend"}

    @functools.cached_property
    def defaults(self) -> Mapping[str, Any]:
        """torch's settings before any string (see :func:`default_state`); read-only."""
        state: dict[str, Any] = {
            "max_split_size_mb": None,
            "garbage_collection_threshold": 0.0,
            "expandable_segments": False,
            "roundup_power2_divisions": (0,) * INTERVALS,
        }
        for key in sorted(self.keys - {"backend"} - set(state)):
            state[key] = _DEFAULTS[key]
        return MappingProxyType(state)

    def default_text(self, key: str) -> str | None:
        """The text that puts ``key`` back to its default, or None if torch refuses it.

        torch refuses ``pinned_reserve_segment_size_mb:0`` (its own default) and,
        before 2.10, ``max_non_split_rounding_mb:20`` (it must be > 20); the host
        allocator's limits of 2.13+ are unlimited until set and no text gives that
        back, nor does any unset 2.15's ``expandable_segments_reserve``: such a key
        cannot be put back once changed, so a scope may not change it unless the env
        (or a process default) already has.
        """
        default = _DEFAULTS.get(key)
        if key == "expandable_segments":
            return "False"
        if key == "pinned_reserve_segment_size_mb":
            return None
        if key == "expandable_segments_reserve_by_class":
            return "[]"
        if key == "max_non_split_rounding_mb" and not self.tokenizer:
            return None
        if isinstance(default, bool):
            return str(default)
        if isinstance(default, float):
            return repr(default)
        if isinstance(default, int):
            return str(default)
        return None

    def env_variable(self, environ: Mapping[str, str]) -> tuple[str | None, list[str]]:
        """Which variable torch reads here, and the set variables it ignores.

        Returns:
            ``(name or None, ignored names)``. 2.10+: ``PYTORCH_CUDA_ALLOC_CONF``
            when set (even to ""), else ``PYTORCH_ALLOC_CONF``. Older: only
            ``PYTORCH_CUDA_ALLOC_CONF``.
        """
        order = (CUDA_ALLOC_CONF, ALLOC_CONF) if self.tokenizer else (CUDA_ALLOC_CONF,)
        chosen = next((name for name in order if name in environ), None)
        ignored = [n for n in (CUDA_ALLOC_CONF, ALLOC_CONF) if n in environ and n != chosen]
        return chosen, ignored

    # ------------------------------------------------------------------ #
    # The parser
    # ------------------------------------------------------------------ #
    def aborts_at_import(self, text: str) -> bool:
        """Whether ``text`` as the env kills this torch at ``import torch``.

        CUDA builds from 2.10 (recorded: 2.10.0 to 2.15.0) walk the env's tokens
        while their CUDA library loads, key by key, reading each key's value without
        checking the index: a key with no value after it (``expandable_segments``,
        ``expandable_segments:``, ``a:b,x``) trips an internal assert in a static
        initialiser, which no one can catch, and the process aborts. The walk looks
        for the ``backend`` key and stops once it has read that key's value. Every
        other refusal comes later, at the first allocation. Start-up only (``backend``
        None); before 2.10 there is no such walk.
        """
        if not (self.device and self.backend is None and self.tokenizer):
            return False
        tokens = split(text, spaces_only=False)
        i = 0
        while i < len(tokens):
            if tokens[i] == "backend":  # what the walk looks for: its value, then no further
                return i + 2 >= len(tokens)
            value = i + 2  # the key at i, its ':' (any token) at i + 1
            if value >= len(tokens):
                return True
            if tokens[value] == "[":
                while value < len(tokens) and tokens[value] != "]":
                    value += 1
                if value >= len(tokens):
                    return True
            i = value + 2  # past the value and the ',' after it
        return False

    def run(self, text: str, state: Mapping[str, Any] | None = None) -> Outcome:
        """Replay torch's parser on ``text`` from ``state`` (default: torch's defaults).

        Returns:
            An :class:`Outcome`: the state afterwards, or the refusal and what
            torch kept.
        """
        now = dict(state if state is not None else self.defaults)
        if self.aborts_at_import(text):
            return Outcome(
                now,
                f"{self.label} (a CUDA build) aborts the interpreter at `import torch`: a key "
                f"in {text!r} has no value after it (INTERNAL ASSERT FAILED, Index out of "
                "bounds in ConfigTokenizer)",
                aborts=True,
            )
        parse = TokenParse(self, text, now) if self.tokenizer else StrictParse(self, text, now)
        try:
            parse.run()
        except Refused as exc:
            return Outcome(now, str(exc), tuple(parse.items), tuple(parse.notes))
        return Outcome(now, None, tuple(parse.items), tuple(parse.notes))

    def refuse(self, key: str, value: str, why: str) -> Refused:
        return Refused(f"{self.label} refuses {key}:{value}: {why}")
