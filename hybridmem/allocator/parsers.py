"""torch's two allocator-settings parsers, replayed: the strict one (<= 2.9), the tokenizer (2.10+).

What each version knows is in :mod:`hybridmem.allocator.rules`
 (:class:`~hybridmem.allocator.rules.TorchRules`) and runs one of these
on a string. Pure Python, no torch import.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from hybridmem.allocator.cparse import (
    ALIASES,
    C_SPACE,
    DELIMITERS,
    INTERVALS,
    MAX_SPLIT_MB,
    PINNED_MAX_KEYS,
    RESERVE_KEYS,
    SPACES,
    Refused,
    pow2,
    reserve_spec,
    stod,
    stoi,
    stoull,
)

__all__ = ["IGNORED_RESERVE", "RulesView", "StrictParse", "TokenParse", "split"]

#: The words of a note on a reserve value torch takes, warns about and ignores.
IGNORED_RESERVE = "is ignored by torch"


class RulesView(Protocol):
    """What a parser reads of :class:`~hybridmem.allocator.rules.TorchRules`."""

    @property
    def version(self) -> tuple[int, int]: ...

    @property
    def backend(self) -> str | None: ...

    @property
    def label(self) -> str: ...

    @property
    def tokenizer(self) -> bool: ...

    @property
    def device(self) -> bool: ...

    @property
    def keys(self) -> frozenset[str]: ...

    @property
    def generic_keys(self) -> frozenset[str]: ...

    @property
    def device_keys(self) -> frozenset[str]: ...

    def refuse(self, key: str, value: str, why: str) -> Refused: ...


# --------------------------------------------------------------------------- #
# torch <= 2.9: one CUDA parser, separators checked, spaces dropped
# --------------------------------------------------------------------------- #


class StrictParse:
    def __init__(self, rules: RulesView, text: str, state: dict[str, Any]) -> None:
        self.rules = rules
        self.state = state
        self.tokens = split(text, spaces_only=True)
        self.items: list[tuple[str, str]] = []
        self.notes: list[str] = []

    def _sep(self, i: int, char: str, after: str) -> None:
        if i >= len(self.tokens) or self.tokens[i] != char:
            got = repr(self.tokens[i]) if i < len(self.tokens) else "the end"
            raise Refused(f"{self.rules.label} expects {char!r} after {after!r}, got {got}")

    def _value(self, i: int, key: str) -> str:
        if i >= len(self.tokens):
            raise Refused(f"{self.rules.label} expects a value for {key}")
        return self.tokens[i]

    def run(self) -> None:
        s, t, r = self.state, self.tokens, self.rules
        s["max_split_size_mb"] = None
        s["garbage_collection_threshold"] = 0.0
        s["roundup_power2_divisions"] = (0,) * INTERVALS
        i = 0
        while i < len(t):
            raw = t[i]
            key = ALIASES.get(raw, raw)
            if key not in r.generic_keys:
                raise Refused(f"{r.label} does not know the setting {raw!r}{_close_to(r, raw)}")
            start = i
            self._sep(i + 1, ":", raw)
            i += 2
            if key == "roundup_power2_divisions":
                i = self._roundup(i)
            elif key == "backend":
                _check_backend(r, self._value(i, key))
            else:
                _apply_scalar(r, key, self._value(i, key), s, reader=stoi)
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
            _roundup_all(r, self.state, value, stoi)
            return i
        out = list(self.state[key])  # a list edits what this call has so far
        first, last = True, 0
        i += 1
        while i < len(t) and t[i] != "]":
            boundary = t[i]
            self._sep(i + 1, ":", boundary)
            if i + 2 >= len(t):
                raise r.refuse(key, "[...", "a list item has no value")
            divisions = stoi(t[i + 2])
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


class TokenParse:
    def __init__(self, rules: RulesView, text: str, state: dict[str, Any]) -> None:
        self.rules = rules
        self.state = state
        self.tokens = split(text, spaces_only=False)
        self.items: list[tuple[str, str]] = []
        self.notes: list[str] = []
        word = r"[^,:\[\]" + re.escape(C_SPACE) + "]"
        if re.search(f"{word}{SPACES}+{word}", text):
            self.notes.append(
                f"whitespace inside a value or name in {text!r} is dropped, not a separator "
                f"(torch reads {''.join(self.tokens)!r})"
            )

    def _at(self, i: int) -> str:
        if i >= len(self.tokens):
            raise Refused(f"{self.rules.label} ran out of tokens in {''.join(self.tokens)!r}")
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
            raise Refused(f"{self.rules.label}: a list has no closing ']'")
        return i

    def run(self) -> None:
        r, s, t = self.rules, self.state, self.tokens
        s["max_split_size_mb"] = None
        s["roundup_power2_divisions"] = (0,) * INTERVALS
        s["garbage_collection_threshold"] = 0.0
        if r.version >= (2, 11):
            i = 0
            while i < len(t):
                if t[i] == "large_segment_size_mb":
                    self._skip(i + 1, ":", t[i])
                    value = self._at(i + 2)
                    _apply_scalar(r, "large_segment_size_mb", value, s, reader=stoull)
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
            if key in mine and key in RESERVE_KEYS:
                i = self._reserve(i, key) if not generic else self._skip_key(i)
            elif key in mine and key != "large_segment_size_mb":
                i = self._skip(i + 1, ":", raw) + 1
                if key == "roundup_power2_divisions":
                    i = self._roundup(i)
                else:
                    value = self._at(i)
                    if key == "backend":
                        _check_backend(r, value)
                    else:
                        _apply_scalar(r, key, value, s, reader=stoull)
            else:
                if r.device and key not in r.keys:
                    where = "allocator config" if generic else "CUDA allocator config"
                    raise Refused(
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

    def _reserve(self, i: int, key: str) -> int:
        """The device parser's reserve keys (2.15): one value, or a ``[name:value,...]`` list.

        ``checkToken`` only asks that a token exists, so a missing ``:`` or ``[`` is
        read over; a list runs to its ``]`` (none: out of tokens, refused), and a bad
        value is ignored by torch with a warning (a note here).
        """
        raw = self.tokens[i]
        i = self._skip(i + 1, ":", raw) + 1
        if key == "expandable_segments_reserve":
            spec = self._reserve_value(key, self._at(i))
            if spec is not None:  # a bad value keeps what was there
                self.state[key] = spec
            return i
        self._skip(i, "[", f"{raw}:")
        parsed: dict[str, tuple[bool, float]] = {}
        while self._at(i + 1) != "]":
            name = self._at(i + 1)
            i = self._skip(i + 2, ":", name) + 1
            spec = self._reserve_value(f"{key}[{name}]", self._at(i))
            if spec is not None:  # a bad entry is skipped, the others apply
                parsed[name] = spec
            if self._at(i + 1) == ",":
                i += 1
        self.state[key] = tuple(sorted(parsed.items()))  # the whole list, once read to "]"
        return i + 1

    def _reserve_value(self, where: str, token: str) -> tuple[bool, float] | None:
        spec = reserve_spec(token)
        if spec is None:
            self.notes.append(
                f"{where}:{token} {IGNORED_RESERVE} (it warns and keeps its default): "
                "a positive fraction of the device like 0.5, or GiB like 40G, is needed"
            )
        return spec

    def _roundup(self, i: int) -> int:
        r, t = self.rules, self.tokens
        key = "roundup_power2_divisions"
        value = self._at(i)
        if value != "[":
            _roundup_all(r, self.state, value, stoull)
            return i
        out = list(self.state[key])  # a list edits what this call has so far
        first, last = True, 0
        i += 1
        while i < len(t) and t[i] != "]":
            at = i
            self._skip(i + 1, ":", t[at])
            divisions = stoull(self._at(i + 2))
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
    rules: RulesView, state: dict[str, Any], value: str, reader: Callable[[str], int]
) -> None:
    """``roundup_power2_divisions:N``: one power of 2 for every interval."""
    divisions = reader(value)
    if not pow2(divisions):
        raise rules.refuse("roundup_power2_divisions", value, "the divisions must be a power of 2")
    state["roundup_power2_divisions"] = (divisions,) * INTERVALS


def _roundup_item(
    rules: RulesView,
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
    if divisions != 0 and not pow2(divisions):
        raise rules.refuse(
            "roundup_power2_divisions", text, "the divisions must be 0 or a power of 2"
        )
    if boundary == ">":
        for j in range(last + after, INTERVALS):
            out[j] = divisions
        return first, last
    size = stoull(boundary)
    if not pow2(size):
        raise rules.refuse(
            "roundup_power2_divisions", boundary, "the intervals must be powers of 2 (MB)"
        )
    index = min(size.bit_length() - 1, INTERVALS - 1)
    if first:
        for j in range(index):
            out[j] = divisions
    out[index] = divisions
    return False, index


def _close_to(rules: RulesView, raw: str) -> str:
    """`` (did you mean 'x'?)`` for an unknown key close to one this torch knows, else ""."""
    close = difflib.get_close_matches(raw, sorted(rules.keys | set(ALIASES)), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def split(text: str, *, spaces_only: bool) -> list[str]:
    tokens: list[str] = []
    buf: list[str] = []
    for ch in text:
        if ch in DELIMITERS:
            if buf:
                tokens.append("".join(buf))
                buf = []
            tokens.append(ch)
        elif (ch != " ") if spaces_only else ch not in C_SPACE:
            buf.append(ch)
    if buf:
        tokens.append("".join(buf))
    return tokens


def _check_backend(rules: RulesView, value: str) -> None:
    if value not in ("native", "cudaMallocAsync"):
        raise rules.refuse("backend", value, "the backends are native and cudaMallocAsync")
    if rules.backend is not None and value != rules.backend:
        raise rules.refuse(
            "backend", value, f"the backend is chosen at start-up ({rules.backend} here)"
        )


def _size_limit(rules: RulesView, state: Mapping[str, Any]) -> tuple[int, str]:
    """The smallest max_split/max_non_split size (MB) torch accepts, and why."""
    if rules.version >= (2, 11):
        return int(state["large_segment_size_mb"]), "large_segment_size_mb"
    if rules.tokenizer:
        return 20, "the large-block size"
    return 21, "the large-block size (must be > 20)"


def _apply_scalar(
    rules: RulesView,
    key: str,
    value: str,
    state: dict[str, Any],
    *,
    reader: Callable[[str], int],
) -> None:
    """Parse one scalar value the way this torch does and store it in ``state``."""
    if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
        size = (stoi if not rules.tokenizer else reader)(value)
        minimum, why = _size_limit(rules, state)
        if size < minimum:
            raise rules.refuse(key, value, f"must be >= {minimum} ({why})")
        state[key] = min(size, MAX_SPLIT_MB)
    elif key in PINNED_MAX_KEYS:
        state[key] = min(stoull(value), MAX_SPLIT_MB)
    elif key == "large_segment_size_mb":
        size = stoull(value)
        if size <= 10:
            raise rules.refuse(key, value, "must be > 10")
        state[key] = min(size, MAX_SPLIT_MB)
    elif key == "garbage_collection_threshold":
        number = stod(value)
        if not 0.0 < number < 1.0:
            raise rules.refuse(key, value, "must lie strictly between 0.0 and 1.0")
        state[key] = number
    elif key == "per_process_memory_fraction":
        number = stod(value)
        if not 0.0 <= number <= 1.0:
            raise rules.refuse(key, value, "must lie in [0.0, 1.0]")
        state[key] = number
    elif key == "pinned_num_register_threads":
        count = (stoi if not rules.tokenizer else stoull)(value)
        if not pow2(count):
            raise rules.refuse(key, value, "must be a power of 2")
        if count > 128:
            raise rules.refuse(key, value, "must be <= 128")
        state[key] = count
    elif key == "pinned_reserve_segment_size_mb":
        size = stoull(value)
        if size == 0:
            raise rules.refuse(key, value, "must be > 0")
        state[key] = size
    else:  # a switch
        if value not in ("True", "False"):
            raise rules.refuse(key, value, "expected True or False (exactly)")
        state[key] = value == "True"
