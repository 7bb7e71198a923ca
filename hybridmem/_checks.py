"""Argument checks shared by the public functions: one wording, one place.

Every check raises ``TypeError`` for a value of the wrong type and ``ValueError``
for a value out of range, naming the argument, the allowed values and the value.
"""

from __future__ import annotations

__all__ = ["check_bool", "check_number"]


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
    time to a user.

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
