"""Allocator settings as hybridmem's functions take them: known keys, Python values, text.

torch's own grammar, version by version, is :mod:`hybridmem.allocator.rules`; this
module holds what hybridmem adds on top: which keys its keyword arguments accept
(with the Python types they take), how a Python value becomes settings text, and
how a settings string reads as ``{key: value}`` under a given torch's rules.

What torch accepts, hybridmem accepts (strings are judged by the model of the
running torch's parser, never by a grammar of hybridmem's own); keyword arguments
are typed more strictly (``max_split_size_mb=25.5`` is a ``TypeError``, where the
string ``"25.5"`` is what torch reads as 25).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from hybridmem._errors import AllocatorSettingsError
from hybridmem._names import nearest
from hybridmem.allocator.cparse import C_SPACE, DELIMITERS, FLOAT_PREFIX
from hybridmem.allocator.parsers import IGNORED_RESERVE
from hybridmem.allocator.rules import TorchRules

__all__ = [
    "KEYS",
    "KeySpec",
    "format_settings",
    "keys_of",
    "normalize_value",
    "parse_settings",
]


@dataclass(frozen=True)
class KeySpec:
    """What hybridmem knows about one allocator setting.

    Attributes:
        name: the key as torch spells it.
        kind: the Python type :func:`normalize_value` takes (``"bool"``,
            ``"int"``, ``"float"``, ``"roundup"``, ``"reserve"``, ``"reserve_by_class"``,
            ``"str"``).
        default: torch's default as settings text (None: it has no text, e.g.
            an unlimited ``max_split_size_mb``).
        shown_default: the default as shown to people.
        device_key: a CUDA key (the CUDA parser reads it; CPU builds skip it).
        runtime: False where the key cannot change after start-up.
        since: the first torch ``(major, minor)`` that knows the key.
    """

    name: str
    kind: str
    default: str | None
    shown_default: str
    device_key: bool = False
    runtime: bool = True
    since: tuple[int, int] = (2, 4)


def _spec(
    name: str,
    kind: str,
    default: str | None,
    shown: str,
    *,
    device_key: bool = False,
    runtime: bool = True,
    since: tuple[int, int] = (2, 4),
) -> KeySpec:
    return KeySpec(name, kind, default, shown, device_key, runtime, since)


_C215: dict[str, Any] = {"device_key": True, "since": (2, 15)}

#: Every key torch 2.4 - 2.15 understands, with the version that added it.
KEYS: dict[str, KeySpec] = {
    spec.name: spec
    for spec in (
        _spec("expandable_segments", "bool", "False", "False"),
        _spec("max_split_size_mb", "int", None, "unlimited"),
        _spec("max_non_split_rounding_mb", "int", "20", "20", since=(2, 6)),
        _spec("garbage_collection_threshold", "float", None, "0 (off)"),
        _spec("roundup_power2_divisions", "roundup", None, "0 (off)"),
        _spec("large_segment_size_mb", "int", "20", "20", since=(2, 11)),
        _spec("pinned_use_background_threads", "bool", "False", "False", since=(2, 6)),
        # the host allocator's (2.13+): unlimited until set, and no text puts that back
        _spec("pinned_max_round_threshold_mb", "int", None, "unlimited", since=(2, 13)),
        _spec("pinned_max_cached_size_mb", "int", None, "unlimited", since=(2, 13)),
        _spec("backend", "str", "native", "native", device_key=True, runtime=False),
        _spec("release_lock_on_cudamalloc", "bool", "False", "False", device_key=True),
        _spec("pinned_use_cuda_host_register", "bool", "False", "False", device_key=True),
        _spec("pinned_num_register_threads", "int", "1", "1", device_key=True),
        _spec("pinned_reserve_segment_size_mb", "int", None, "0", device_key=True, since=(2, 10)),
        _spec(
            "graph_capture_record_stream_reuse",
            "bool",
            "False",
            "False",
            device_key=True,
            since=(2, 9),
        ),
        _spec("per_process_memory_fraction", "float", "1.0", "1.0", device_key=True, since=(2, 10)),
        _spec("pinned_free_catch_all", "bool", "False", "False", device_key=True, since=(2, 12)),
        _spec("throw_on_cudamalloc_oom", "bool", "False", "False", device_key=True, since=(2, 12)),
        # 2.15: a per-segment virtual-address reserve, 0.5 (of the device) or "40G" (GiB)
        _spec("expandable_segments_reserve", "reserve", None, "9/8 of the device", **_C215),
        _spec("expandable_segments_reserve_by_class", "reserve_by_class", None, "none", **_C215),
    )
}


@functools.cache
def keys_of(version: tuple[int, int]) -> tuple[str, ...]:
    """The settings torch ``version`` has (its CUDA build), in :data:`KEYS`' order.

    Example:
        >>> "expandable_segments_reserve" in keys_of((2, 13))
        False
        >>> "large_segment_size_mb" in keys_of((2, 11))
        True
    """
    return tuple(k for k, spec in KEYS.items() if spec.since <= version)


def parse_settings(
    text: str, rules: TorchRules, *, origin: str = "allocator settings"
) -> dict[str, str]:
    """Read a settings string as this torch does: ``{key: value text}``.

    Args:
        text: e.g. ``"expandable_segments:True, max_split_size_mb:256"``.
        rules: the torch whose parser decides (see :class:`TorchRules`).
        origin: where the text came from, for error messages (an env var name).

    Returns:
        An insertion-ordered dict; a later duplicate wins and moves to the end,
        as in torch. Values are as torch reads them (whitespace dropped, aliases
        such as ``release_lock_on_hipmalloc`` under their CUDA name).

    Raises:
        AllocatorSettingsError: this torch refuses the string (the message says
            why, naming ``origin``).

    Example:
        >>> parse_settings("max_split_size_mb: 256 ,expandable_segments:True", TorchRules((2, 11)))
        {'max_split_size_mb': '256', 'expandable_segments': 'True'}
    """
    outcome = rules.run(text)
    if not outcome.accepted:
        raise AllocatorSettingsError(f"{origin}={text!r}: {outcome.error}")
    result: dict[str, str] = {}
    for key, value in outcome.items:
        result.pop(key, None)
        result[key] = value
    return result


def normalize_value(key: str, value: object, rules: TorchRules) -> str:
    """Turn a Python value given for ``key`` into settings text this torch accepts.

    Args:
        key: a known setting name (see :data:`KEYS`).
        value: bool for switches, int for sizes and counts, float (or int) for
            fractions, an int or a ``{size_mb | ">": divisions}`` mapping for
            ``roundup_power2_divisions``; a string in torch's syntax where it has that
            type (``"512"`` for a size, never ``"25.5"``).
        rules: the torch that will read it.

    Raises:
        ValueError: unknown key (the message lists the known ones), a key this
            torch does not have, or a value it refuses (an
            :class:`AllocatorSettingsError` saying why).
        TypeError: the value has the wrong type.
    """
    spec = KEYS.get(key)
    if spec is None:
        here = sorted(keys_of(rules.version))
        raise ValueError(
            f"unknown allocator setting {key!r}{nearest(key, here)}; {rules.label} knows: "
            f"{', '.join(here)}"
        )
    if rules.version < spec.since:
        raise ValueError(
            f"{rules.label} has no allocator setting {key!r} (torch "
            f"{spec.since[0]}.{spec.since[1]} added it); leave it out on this torch"
        )
    if isinstance(value, str):
        text = _without_c_space(value)
    elif spec.kind == "bool":
        if not isinstance(value, bool):
            raise TypeError(f"{key} takes True or False, got {value!r} ({type(value).__name__})")
        text = str(value)
    elif isinstance(value, bool):
        raise TypeError(f"{key} takes {_kind_words(spec.kind)}, got the bool {value!r}")
    elif spec.kind == "int" and isinstance(value, int):
        text = str(value)
    elif spec.kind == "float" and isinstance(value, (int, float)):
        text = repr(float(value))
    elif spec.kind == "roundup" and isinstance(value, int):
        text = str(value)
    elif spec.kind == "roundup" and isinstance(value, Mapping):
        text = "[" + ",".join(f"{k}:{v}" for k, v in value.items()) + "]"
    elif spec.kind == "reserve" and isinstance(value, (int, float)):
        text = _reserve_text(key, value)
    elif spec.kind == "reserve_by_class" and isinstance(value, Mapping):
        text = "[" + ",".join(_reserve_item(key, k, v) for k, v in value.items()) + "]"
    else:
        raise TypeError(
            f"{key} takes {_kind_words(spec.kind)} (or a string in torch's syntax), "
            f"got {value!r} ({type(value).__name__})"
        )
    # Keyword arguments are typed: torch reads "25.5" as 25 and "-5" as 2**64 - 5,
    # which no caller of a typed API means.
    if spec.kind == "int" and not (text.isascii() and text.isdigit()):
        raise AllocatorSettingsError(
            f"invalid value for {key}: {_whole_number(key, rules)}, got {value!r}"
        )
    if spec.kind == "float":  # a whole number as C reads it (torch would read "0.5x" as 0.5)
        number = FLOAT_PREFIX.match(text)
        if number is None or number.end() != len(text):
            raise AllocatorSettingsError(
                f"invalid value for {key}: a number is needed, got {value!r}"
            )
    outcome = rules.run(f"{key}:{text}")  # judged alone here; with the rest on entry
    if not outcome.accepted:
        raise AllocatorSettingsError(f"invalid value for {key}: {outcome.error} (got {value!r})")
    ignored = [note for note in outcome.notes if IGNORED_RESERVE in note]
    if ignored:  # torch takes a bad reserve and ignores it with a warning: a typed call refuses
        raise AllocatorSettingsError(
            f"invalid value for {key}: {ignored[0]} (got {value!r}); "
            f"e.g. {key}={_RESERVE_EXAMPLE[spec.kind]}"
        )
    return text


def _without_c_space(text: str) -> str:
    """``text`` as torch's tokenizer keeps it: without C's whitespace, anywhere.

    Nothing else goes: Python's ``str.split()`` would also drop ``\x1c``-``\x1f`` and
    ``\xa0``, which torch keeps (and then refuses).
    """
    return "".join(ch for ch in text if ch not in C_SPACE)


def _kind_words(kind: str) -> str:
    """What a kind of value is, for an error message."""
    return {
        "reserve": 'a fraction of the device (0.5) or GiB as a string ("40G")',
        "reserve_by_class": 'a mapping of class name to reserve ({"capture": 0.25})',
    }.get(kind, f"a {kind}")


_RESERVE_EXAMPLE = {"reserve": '0.5 or "40G"', "reserve_by_class": '{"capture": 0.25, "ws": "8G"}'}


def _reserve_text(key: str, value: object) -> str:
    """One reserve as text: a fraction of the device (int or float) or a GiB string."""
    if isinstance(value, str):
        return _without_c_space(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f'{key} takes a fraction of the device (0.5) or GiB as a string ("40G"), '
            f"got {value!r} ({type(value).__name__})"
        )
    return str(value) if isinstance(value, int) else repr(value)


def _reserve_item(key: str, name: object, value: object) -> str:
    """``name:reserve`` of a per-class list; a name torch would split is refused."""
    if (
        not isinstance(name, str)
        or not name
        or any(ch in DELIMITERS or ch in C_SPACE for ch in name)
    ):
        raise ValueError(
            f"{key} takes class names without ',', ':', '[', ']' or whitespace, got {name!r}"
        )
    return f"{name}:{_reserve_text(key, value)}"


def _whole_number(key: str, rules: TorchRules) -> str:
    """What ``key`` takes, bound included: "a whole number >= 20 (...)", say."""
    floor = rules.run(f"{key}:0")
    if floor.accepted or floor.error is None:
        return "a whole number >= 0 is needed"
    _, _, why = floor.error.partition(f"{key}:0: ")
    return f"a whole number is needed, which {why or floor.error}"


def format_settings(items: Iterable[tuple[str, str]]) -> str:
    """Join ``(key, value)`` pairs into torch's ``key:value,key:value`` syntax."""
    return ",".join(f"{k}:{v}" for k, v in items)
