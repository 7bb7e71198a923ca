"""Paths the user names, checked before work starts: one clear error, never a traceback.

An output path is checked where it is given (a directory that cannot be made, a
file that cannot be written), not after a long run or at process exit; an input
file is checked for being what it should be (a timeline, saved bench results).
Torch-free, so that the command line can check paths before anything heavy loads.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["TIMELINE_ENV", "FileProblem", "check_writable", "describe", "timeline_env_problem"]

TIMELINE_ENV = "HYBRIDMEM_TIMELINE"


class FileProblem(ValueError):
    """A path cannot be used as asked; the message names it, the reason and the fix."""


def describe(exc: OSError) -> str:
    """``[Errno 13] Permission denied`` as ``permission denied``."""
    return (exc.strerror or str(exc)).lower()


def check_writable(path: str | os.PathLike[str], what: str) -> Path:
    """Make sure ``path`` can be written (its folder is made if missing); return it.

    Nothing is written to ``path`` itself: where it does not exist yet, a probe
    file next to it is created and removed; where it exists, its permission is
    checked.

    Raises:
        FileProblem: the folder cannot be made, ``path`` is a folder, or the
            folder or file is not writable.
    """
    target = Path(path)
    if target.is_dir():
        raise FileProblem(f"{what} {str(target)!r} is a folder; give a file name")
    folder = target.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FileProblem(
            f"{what} {str(target)!r}: cannot make its folder {str(folder)!r} ({describe(exc)})"
        ) from None
    if target.exists():
        if not os.access(target, os.W_OK):
            raise FileProblem(f"{what} {str(target)!r} exists and is not writable")
        return target
    probe = folder / f".{target.name}.hybridmem-probe-{os.getpid()}"
    try:
        probe.touch()
    except OSError as exc:
        raise FileProblem(
            f"{what} {str(target)!r}: cannot write in {str(folder)!r} ({describe(exc)})"
        ) from None
    probe.unlink(missing_ok=True)
    return target


def timeline_env_problem(raw: str | None = None) -> str | None:
    """What is wrong with ``HYBRIDMEM_TIMELINE`` (or ``raw``) as a place to write, or None."""
    value = os.environ.get(TIMELINE_ENV) if raw is None else raw
    if not value:
        return None
    base = Path(value)
    stem = base.name.removesuffix(".jsonl").removesuffix(".json")
    try:
        check_writable(base.with_name(f"{stem}.jsonl"), f"{TIMELINE_ENV}={value!r}: the timeline")
    except FileProblem as exc:
        return f"{exc}; fix or unset {TIMELINE_ENV}"
    return None
