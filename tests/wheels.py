"""Where the tests find the frameworks' wheels they read as data (verl's, SGLang's, TRL's).

A framework's own code judges hybridmem's drop-in for it: the tests read it from the
framework's wheel, never installing it. The wheel is found, in order, at the path an
environment variable names (``HYBRIDMEM_VERL_WHEEL``, ``HYBRIDMEM_SGLANG_WHEEL``,
``HYBRIDMEM_TRL_WHEEL``) or in
``tests/wheels/`` of the checkout, where one command from the checkout's root puts them
(:func:`fetch_line`; ``tests/wheels/`` is ignored by git):

    pip download --no-deps --only-binary=:all: verl==0.9.1 sglang==0.5.23 trl==1.16.0 \
        -d tests/wheels

``HYBRIDMEM_REQUIRE_VERL=1`` / ``_SGLANG=1`` / ``_TRL=1`` (CI sets them) turn a
missing wheel into a failure instead of a skip.
"""

from __future__ import annotations

import importlib.util
import os
import zipfile
from pathlib import Path

__all__ = [
    "FOLDER",
    "PINNED",
    "fetch_line",
    "find_wheel",
    "missing_reason",
    "read_source",
    "required",
]

FOLDER = Path(__file__).resolve().parent / "wheels"
#: The releases whose code the oracles are written against.
PINNED = {"verl": "0.9.1", "sglang": "0.5.23", "trl": "1.16.0"}


def _variable(name: str) -> str:
    return f"HYBRIDMEM_{name.upper()}_WHEEL"


def find_wheel(name: str) -> Path | None:
    """The wheel of ``name`` at its pinned release: the variable's path, else tests/wheels/."""
    named = os.environ.get(_variable(name))
    if named:
        return Path(named)
    found = sorted(FOLDER.glob(f"{name}-{PINNED[name]}-*.whl"))
    return found[-1] if found else None


def read_source(name: str, member: str) -> tuple[str, str] | None:
    """(the text of ``member``, where it came from) in ``name``'s code, or None.

    From the wheel :func:`find_wheel` finds (a ``.py`` the variable names is that file),
    else from an installed ``name`` (``member``'s path under its package's parent).
    """
    found = find_wheel(name)
    if found is not None:
        if found.suffix == ".whl":
            with zipfile.ZipFile(found) as wheel:
                return wheel.read(member).decode(), f"{found}:{member}"
        return found.read_text(), str(found)
    spec = importlib.util.find_spec(name)
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))).parent / member
        if path.is_file():
            return path.read_text(), str(path)
    return None


def fetch_line(*names: str) -> str:
    """The command, run from the checkout's root, that puts the wheels where they are found."""
    wanted = " ".join(f"{n}=={PINNED[n]}" for n in names or tuple(PINNED))
    return f"pip download --no-deps --only-binary=:all: {wanted} -d tests/wheels"


def missing_reason(name: str) -> str:
    """Why a test of ``name``'s own code cannot run, and the line that fixes it."""
    return (
        f"{name} {PINNED[name]}'s wheel is not here ({_variable(name)} is unset and "
        f"tests/wheels/ has no {name}-{PINNED[name]}-*.whl): from the checkout's root run "
        f"`{fetch_line(name)}`, then the tests again"
    )


def required(name: str) -> bool:
    """Whether a missing wheel fails the run (CI) rather than skipping its tests."""
    return os.environ.get(f"HYBRIDMEM_REQUIRE_{name.upper()}") == "1"
