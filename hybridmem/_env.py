"""Environment switches read by hybridmem (``HYBRIDMEM_*``)."""

from __future__ import annotations

import os

from hybridmem._log import warn_once

__all__ = ["DISABLE_ENV", "disabled", "parse_flag"]

DISABLE_ENV = "HYBRIDMEM_DISABLE"

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


def parse_flag(name: str, value: str) -> bool:
    """Read a boolean environment flag; an unrecognised value warns once and is False."""
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered not in _FALSE:
        warn_once(
            f"flag:{name}={value}",
            f"{name}={value!r} is not a recognised value; use 1/true/yes/on to switch it on "
            "or 0/false/no/off to switch it off. Treating it as off.",
        )
    return False


# ``os.environ.get`` encodes the key and decodes the value on every call (about a
# microsecond), and the kill switch is read on every scope entry. CPython keeps
# the encoded mapping in ``os.environ._data``; reading it directly is exact (it is
# what ``os.environ`` itself reads) and ten times cheaper. Fallback: the public API.
_DATA: dict[object, object] | None = getattr(os.environ, "_data", None)
try:
    _DISABLE_KEY: object = os.environ.encodekey(DISABLE_ENV)
except AttributeError:  # pragma: no cover - not CPython's os.environ
    _DATA = None
    _DISABLE_KEY = DISABLE_ENV
_last_raw: object = None
_last_value = False


def disabled() -> bool:
    """Return whether the kill switch ``HYBRIDMEM_DISABLE`` is on.

    Read at every entry of a primitive, so tests and launchers can flip it at run
    time. With it on, every primitive still decorates and enters, but changes
    nothing.
    """
    global _last_raw, _last_value
    raw = _DATA.get(_DISABLE_KEY) if _DATA is not None else os.environ.get(DISABLE_ENV)
    if raw is None:
        return False
    if raw != _last_raw:
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        _last_value = parse_flag(DISABLE_ENV, text)
        _last_raw = raw
    return _last_value
