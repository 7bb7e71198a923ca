"""Generated allocator-settings strings: the families torch's parser must be judged on.

One generator, two uses: :func:`cases` (a seed) makes what
``tests/torch_parser/record.py --generated`` asks each torch's own parser, and, on a
fresh seed each run, what the live oracle in CI gives the installed torch;
:data:`settings_strings` (a hypothesis strategy over the same draws) checks that the
model answers every string without raising.

Families: keys every version knows, keys of other versions, misspelt and unknown keys,
aliases; values at and around each bound, negative, huge, floats, hex, ``+``, Unicode
digits, lists and their edge cases; every C whitespace character and those C does not
call whitespace (``\\x1c``-``\\x1f``, ``\\xa0``, ``\\u3000``); empty items, duplicates,
missing separators and values, and both env variables.
"""

from __future__ import annotations

import random
from typing import Any

from hypothesis import strategies as st

__all__ = ["ENV_VARS", "case", "cases", "settings_strings", "string"]

ENV_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

# Written out, not taken from the model: a generator that asked the model for its keys
# could never find a key the model lacks.
_KEYS = (
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "garbage_collection_threshold",
    "roundup_power2_divisions",
    "expandable_segments",
    "pinned_use_background_threads",
    "large_segment_size_mb",
    "pinned_max_round_threshold_mb",
    "pinned_max_cached_size_mb",
    "backend",
    "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc",
    "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register",
    "pinned_num_register_threads",
    "pinned_reserve_segment_size_mb",
    "graph_capture_record_stream_reuse",
    "per_process_memory_fraction",
    "pinned_free_catch_all",
    "throw_on_cudamalloc_oom",
)
_UNKNOWN = ("foo", "expandable_segment", "Expandable_segments", "max_split_size", "x", "_")
_SIZES = frozenset(
    {
        "max_split_size_mb",
        "max_non_split_rounding_mb",
        "large_segment_size_mb",
        "pinned_max_round_threshold_mb",
        "pinned_max_cached_size_mb",
        "pinned_num_register_threads",
        "pinned_reserve_segment_size_mb",
    }
)
_FLOAT_KEYS = frozenset({"garbage_collection_threshold", "per_process_memory_fraction"})
_INTS = (
    "0",
    "1",
    "2",
    "3",
    "4",
    "8",
    "10",
    "11",
    "16",
    "19",
    "20",
    "21",
    "32",
    "63",
    "64",
    "128",
    "129",
    "256",
    "512",
    "1024",
    "2147483647",
    "2147483648",
    "4294967296",
    "17592186044415",
    "17592186044416",
    "9223372036854775807",
    "18446744073709551615",
    "18446744073709551616",
    "99999999999999999999",
    "-1",
    "-5",
    "+30",
    "0x20",
    "007",
    "25.5",
    "1e3",
    "",
    "abc",
    "64abc",
    "3 0",
    "\uff16\uff14",
    "\u0663\u0660",
    "\u0661",
    "\u00b2",
)
_FLOATS = (
    "0",
    "1",
    "0.5",
    ".5",
    "5.",
    "5e-1",
    "0.6",
    "0.999999",
    "1.0000001",
    "-0.5",
    "+0.5",
    "nan",
    "NaN",
    "inf",
    "-inf",
    "infinity",
    "0x1p-1",
    "0x.8",
    "0x1p2000",
    "1e400",
    "1e-400",
    "4e-320",
    "0.5abc",
    "abc",
    "",
    "0,5",
    "\u0660.\u0665",
    "0.\uff15",
)
_BOOLS = ("True", "False", "true", "1", "0", "yes", "", "Tru", "TrueX", "False ")
_LISTS = (
    "[256:4,>:1]",
    "[256:4,>:1,]",
    "[]",
    "[,]",
    "[256:3]",
    "[255:4]",
    "[>:2]",
    "[256:0,512:2]",
    "[1:4,65536:2,131072:8]",
    "[256:4",
    "[256:4,>:1]x",
    "[:4]",
    "[256:]",
    "[256:4,256:2]",
    "[>:1,256:4]",
    "[2:2,4:4,8:8,16:16]",
    "[\uff16\uff14:2]",
)
_SEPARATORS = (":",) * 24 + (",", "", ": ", " :", "::", ";")
_JOINERS = (",",) * 12 + (", ", ",,", ";", " ,")
# C's isspace() in the "C" locale, and characters Python calls space and C does not.
_C_SPACE = (" ", "\t", "\n", "\v", "\f", "\r")
_NOT_C_SPACE = ("\x1c", "\x1d", "\x1e", "\x1f", "\xa0", "\u3000", "\x85", "\u2028")


def _key(r: random.Random) -> str:
    roll = r.random()
    if roll < 0.88:
        return r.choice(_KEYS)
    if roll < 0.96:
        return r.choice(_UNKNOWN)
    key = r.choice(_KEYS)
    cut = r.randrange(len(key))
    return key[:cut] + key[cut + 1 :]  # a letter dropped


def _around(r: random.Random, text: str) -> str:
    """Whitespace of every kind before, after or inside ``text``, sometimes."""
    if r.random() > 0.06:
        return text
    space = r.choice(_C_SPACE + _NOT_C_SPACE)
    where = r.randrange(3)
    if where == 0:
        return space + text
    if where == 1:
        return text + space
    cut = r.randrange(len(text) + 1)
    return text[:cut] + space + text[cut:]


def _value(key: str, r: random.Random) -> str:
    if r.random() < 0.04:  # any family for any key
        return r.choice(_INTS + _FLOATS + _BOOLS + _LISTS)
    if key in _FLOAT_KEYS:
        return r.choice(_FLOATS)
    if key == "roundup_power2_divisions":
        return r.choice(_LISTS + _INTS[:12])
    if key == "backend":
        return r.choice(("native", "native", "cudaMallocAsync", "foo", ""))
    if key in _SIZES:
        return r.choice(_INTS)
    return r.choice(_BOOLS)


def _item(r: random.Random) -> str:
    key = _key(r)
    roll = r.random()
    if roll < 0.03:
        return _around(r, key)  # a key without its value
    separator = r.choice(_SEPARATORS)
    return _around(r, key) + separator + _around(r, _value(key, r))


def string(r: random.Random) -> str:
    """One settings string."""
    items = [_item(r) for _ in range(r.choice((0, 1, 1, 1, 2, 2, 2, 3, 4, 6)))]
    if items and r.random() < 0.05:
        items.append(r.choice(items))  # a duplicate: the later one wins, or not
    text = r.choice(_JOINERS).join(items)
    if r.random() < 0.05:
        text += ","
    if r.random() < 0.03:
        text = "," + text
    if r.random() < 0.03:
        text = _around(r, text)
    return text


def case(r: random.Random, *, env: bool) -> dict[str, Any]:
    """A process: an env (when ``env``), then a chain of setter strings."""
    environ: dict[str, str] = {}
    if env:
        for name in ENV_VARS:
            roll = r.random()
            if roll < 0.55:
                environ[name] = string(r)
            elif roll < 0.62:
                environ[name] = ""
        # The probe has no driver, whose version torch checks for this backend.
        if any("cudaMallocAsync" in text for text in environ.values()):
            environ = {}
    sets = [string(r) for _ in range(r.choice((1, 2, 3, 4, 5, 6)))]
    return {"env": environ, "sets": sets}


def cases(seed: int, count: int, *, env_every: int = 5) -> list[dict[str, Any]]:
    """``count`` cases from ``seed``; every ``env_every``-th one starts from an env."""
    r = random.Random(seed)
    return [case(r, env=index % env_every == 0) for index in range(count)]


#: One settings string, drawn by hypothesis (its seed shrinks, the draws do not).
settings_strings = st.randoms(use_true_random=False).map(string)
