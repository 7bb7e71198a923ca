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

Why this module is long: it is one model of one C++ parser, checked case by case
against the recorded answers of ten torch releases (tests/test_torch_rules.py).
Its two parser families share the value readers; apart, a change to one reader
would have to be made, and checked against torch, twice.
"""

from __future__ import annotations

import difflib
import functools
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

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
MB = 1 << 20
_SIZE_MAX = (1 << 64) - 1
_INT_MIN, _INT_MAX = -(1 << 31), (1 << 31) - 1
_DELIMITERS = frozenset(",:[]")
_INTERVALS = 16  # roundup_power2_divisions: 1 MiB ... 32 GiB and above
_MAX_SPLIT_MB = _SIZE_MAX // MB  # torch clamps sizes to this many MB

#: Aliases torch accepts for the same setting (ROCm spellings).
ALIASES = {
    "release_lock_on_hipmalloc": "release_lock_on_cudamalloc",
    "pinned_use_hip_host_register": "pinned_use_cuda_host_register",
}


class _Refused(Exception):
    """torch refuses the string here; ``args[0]`` says why."""


# --------------------------------------------------------------------------- #
# The C library's number readers, as torch calls them
# --------------------------------------------------------------------------- #

# C's isspace() in the "C" locale torch runs in: \x1c-\x1f and \xa0, which Python calls
# whitespace, are not (torch refuses "True\x1f"); digits are ASCII only (stoull refuses
# full-width or Arabic-Indic digits, which Python's int() and \d take).
C_SPACE = " \t\n\v\f\r"
_SPACES = "[" + re.escape(C_SPACE) + "]"  # the regex class of C_SPACE
_INT_PREFIX = re.compile(_SPACES + r"*([+-]?)([0-9]+)")
_FLOAT_PREFIX = re.compile(
    _SPACES + r"*([+-]?)("
    r"0[xX](?:[0-9a-fA-F]+\.?[0-9a-fA-F]*|\.[0-9a-fA-F]+)(?:[pP][+-]?[0-9]+)?"
    r"|(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
    r"|[iI][nN][fF](?:[iI][nN][iI][tT][yY])?"
    r"|[nN][aA][nN](?:\([0-9A-Za-z_]*\))?"
    r")"
)
_SMALLEST_NORMAL = 2.2250738585072014e-308


def _stoull(token: str) -> int:
    """``std::stoull``: a base-10 prefix, a minus sign wrapping around 2**64."""
    match = _INT_PREFIX.match(token)
    if match is None:
        raise _Refused(f"{token!r} is not a number (torch: stoull)")
    digits = match.group(2).lstrip("0") or "0"
    if len(digits) > 20:  # past 2**64 (and past what Python's int() converts at once)
        raise _Refused(f"{token!r} is out of range (torch: stoull)")
    value = int(digits)
    if value > _SIZE_MAX:
        raise _Refused(f"{token!r} is out of range (torch: stoull)")
    return (-value) % (1 << 64) if match.group(1) == "-" else value


def _stoi(token: str) -> int:
    """``std::stoi`` into a ``size_t``: a 32-bit int, negatives wrapping around 2**64."""
    match = _INT_PREFIX.match(token)
    if match is None:
        raise _Refused(f"{token!r} is not a number (torch: stoi)")
    digits = match.group(2).lstrip("0") or "0"
    if len(digits) > 11:
        raise _Refused(f"{token!r} is out of range (torch: stoi)")
    value = int(digits) * (-1 if match.group(1) == "-" else 1)
    if not _INT_MIN <= value <= _INT_MAX:
        raise _Refused(f"{token!r} is out of range (torch: stoi)")
    return value % (1 << 64)


def _stod(token: str) -> float:
    """``std::stod``: the longest prefix that reads as a double; range errors refused.

    ``strtod`` sets ERANGE, and ``stod`` throws, for a result that overflows, that
    underflows to zero from non-zero digits, or that is subnormal; Python's float()
    and float.fromhex() answer inf, 0 or the subnormal, or raise OverflowError.
    """
    match = _FLOAT_PREFIX.match(token)
    if match is None:
        raise _Refused(f"{token!r} is not a number (torch: stod)")
    body = match.group(2)
    lowered = body.lower()
    if lowered.startswith("nan"):
        value = math.nan
    elif lowered.startswith("inf"):
        value = math.inf
    else:
        hexadecimal = lowered.startswith("0x")
        try:
            value = (
                float.fromhex(body if "p" in lowered else body + "p0")
                if hexadecimal
                else (float(body))
            )
        except OverflowError:
            raise _Refused(f"{token!r} is out of range (torch: stod)") from None
        mantissa = lowered[2:].split("p")[0] if hexadecimal else lowered.split("e")[0]
        nonzero = re.search(r"[1-9a-f]" if hexadecimal else r"[1-9]", mantissa) is not None
        if math.isinf(value) or (value == 0.0 and nonzero):
            raise _Refused(f"{token!r} is out of range (torch: stod)")
        if value != 0.0 and abs(value) < _SMALLEST_NORMAL:
            raise _Refused(f"{token!r} is out of range (torch: stod)")
    return -value if match.group(1) == "-" else value


def _pow2(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


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
    "expandable_segments_reserve": None,  # not modelled: torch's reading is not kept
    "expandable_segments_reserve_by_class": None,
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
# The expandable-segment reserves of 2.15 (a fraction of the device, or "40G"; per
# class: a list). torch never refuses their values: it warns and keeps its default.
# The reserve itself is not modelled (no reading of it here); a per-class list is
# read to its "]" as other lists are, which is what a well-formed one does.
_RESERVE_KEYS = ("expandable_segments_reserve", "expandable_segments_reserve_by_class")
# The host allocator's limits (2.13+): MB read with stoull, clamped as sizes are, kept
# from call to call; unlimited (SIZE_MAX bytes, None here) until a string sets them.
_PINNED_MAX_KEYS = ("pinned_max_round_threshold_mb", "pinned_max_cached_size_mb")
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
            keys |= set(_PINNED_MAX_KEYS)
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
            keys |= set(_RESERVE_KEYS)
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
            "roundup_power2_divisions": (0,) * _INTERVALS,
        }
        for key in sorted(self.keys - {"backend"} - set(state)):
            state[key] = _DEFAULTS[key]
        return MappingProxyType(state)

    def default_text(self, key: str) -> str | None:
        """The text that puts ``key`` back to its default, or None if torch refuses it.

        torch refuses ``pinned_reserve_segment_size_mb:0`` (its own default) and,
        before 2.10, ``max_non_split_rounding_mb:20`` (it must be > 20); the host
        allocator's limits of 2.13+ are unlimited until set and no text gives that
        back: such a key cannot be put back once changed, so a scope may not change
        it unless the env (or a process default) already has.
        """
        default = _DEFAULTS.get(key)
        if key == "expandable_segments":
            return "False"
        if key == "pinned_reserve_segment_size_mb":
            return None
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
        tokens = _split(text, spaces_only=False)
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
        parse = _TokenParse(self, text, now) if self.tokenizer else _StrictParse(self, text, now)
        try:
            parse.run()
        except _Refused as exc:
            return Outcome(now, str(exc), tuple(parse.items), tuple(parse.notes))
        return Outcome(now, None, tuple(parse.items), tuple(parse.notes))

    def refuse(self, key: str, value: str, why: str) -> _Refused:
        return _Refused(f"{self.label} refuses {key}:{value}: {why}")


# --------------------------------------------------------------------------- #
# torch <= 2.9: one CUDA parser, separators checked, spaces dropped
# --------------------------------------------------------------------------- #


class _StrictParse:
    def __init__(self, rules: TorchRules, text: str, state: dict[str, Any]) -> None:
        self.rules = rules
        self.state = state
        self.tokens = _split(text, spaces_only=True)
        self.items: list[tuple[str, str]] = []
        self.notes: list[str] = []

    def _sep(self, i: int, char: str, after: str) -> None:
        if i >= len(self.tokens) or self.tokens[i] != char:
            got = repr(self.tokens[i]) if i < len(self.tokens) else "the end"
            raise _Refused(f"{self.rules.label} expects {char!r} after {after!r}, got {got}")

    def _value(self, i: int, key: str) -> str:
        if i >= len(self.tokens):
            raise _Refused(f"{self.rules.label} expects a value for {key}")
        return self.tokens[i]

    def run(self) -> None:
        s, t, r = self.state, self.tokens, self.rules
        s["max_split_size_mb"] = None
        s["garbage_collection_threshold"] = 0.0
        s["roundup_power2_divisions"] = (0,) * _INTERVALS
        i = 0
        while i < len(t):
            raw = t[i]
            key = ALIASES.get(raw, raw)
            if key not in r.generic_keys:
                raise _Refused(f"{r.label} does not know the setting {raw!r}{_close_to(r, raw)}")
            start = i
            self._sep(i + 1, ":", raw)
            i += 2
            if key == "roundup_power2_divisions":
                i = self._roundup(i)
            elif key == "backend":
                _check_backend(r, self._value(i, key))
            else:
                _apply_scalar(r, key, self._value(i, key), s, reader=_stoi)
            self.items.append((key, "".join(t[start + 2 : i + 1])))
            if i + 1 < len(t):
                self._sep(i + 1, ",", "".join(t[start : i + 1]))
                i += 1
            i += 1

    def _roundup(self, i: int) -> int:
        t, r = self.tokens, self.rules
        key = "roundup_power2_divisions"
        value = self._value(i, key)
        if value != "[":
            _roundup_all(r, self.state, value, _stoi)
            return i
        out = list(self.state[key])  # a list edits what this call has so far
        first, last = True, 0
        i += 1
        while i < len(t) and t[i] != "]":
            boundary = t[i]
            self._sep(i + 1, ":", boundary)
            if i + 2 >= len(t):
                raise r.refuse(key, "[...", "a list item has no value")
            divisions = _stoi(t[i + 2])
            i += 2
            first, last = _roundup_item(r, out, boundary, t[i], divisions, first, last, after=0)
            self.state[key] = tuple(out)  # torch fills its vector in place
            if i + 1 >= len(t):
                raise r.refuse(key, "[...", "the list has no closing ']'")
            if t[i + 1] != "]":
                self._sep(i + 1, ",", t[i])
                i += 1
            i += 1
        self.state[key] = tuple(out)
        return i


# --------------------------------------------------------------------------- #
# torch >= 2.10: ConfigTokenizer, the generic parser, then the CUDA parser
# --------------------------------------------------------------------------- #


class _TokenParse:
    def __init__(self, rules: TorchRules, text: str, state: dict[str, Any]) -> None:
        self.rules = rules
        self.state = state
        self.tokens = _split(text, spaces_only=False)
        self.items: list[tuple[str, str]] = []
        self.notes: list[str] = []
        word = r"[^,:\[\]" + re.escape(C_SPACE) + "]"
        if re.search(f"{word}{_SPACES}+{word}", text):
            self.notes.append(
                f"whitespace inside a value or name in {text!r} is dropped, not a separator "
                f"(torch reads {''.join(self.tokens)!r})"
            )

    def _at(self, i: int) -> str:
        if i >= len(self.tokens):
            raise _Refused(f"{self.rules.label} ran out of tokens in {''.join(self.tokens)!r}")
        return self.tokens[i]

    def _skip(self, i: int, expected: str, after: str) -> int:
        """``checkToken(++i, c)``: torch only checks that a token exists there."""
        token = self._at(i)
        if token != expected:
            self.notes.append(f"{token!r} after {after!r} is read as {expected!r}")
        return i

    def _skip_key(self, i: int) -> int:
        i = self._skip(i + 1, ":", self.tokens[i]) + 1
        if self._at(i) != "[":
            return i
        i += 1
        while i < len(self.tokens) and self.tokens[i] != "]":
            i += 1
        if i >= len(self.tokens):
            raise _Refused(f"{self.rules.label}: a list has no closing ']'")
        return i

    def run(self) -> None:
        r, s, t = self.rules, self.state, self.tokens
        s["max_split_size_mb"] = None
        s["roundup_power2_divisions"] = (0,) * _INTERVALS
        s["garbage_collection_threshold"] = 0.0
        if r.version >= (2, 11):
            i = 0
            while i < len(t):
                if t[i] == "large_segment_size_mb":
                    self._skip(i + 1, ":", t[i])
                    value = self._at(i + 2)
                    _apply_scalar(r, "large_segment_size_mb", value, s, reader=_stoull)
                    i += 2
                i += 1
            s["max_non_split_rounding_mb"] = s["large_segment_size_mb"]
        self._pass(generic=True)
        if r.device_keys:
            self._pass(generic=False)

    def _pass(self, *, generic: bool) -> None:
        r, s, t = self.rules, self.state, self.tokens
        mine = r.generic_keys if generic else r.device_keys
        i = 0
        while i < len(t):
            raw = t[i]
            key = ALIASES.get(raw, raw)
            start = i
            if key in mine and key in _RESERVE_KEYS:
                i = self._skip_key(i)
            elif key in mine and key != "large_segment_size_mb":
                i = self._skip(i + 1, ":", raw) + 1
                if key == "roundup_power2_divisions":
                    i = self._roundup(i)
                else:
                    value = self._at(i)
                    if key == "backend":
                        _check_backend(r, value)
                    else:
                        _apply_scalar(r, key, value, s, reader=_stoull)
            else:
                if r.device and key not in r.keys:
                    where = "allocator config" if generic else "CUDA allocator config"
                    raise _Refused(
                        f"{r.label} does not know the setting {raw!r} ({where}){_close_to(r, raw)}"
                    )
                i = self._skip_key(i)
            if generic:
                self.items.append((key, "".join(t[start + 2 : i + 1])))
            if i + 1 < len(t):
                if generic and t[i + 1] != ",":
                    self.notes.append(
                        f"{t[i + 1]!r} after {''.join(t[start : i + 1])!r} is read as ','"
                    )
                i += 1
            i += 1

    def _roundup(self, i: int) -> int:
        r, t = self.rules, self.tokens
        key = "roundup_power2_divisions"
        value = self._at(i)
        if value != "[":
            _roundup_all(r, self.state, value, _stoull)
            return i
        out = list(self.state[key])  # a list edits what this call has so far
        first, last = True, 0
        i += 1
        while i < len(t) and t[i] != "]":
            at = i
            self._skip(i + 1, ":", t[at])
            divisions = _stoull(self._at(i + 2))
            i += 2
            # 2.10+ fills ">" from the interval after the last one named (<= 2.9: from it)
            first, last = _roundup_item(r, out, t[at], t[i], divisions, first, last, after=1)
            self.state[key] = tuple(out)  # torch fills its vector in place
            if self._at(i + 1) != "]":
                i += 1
            i += 1
        if i >= len(t):
            raise r.refuse(key, "[...", "the list has no closing ']'")
        self.state[key] = tuple(out)
        return i


# --------------------------------------------------------------------------- #
# Shared pieces
# --------------------------------------------------------------------------- #


def _roundup_all(
    rules: TorchRules, state: dict[str, Any], value: str, reader: Callable[[str], int]
) -> None:
    """``roundup_power2_divisions:N``: one power of 2 for every interval."""
    divisions = reader(value)
    if not _pow2(divisions):
        raise rules.refuse("roundup_power2_divisions", value, "the divisions must be a power of 2")
    state["roundup_power2_divisions"] = (divisions,) * _INTERVALS


def _roundup_item(
    rules: TorchRules,
    out: list[int],
    boundary: str,
    text: str,
    divisions: int,
    first: bool,
    last: int,
    *,
    after: int,
) -> tuple[bool, int]:
    """Apply one ``SIZE_MB:DIVISIONS`` (or ``>:DIVISIONS``) of a roundup list to ``out``.

    ``text`` is the divisions as written, ``divisions`` as read.

    The first sized item also fills every interval below it; ``>`` fills from
    ``last + after`` up. Returns the new ``(first, last)``.
    """
    if divisions != 0 and not _pow2(divisions):
        raise rules.refuse(
            "roundup_power2_divisions", text, "the divisions must be 0 or a power of 2"
        )
    if boundary == ">":
        for j in range(last + after, _INTERVALS):
            out[j] = divisions
        return first, last
    size = _stoull(boundary)
    if not _pow2(size):
        raise rules.refuse(
            "roundup_power2_divisions", boundary, "the intervals must be powers of 2 (MB)"
        )
    index = min(size.bit_length() - 1, _INTERVALS - 1)
    if first:
        for j in range(index):
            out[j] = divisions
    out[index] = divisions
    return False, index


def _close_to(rules: TorchRules, raw: str) -> str:
    """`` (did you mean 'x'?)`` for an unknown key close to one this torch knows, else ""."""
    close = difflib.get_close_matches(raw, sorted(rules.keys | set(ALIASES)), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _split(text: str, *, spaces_only: bool) -> list[str]:
    tokens: list[str] = []
    buf: list[str] = []
    for ch in text:
        if ch in _DELIMITERS:
            if buf:
                tokens.append("".join(buf))
                buf = []
            tokens.append(ch)
        elif (ch != " ") if spaces_only else ch not in C_SPACE:
            buf.append(ch)
    if buf:
        tokens.append("".join(buf))
    return tokens


def _check_backend(rules: TorchRules, value: str) -> None:
    if value not in ("native", "cudaMallocAsync"):
        raise rules.refuse("backend", value, "the backends are native and cudaMallocAsync")
    if rules.backend is not None and value != rules.backend:
        raise rules.refuse(
            "backend", value, f"the backend is chosen at start-up ({rules.backend} here)"
        )


def _size_limit(rules: TorchRules, state: Mapping[str, Any]) -> tuple[int, str]:
    """The smallest max_split/max_non_split size (MB) torch accepts, and why."""
    if rules.version >= (2, 11):
        return int(state["large_segment_size_mb"]), "large_segment_size_mb"
    if rules.tokenizer:
        return 20, "the large-block size"
    return 21, "the large-block size (must be > 20)"


def _apply_scalar(
    rules: TorchRules,
    key: str,
    value: str,
    state: dict[str, Any],
    *,
    reader: Callable[[str], int],
) -> None:
    """Parse one scalar value the way this torch does and store it in ``state``."""
    if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
        size = (_stoi if not rules.tokenizer else reader)(value)
        minimum, why = _size_limit(rules, state)
        if size < minimum:
            raise rules.refuse(key, value, f"must be >= {minimum} ({why})")
        state[key] = min(size, _MAX_SPLIT_MB)
    elif key in _PINNED_MAX_KEYS:
        state[key] = min(_stoull(value), _MAX_SPLIT_MB)
    elif key == "large_segment_size_mb":
        size = _stoull(value)
        if size <= 10:
            raise rules.refuse(key, value, "must be > 10")
        state[key] = min(size, _MAX_SPLIT_MB)
    elif key == "garbage_collection_threshold":
        number = _stod(value)
        if not 0.0 < number < 1.0:
            raise rules.refuse(key, value, "must lie strictly between 0.0 and 1.0")
        state[key] = number
    elif key == "per_process_memory_fraction":
        number = _stod(value)
        if not 0.0 <= number <= 1.0:
            raise rules.refuse(key, value, "must lie in [0.0, 1.0]")
        state[key] = number
    elif key == "pinned_num_register_threads":
        count = (_stoi if not rules.tokenizer else _stoull)(value)
        if not _pow2(count):
            raise rules.refuse(key, value, "must be a power of 2")
        if count > 128:
            raise rules.refuse(key, value, "must be <= 128")
        state[key] = count
    elif key == "pinned_reserve_segment_size_mb":
        size = _stoull(value)
        if size == 0:
            raise rules.refuse(key, value, "must be > 0")
        state[key] = size
    else:  # a switch
        if value not in ("True", "False"):
            raise rules.refuse(key, value, "expected True or False (exactly)")
        state[key] = value == "True"
