"""Small formatting helpers for reports and logs."""

from __future__ import annotations

__all__ = ["first_line", "fmt_bytes", "fmt_signed_bytes"]

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def fmt_bytes(n: int | None) -> str:
    """Format a byte count with a binary unit, e.g. ``fmt_bytes(3 << 30) == '3.00 GiB'``."""
    if n is None:
        return "n/a"
    value = float(abs(n))
    for unit in _UNITS:
        if value < 1024.0 or unit == _UNITS[-1]:
            text = f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
            return "-" + text if n < 0 else text
        value /= 1024.0
    raise AssertionError("unreachable")  # pragma: no cover


def fmt_signed_bytes(n: int) -> str:
    """Format a byte delta with an explicit sign, e.g. ``'+1.00 MiB'``."""
    return ("+" if n >= 0 else "") + fmt_bytes(n)


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, or its type name when it has none.

    torch's C++ errors carry a stack trace after the first line; a user needs the line.
    """
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
