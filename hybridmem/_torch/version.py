"""torch's version, read once."""

from __future__ import annotations

import torch

from hybridmem._version import major_minor


def _parse_version(text: str) -> tuple[int, int]:
    # torch always has a numeric version; (0, 0) keeps every version check false
    return major_minor(text) or (0, 0)


_TORCH_VERSION = _parse_version(torch.__version__)


def torch_version() -> tuple[int, int]:
    """Return torch's ``(major, minor)`` version, e.g. ``(2, 11)``."""
    return _TORCH_VERSION


def torch_version_string() -> str:
    """Return ``torch.__version__`` as a plain string, e.g. ``"2.11.0+cu130"``."""
    return str(torch.__version__)
