"""Torch's allocator settings grammar: parse, validate, normalise and format.

The grammar is the one torch's ``ConfigTokenizer`` implements (c10/core/
AllocatorConfig): the string is split into tokens at ``,`` ``:`` ``[`` ``]``;
whitespace around tokens is dropped (inside a token it is an error, where torch
would silently glue ``30 40`` into ``3040``); items are ``key:value`` separated by
commas; a value is a single token or a bracketed list ``[a:b,c:d]``. Empty items
(``a:b,,c:d`` or a trailing comma) are ignored, as torch does; a later duplicate
key wins.

hybridmem is stricter than torch about values: torch reads ``max_split_size_mb:-5``
as an enormous number and ``25.5`` as 25; both are errors here, because a merged
string that hybridmem re-applies must mean exactly what the user wrote.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from hybridmem._errors import AllocatorSettingsError

__all__ = [
    "KEYS",
    "KeySpec",
    "format_settings",
    "normalize_value",
    "parse_settings",
]

_DELIMITERS = ",:[]"
_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_INT_RE = re.compile(r"\d+\Z")


def _fail(origin: str, message: str) -> AllocatorSettingsError:
    return AllocatorSettingsError(f"{origin}: {message}")


# --------------------------------------------------------------------------- #
# Value validators: take the raw token text, return the canonical text.
# --------------------------------------------------------------------------- #


def _bool(text: str) -> str:
    # torch 2.10+ accepts exactly "True"/"False" ("true" is a ValueError there).
    if text not in ("True", "False"):
        raise ValueError(f"expected True or False, got {text!r}")
    return text


def _int(text: str, *, minimum: int = 0) -> int:
    if not _INT_RE.match(text):
        raise ValueError(f"expected a non-negative whole number, got {text!r}")
    value = int(text)
    if value < minimum:
        raise ValueError(f"must be >= {minimum}, got {value}")
    return value


def _split_mb(text: str) -> str:
    # torch: kLargeBuffer (20 MiB) is the smallest block it will not split.
    return str(_int(text, minimum=20))


def _positive_mb(text: str) -> str:
    return str(_int(text, minimum=1))


def _nonnegative(text: str) -> str:
    return str(_int(text))


def _power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def _register_threads(text: str) -> str:
    value = _int(text, minimum=1)
    if not _power_of_two(value) or value > 128:
        raise ValueError(f"must be a power of 2 no larger than 128, got {value}")
    return str(value)


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {text!r}")
    return value


def _gc_threshold(text: str) -> str:
    value = _float(text)
    if not 0.0 < value < 1.0:
        raise ValueError(f"must lie strictly between 0.0 and 1.0, got {text}")
    return repr(value)


def _fraction(text: str) -> str:
    value = _float(text)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"must lie in (0.0, 1.0], got {text}")
    return repr(value)


def _roundup(text: str) -> str:
    if not text.startswith("["):
        value = _int(text, minimum=1)
        if not _power_of_two(value):
            raise ValueError(f"must be a power of 2, got {value}")
        return str(value)
    inner = text[1:-1]
    if not inner:
        raise ValueError("the list [...] is empty")
    items = []
    for item in inner.split(","):
        size, sep, divisions = item.partition(":")
        if not sep:
            raise ValueError(f"list item {item!r} is not SIZE_MB:DIVISIONS")
        if size != ">":
            size_value = _int(size, minimum=1)
            if not _power_of_two(size_value):
                raise ValueError(f"interval {size!r} must be a power of 2 (MB) or '>'")
        div_value = _int(divisions)
        if div_value != 0 and not _power_of_two(div_value):
            raise ValueError(f"divisions {divisions!r} must be 0 or a power of 2")
        items.append(f"{size}:{div_value}")
    return "[" + ",".join(items) + "]"


def _backend(text: str) -> str:
    if text not in ("native", "cudaMallocAsync"):
        raise ValueError(f"expected native or cudaMallocAsync, got {text!r}")
    return text


@dataclass(frozen=True)
class KeySpec:
    """What hybridmem knows about one allocator setting.

    Attributes:
        name: the key as torch spells it.
        validate: maps the raw token text to canonical text or raises ValueError.
        default: the text that restores torch's default explicitly, or None where
            torch resets the key to its default on every setter call anyway.
        shown_default: the default as shown to people.
        kind: the Python types accepted by :func:`normalize_value`.
        device_key: True for CUDA-specific keys (torch reads them from
            ``PYTORCH_CUDA_ALLOC_CONF`` first), False for accelerator-generic ones.
        runtime: False where the key cannot change after start-up.
    """

    name: str
    validate: Callable[[str], str]
    default: str | None
    shown_default: str
    kind: str
    device_key: bool = False
    runtime: bool = True


def _spec(
    name: str,
    validate: Callable[[str], str],
    default: str | None,
    shown: str,
    kind: str,
    *,
    device_key: bool = False,
    runtime: bool = True,
) -> KeySpec:
    return KeySpec(name, validate, default, shown, kind, device_key, runtime)


#: Every key torch 2.4 - 2.13 understands. ``default=None`` marks the three keys
#: torch resets on every setter call (max_split_size, roundup, gc threshold);
#: all others keep their last value, so hybridmem restores them explicitly.
KEYS: dict[str, KeySpec] = {
    spec.name: spec
    for spec in (
        _spec("expandable_segments", _bool, "False", "False", "bool"),
        _spec("max_split_size_mb", _split_mb, None, "unlimited", "int"),
        _spec("max_non_split_rounding_mb", _split_mb, "20", "20", "int"),
        _spec("garbage_collection_threshold", _gc_threshold, None, "0 (off)", "float"),
        _spec("roundup_power2_divisions", _roundup, None, "0 (off)", "roundup"),
        _spec("large_segment_size_mb", _positive_mb, "20", "20", "int"),
        _spec("pinned_use_background_threads", _bool, "False", "False", "bool"),
        _spec("backend", _backend, None, "native", "str", device_key=True, runtime=False),
        _spec("release_lock_on_cudamalloc", _bool, "False", "False", "bool", device_key=True),
        _spec("pinned_use_cuda_host_register", _bool, "False", "False", "bool", device_key=True),
        _spec("pinned_num_register_threads", _register_threads, "1", "1", "int", device_key=True),
        _spec("pinned_reserve_segment_size_mb", _nonnegative, "0", "0", "int", device_key=True),
        _spec(
            "graph_capture_record_stream_reuse", _bool, "False", "False", "bool", device_key=True
        ),
        _spec("per_process_memory_fraction", _fraction, "1.0", "1.0", "float", device_key=True),
        _spec("pinned_free_catch_all", _bool, "False", "False", "bool", device_key=True),
        _spec("throw_on_cudamalloc_oom", _bool, "False", "False", "bool", device_key=True),
    )
}


def _tokens(text: str) -> list[str]:
    tokens: list[str] = []
    buf: list[str] = []
    for ch in text:
        if ch in _DELIMITERS:
            if buf:
                tokens.append("".join(buf))
                buf = []
            tokens.append(ch)
        elif ch.isspace():
            # torch deletes spaces, so "30 40" reads as 3040; ending the token here
            # turns that into a clear "expected ','" error instead.
            if buf:
                tokens.append("".join(buf))
                buf = []
        else:
            buf.append(ch)
    if buf:
        tokens.append("".join(buf))
    return tokens


def parse_settings(text: str, *, origin: str = "allocator settings") -> dict[str, str]:
    """Parse a torch allocator settings string into ``{key: canonical value}``.

    Args:
        text: e.g. ``"expandable_segments:True, max_split_size_mb:256"``.
        origin: where the text came from, for error messages (an env var name).

    Returns:
        An insertion-ordered dict; unknown keys are kept verbatim (a newer torch
        may know them), known keys are validated and normalised.

    Raises:
        AllocatorSettingsError: the text breaks the grammar or a value is invalid.

    Example:
        >>> parse_settings("max_split_size_mb: 256 ,expandable_segments:True")
        {'max_split_size_mb': '256', 'expandable_segments': 'True'}
    """
    tokens = _tokens(text)
    result: dict[str, str] = {}
    i = 0
    n = len(tokens)
    while i < n:
        key = tokens[i]
        if key == ",":
            i += 1
            continue
        if not _KEY_RE.match(key):
            raise _fail(origin, f"expected a setting name at {key!r} in {text!r}")
        if i + 1 >= n or tokens[i + 1] != ":":
            raise _fail(origin, f"expected ':' after {key!r} in {text!r} (write {key}:VALUE)")
        i += 2
        if i >= n or tokens[i] in ",:]":
            raise _fail(origin, f"missing value for {key!r} in {text!r}")
        if tokens[i] == "[":
            end = i + 1
            while end < n and tokens[end] != "]":
                if tokens[end] == "[":
                    raise _fail(origin, f"nested '[' in the value of {key!r} in {text!r}")
                end += 1
            if end >= n:
                raise _fail(origin, f"missing ']' in the value of {key!r} in {text!r}")
            raw = "".join(tokens[i : end + 1])
            i = end + 1
        else:
            raw = tokens[i]
            i += 1
        if i < n and tokens[i] != ",":
            raise _fail(origin, f"expected ',' after {key}:{raw} in {text!r}, got {tokens[i]!r}")
        spec = KEYS.get(key)
        if spec is not None:
            try:
                raw = spec.validate(raw)
            except ValueError as exc:
                raise _fail(origin, f"invalid value for {key}: {exc}") from None
        result.pop(key, None)  # a later duplicate wins and moves to the end, as in torch
        result[key] = raw
    return result


def normalize_value(key: str, value: object) -> str:
    """Turn a Python value given for ``key`` into canonical settings text.

    Args:
        key: a known setting name (see :data:`KEYS`).
        value: bool for switches, int for sizes and counts, float for fractions,
            an int or a ``{size_mb | ">": divisions}`` mapping for
            ``roundup_power2_divisions``; a string in torch's syntax always works.

    Raises:
        ValueError: unknown key (the message lists the known ones) or bad value.
        TypeError: the value has the wrong type.
    """
    spec = KEYS.get(key)
    if spec is None:
        known = ", ".join(sorted(KEYS))
        raise ValueError(f"unknown allocator setting {key!r}; known settings: {known}")
    if isinstance(value, str):
        text = "".join(value.split())
    elif spec.kind == "bool":
        if not isinstance(value, bool):
            raise TypeError(f"{key} takes True or False, got {value!r} ({type(value).__name__})")
        text = str(value)
    elif isinstance(value, bool):
        raise TypeError(f"{key} takes a {spec.kind}, got the bool {value!r}")
    elif spec.kind == "int" and isinstance(value, int):
        text = str(value)
    elif spec.kind == "float" and isinstance(value, (int, float)):
        text = repr(float(value))
    elif spec.kind == "roundup" and isinstance(value, int):
        text = str(value)
    elif spec.kind == "roundup" and isinstance(value, Mapping):
        text = "[" + ",".join(f"{k}:{v}" for k, v in value.items()) + "]"
    else:
        raise TypeError(
            f"{key} takes a {spec.kind} (or a string in torch's syntax), "
            f"got {value!r} ({type(value).__name__})"
        )
    try:
        return spec.validate(text)
    except ValueError as exc:
        raise AllocatorSettingsError(f"invalid value for {key}: {exc}") from None


def format_settings(items: Iterable[tuple[str, str]]) -> str:
    """Join ``(key, value)`` pairs into torch's ``key:value,key:value`` syntax."""
    return ",".join(f"{k}:{v}" for k, v in items)
