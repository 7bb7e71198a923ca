"""The package version, and how a version string is read, on the ground floor.

The command line reads both without the face; the seam reads torch's version with
:func:`major_minor` too.
"""

from __future__ import annotations

import re

__all__ = ["__version__", "major_minor"]

__version__ = "0.2.0"


def major_minor(text: str) -> tuple[int, int] | None:
    """The ``(major, minor)`` a version string starts with (None: it starts with neither).

    Example:
        >>> major_minor("2.11.0+cu130"), major_minor("0.33.0"), major_minor("dev")
        ((2, 11), (0, 33), None)
    """
    match = re.match(r"(\d+)\.(\d+)", text)
    return None if match is None else (int(match.group(1)), int(match.group(2)))
