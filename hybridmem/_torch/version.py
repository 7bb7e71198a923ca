"""torch's version, read once."""

from __future__ import annotations

import re

import torch


def _parse_version(text: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", text)
    if match is None:  # pragma: no cover - torch always has a numeric version
        return (0, 0)
    return (int(match.group(1)), int(match.group(2)))


_TORCH_VERSION = _parse_version(torch.__version__)


def torch_version() -> tuple[int, int]:
    """Return torch's ``(major, minor)`` version, e.g. ``(2, 11)``."""
    return _TORCH_VERSION


def torch_version_string() -> str:
    """Return ``torch.__version__`` as a plain string, e.g. ``"2.11.0+cu130"``."""
    return str(torch.__version__)
