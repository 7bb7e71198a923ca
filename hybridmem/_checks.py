"""Argument checks shared by the public functions."""

from __future__ import annotations

__all__ = ["check_bool"]


def check_bool(name: str, value: object) -> bool:
    """Return ``value`` if it is a bool, else raise a ``TypeError`` naming ``name``.

    ``1``, ``"True"`` and ``None`` are refused on purpose: a flag that controls
    process-global state should say exactly what it means.
    """
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return value
