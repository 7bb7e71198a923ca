"""Argument checks shared by the public functions: one wording, one place.

Every check raises ``TypeError`` for a value of the wrong type and ``ValueError``
for a value out of range, naming the argument, the allowed values and the value.
"""

from __future__ import annotations

import inspect
import math
import threading

__all__ = [
    "MAX_DEVICE_BYTES",
    "check_bool",
    "check_number",
    "check_seconds",
    "is_bare_decoration",
    "refuse_bare_decoration",
]

#: The most device memory one argument may ask for: far above any device today (141 GB
#: on an H200), low enough that a size never overflows a C integer on its way to torch.
MAX_DEVICE_BYTES = 1 << 40


def check_bool(name: str, value: object) -> bool:
    """Return ``value`` if it is a bool, else raise a ``TypeError`` naming ``name``.

    ``1``, ``"True"`` and ``None`` are refused on purpose: a flag that controls
    process-global state should say exactly what it means.

    Example:
        >>> check_bool("sync", True)
        True
    """
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return value


def check_number(
    name: str,
    value: object,
    *,
    integer: bool = False,
    minimum: float | None = None,
    above: float | None = None,
    maximum: float | None = None,
    wrong_type: type[Exception] = TypeError,
    expected: str | None = None,
) -> float:
    """Return ``value`` if it is a number (an int with ``integer``) within bounds.

    ``True`` and ``False`` are refused: they are ints to Python, never a size or a
    time to a user. NaN is refused too: it compares false with every bound.

    Args:
        name: the argument, as the user wrote it.
        value: what they passed.
        integer: only ints.
        minimum, maximum: inclusive bounds; above: an exclusive lower bound.
        wrong_type: what a value of the wrong type raises (``ValueError`` where an
            argument has always answered so).
        expected: the allowed values in words (``"an int >= 3"``); every error
            then says ``{name} must be {expected}``.

    Returns:
        ``value`` unchanged (typed ``float``; ints stay ints at run time).

    Raises:
        TypeError: (or ``wrong_type``) not a number, or not an int with ``integer``.
        ValueError: out of bounds.

    Example:
        >>> check_number("buffers", 2, integer=True, minimum=1, maximum=8)
        2
    """
    kind = expected or ("an int" if integer else "a number")
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise wrong_type(f"{name} must be {kind}, got {value!r} ({type(value).__name__})")
    if isinstance(value, float) and math.isnan(value):
        raise ValueError(f"{name} must be {kind}, got nan")
    if expected is not None:
        low = (minimum is not None and value < minimum) or (above is not None and value <= above)
        if low or (maximum is not None and value > maximum):
            raise ValueError(f"{name} must be {expected}, got {value!r}")
        return value
    if minimum is not None and maximum is not None:
        if not minimum <= value <= maximum:
            raise ValueError(f"{name} must be between {minimum:g} and {maximum:g}, got {value}")
    elif minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum:g}, got {value}")
    elif maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum:g}, got {value}")
    if above is not None and not value > above:
        raise ValueError(f"{name} must be > {above:g}, got {value}")
    return value


def check_seconds(name: str, value: object, *, zero: bool = False) -> float:
    """Return ``value`` as a timeout in seconds: finite, > 0 (>= 0 with ``zero``).

    The upper bound is the longest wait the standard library can make
    (``threading.TIMEOUT_MAX``), so a timeout never overflows where it is used.

    Raises:
        TypeError: not a number.
        ValueError: NaN, infinite, negative (or zero without ``zero``), or too long.

    Example:
        >>> check_seconds("timeout", 30)
        30.0
    """
    expected = f"a number of seconds {'>= 0' if zero else '> 0'}"
    if zero:
        check_number(name, value, minimum=0, expected=expected)
    else:
        check_number(name, value, above=0, expected=expected)
    if value > threading.TIMEOUT_MAX:  # type: ignore[operator]
        raise ValueError(
            f"{name} must be at most {threading.TIMEOUT_MAX:.0f} seconds (the longest wait "
            f"Python can make), got {value!r}"
        )
    return float(value)  # type: ignore[arg-type]


def is_bare_decoration(value: object) -> bool:
    """True for what a bare ``@decorator`` passes as its first argument.

    That is a function, a method object or a class: what ``@hm.ipc_safe`` (no
    parentheses) hands to ``ipc_safe``.

    Example:
        >>> is_bare_decoration(len), is_bare_decoration("rollout")
        (True, False)
    """
    return inspect.isroutine(value) or isinstance(value, (type, staticmethod, classmethod))


def refuse_bare_decoration(who: str, value: object, write: str) -> None:
    """Raise a ``TypeError`` saying how to write ``@who`` if it was used bare.

    Args:
        who: the primitive (``"expandable_segments"``).
        value: its first argument.
        write: the decorator as it must be written (``"@hm.expandable_segments(False)"``).

    Example:
        >>> refuse_bare_decoration("phase", "rollout", '@hm.phase("rollout")')
    """
    if is_bare_decoration(value):
        name = getattr(value, "__qualname__", None) or repr(value)
        raise TypeError(
            f"@hm.{who} needs an argument: it was given {name!r} to decorate, without its "
            f"parentheses. Write {write}"
        )
