"""What torch's allocator-settings parsers share: units, limits, aliases, C's number readers.

The rules of each version (:mod:`hybridmem.allocator.rules`)
and the two parsers (:mod:`hybridmem.allocator.parsers`) both read these.
Pure Python, no torch import.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

from hybridmem._platform.c_numbers import strtod_range_error

__all__ = [
    "ALIASES",
    "C_SPACE",
    "DELIMITERS",
    "FLOAT_PREFIX",
    "INTERVALS",
    "INT_MAX",
    "INT_MIN",
    "INT_PREFIX",
    "MAX_SPLIT_MB",
    "MB",
    "PINNED_MAX_KEYS",
    "RESERVE_KEYS",
    "SIZE_MAX",
    "SMALLEST_NORMAL",
    "SPACES",
    "Refused",
    "pow2",
    "reserve_spec",
    "stod",
    "stoi",
    "stoull",
]

MB = 1 << 20
SIZE_MAX = (1 << 64) - 1
INT_MIN, INT_MAX = -(1 << 31), (1 << 31) - 1
DELIMITERS = frozenset(",:[]")
INTERVALS = 16  # roundup_power2_divisions: 1 MiB ... 32 GiB and above
MAX_SPLIT_MB = SIZE_MAX // MB  # torch clamps sizes to this many MB

#: Aliases torch accepts for the same setting (ROCm spellings).
ALIASES = {
    "release_lock_on_hipmalloc": "release_lock_on_cudamalloc",
    "pinned_use_hip_host_register": "pinned_use_cuda_host_register",
}


class Refused(Exception):
    """torch refuses the string here; ``args[0]`` says why."""


# --------------------------------------------------------------------------- #
# The C library's number readers, as torch calls them
# --------------------------------------------------------------------------- #

# C's isspace() in the "C" locale torch runs in: \x1c-\x1f and \xa0, which Python calls
# whitespace, are not (torch refuses "True\x1f"); digits are ASCII only (stoull refuses
# full-width or Arabic-Indic digits, which Python's int() and \d take).
C_SPACE = " \t\n\v\f\r"
SPACES = "[" + re.escape(C_SPACE) + "]"  # the regex class of C_SPACE
INT_PREFIX = re.compile(SPACES + r"*([+-]?)([0-9]+)")
FLOAT_PREFIX = re.compile(
    SPACES + r"*([+-]?)("
    r"0[xX](?:[0-9a-fA-F]+\.?[0-9a-fA-F]*|\.[0-9a-fA-F]+)(?:[pP][+-]?[0-9]+)?"
    r"|(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
    r"|[iI][nN][fF](?:[iI][nN][iI][tT][yY])?"
    r"|[nN][aA][nN](?:\([0-9A-Za-z_]*\))?"
    r")"
)
SMALLEST_NORMAL = 2.2250738585072014e-308


def stoull(token: str) -> int:
    """``std::stoull``: a base-10 prefix, a minus sign wrapping around 2**64."""
    match = INT_PREFIX.match(token)
    if match is None:
        raise Refused(f"{token!r} is not a number (torch: stoull)")
    digits = match.group(2).lstrip("0") or "0"
    if len(digits) > 20:  # past 2**64 (and past what Python's int() converts at once)
        raise Refused(f"{token!r} is out of range (torch: stoull)")
    value = int(digits)
    if value > SIZE_MAX:
        raise Refused(f"{token!r} is out of range (torch: stoull)")
    return (-value) % (1 << 64) if match.group(1) == "-" else value


def stoi(token: str) -> int:
    """``std::stoi`` into a ``size_t``: a 32-bit int, negatives wrapping around 2**64."""
    match = INT_PREFIX.match(token)
    if match is None:
        raise Refused(f"{token!r} is not a number (torch: stoi)")
    digits = match.group(2).lstrip("0") or "0"
    if len(digits) > 11:
        raise Refused(f"{token!r} is out of range (torch: stoi)")
    value = int(digits) * (-1 if match.group(1) == "-" else 1)
    if not INT_MIN <= value <= INT_MAX:
        raise Refused(f"{token!r} is out of range (torch: stoi)")
    return value % (1 << 64)


def _exact(body: str) -> Fraction:
    """The exact value of a decimal or hexadecimal number in C's syntax (finite)."""
    lowered = body.lower()
    if not lowered.startswith("0x"):
        return Fraction(lowered)
    digits, _, exponent = lowered[2:].partition("p")
    whole, _, fraction = digits.partition(".")
    mantissa = int(whole + fraction or "0", 16)
    return Fraction(mantissa, 16 ** len(fraction)) * Fraction(2) ** int(exponent or "0")


def _range_error_near_zero(body: str, value: float) -> bool:
    """Whether ``strtod`` sets ERANGE for a result at or below the smallest normal double.

    The C library answers where one can be asked; else its rule: tininess judged
    after rounding, and an inexact result.
    """
    answer = strtod_range_error(body)
    if answer is not None:
        return answer
    return abs(value) < SMALLEST_NORMAL and _exact(body) != Fraction(abs(value))


def stod(token: str) -> float:
    """``std::stod``: the longest prefix that reads as a double; range errors refused.

    ``strtod`` sets ERANGE, and ``stod`` throws, for a result that overflows, that
    underflows to zero from non-zero digits, or that is tiny and inexact (a subnormal
    exactly representable, ``0x1p-1030``, is taken); Python's float() and
    float.fromhex() answer inf, 0 or the subnormal, or raise OverflowError.
    """
    match = FLOAT_PREFIX.match(token)
    if match is None:
        raise Refused(f"{token!r} is not a number (torch: stod)")
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
            raise Refused(f"{token!r} is out of range (torch: stod)") from None
        mantissa = lowered[2:].split("p")[0] if hexadecimal else lowered.split("e")[0]
        nonzero = re.search(r"[1-9a-f]" if hexadecimal else r"[1-9]", mantissa) is not None
        if math.isinf(value) or (value == 0.0 and nonzero):
            raise Refused(f"{token!r} is out of range (torch: stod)")
        if value != 0.0 and abs(value) <= SMALLEST_NORMAL and _range_error_near_zero(body, value):
            raise Refused(f"{token!r} is out of range (torch: stod)")
    return -value if match.group(1) == "-" else value


# What ``std::istringstream >> double`` reads whole in the classic locale: a decimal
# number (no hex, inf or nan, which libstdc++'s num_get does not take).
_STREAM_DOUBLE = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def reserve_spec(token: str) -> tuple[bool, float] | None:
    """torch 2.15's reading of an expandable-segment reserve: (is_fraction, value) or None.

    A trailing ``G``/``g`` makes the number GiB, else it is a fraction of the
    device; the number is read by ``std::istringstream`` in the classic locale and
    must be the whole token, finite and above zero. None is a value torch warns
    about and ignores, keeping its default.
    """
    gib = token.endswith(("G", "g"))
    number = token[:-1] if gib else token
    if not _STREAM_DOUBLE.fullmatch(number):
        return None
    value = float(number)  # an overflow is inf, an underflow 0: both ignored, as libstdc++
    if not math.isfinite(value) or value <= 0.0:
        return None
    return (not gib, value)


def pow2(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


# The expandable-segment reserves of 2.15: "expandable_segments_reserve:0.5" (a fraction
# of the device) or ":40G" (GiB), and "expandable_segments_reserve_by_class:[name:0.25,
# other:8G]". torch never refuses a bad value: it warns and keeps its default.
RESERVE_KEYS = ("expandable_segments_reserve", "expandable_segments_reserve_by_class")
# The host allocator's limits (2.13+): MB read with stoull, clamped as sizes are, kept
# from call to call; unlimited (SIZE_MAX bytes, None here) until a string sets them.
PINNED_MAX_KEYS = ("pinned_max_round_threshold_mb", "pinned_max_cached_size_mb")
