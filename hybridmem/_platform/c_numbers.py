"""The C library's ``strtod``, asked directly: the reader torch's settings parser uses.

torch reads a fraction of an allocator setting with ``std::stod``, which throws where
``strtod`` sets ``ERANGE``. When glibc sets it for a number near the subnormal edge
follows from how it rounds (tininess judged after rounding, and an inexact result),
with quirks of its own (a rounding bit it drops when it shifts a subnormal): rather
than a model of that, the same function torch calls, in this process, answers.

Scope: process-global; thread-safe (``errno`` is per thread, and ctypes keeps its
copy per thread).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools

__all__ = ["strtod_range_error"]


@functools.cache
def _strtod() -> object | None:
    """libc's ``strtod`` with errno captured, or None where no C library loads."""
    for name in (None, ctypes.util.find_library("c")):
        try:
            library = ctypes.CDLL(name, use_errno=True)
            function = library.strtod
        except (OSError, AttributeError, TypeError):
            continue
        function.restype = ctypes.c_double
        function.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p)]
        return function
    return None


def strtod_range_error(text: str) -> bool | None:
    """Whether the C library's ``strtod`` sets ``ERANGE`` for ``text`` (a whole number).

    Args:
        text: an ASCII number in C's syntax (decimal or hexadecimal).

    Returns:
        True or False as ``strtod`` answers; None where no C library can be asked
        (the caller then decides by its own rule).

    Example:
        >>> strtod_range_error("0x1p-1030"), strtod_range_error("1e-320")  # doctest: +SKIP
        (False, True)
    """
    function = _strtod()
    if function is None:
        return None
    ctypes.set_errno(0)
    function(text.encode("ascii"), None)  # type: ignore[operator]
    return ctypes.get_errno() == errno.ERANGE
