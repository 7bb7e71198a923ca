"""Helpers for tests that run Python in a fresh interpreter."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _package_under_test() -> Path:
    spec = importlib.util.find_spec("hybridmem")
    if spec is None or spec.origin is None:
        raise ImportError("hybridmem is not importable: install it (pip install -e .)")
    return Path(spec.origin).resolve().parent


#: The hybridmem these tests import: the checkout's, or the installed wheel's in CI
#: (which runs the tests from a copy without ``hybridmem/``). Tests that read the
#: package's source read this one, so they judge what ships.
PACKAGE = _package_under_test()


def shown(path: Path) -> str:
    """``path`` as a test names it: from the repository, or from the package's parent.

    The package under test may be an installed wheel outside the checkout.
    """
    for root in (REPO, PACKAGE.parent):
        if path.is_relative_to(root):
            return path.relative_to(root).as_posix()
    return path.as_posix()


def clean_env(**env: str) -> dict[str, str]:
    """This process's environment without allocator or hybridmem settings, plus ``env``.

    ``PYTORCH_*`` and ``HYBRIDMEM_*`` variables are dropped (each test states its
    own), and the repository is put first on ``PYTHONPATH``.
    """
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PYTORCH_", "HYBRIDMEM_"))}
    # The repository first; what was on the path stays (wheels carried to a GPU host).
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    clean["PYTHONPATH"] = os.pathsep.join([str(REPO), *kept])
    clean.update(env)
    return clean


def run_python(
    *args: str,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGS`` from the repository root without the caller's allocator env (see
    :func:`clean_env`), with ``env`` on top and ``input`` on its stdin."""
    clean = clean_env(**(env or {}))
    return subprocess.run(
        [sys.executable, *args],
        input=input,
        capture_output=True,
        text=True,
        cwd=REPO,
        env=clean,
        timeout=timeout,
        check=False,
    )


class LoopTicker:
    """Count event-loop turns while entered: awaited work that blocked the loop leaves 0.

    >>> async with LoopTicker() as ticker:   # doctest: +SKIP
    ...     await something()
    >>> assert ticker.ticks > 0   # doctest: +SKIP
    """

    def __init__(self) -> None:
        self.ticks = 0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            self.ticks += 1
            await asyncio.sleep(0)

    async def __aenter__(self) -> LoopTicker:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()


def open_fds() -> dict[int, str]:
    """This process's open file descriptors, each with what it refers to (Linux ``/proc``).

    A socket or pidfd reads as ``socket:[inode]`` / ``anon_inode:[pidfd]``, so a
    descriptor number closed and reused for something else reads as a new entry.
    """
    fds: dict[int, str] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except FileNotFoundError:  # closed meanwhile (listdir's own descriptor)
            continue
    return fds


def fds_opened_since(before: dict[int, str]) -> dict[int, str]:
    """The descriptors open now that were not open, to the same file, in ``before``.

    Descriptors closed meanwhile are not a leak and are not counted: other threads of
    this process (an earlier test's watcher ending, the garbage collector finalising a
    socket) close their own at any moment, so comparing counts fails by timing.
    """
    return {fd: target for fd, target in open_fds().items() if before.get(fd) != target}


def shared_mappings() -> Counter[str]:
    """This process's mappings of shared memory, by file (``/dev/shm`` is machine-wide)."""
    with open("/proc/self/maps") as maps:
        return Counter(line.split(maxsplit=5)[-1].strip() for line in maps if "/dev/shm/" in line)


def mappings_added_since(before: Counter[str]) -> Counter[str]:
    """Shared-memory mappings made since ``before`` and still held (unmapped ones aside)."""
    return shared_mappings() - before


def answer_then_wait(conn: Any) -> None:
    """A stand-in engine process: says ``"up"``, then waits on its pipe until it closes.

    The target of a ``spawn`` child in tests (importable by name, as spawn needs).
    """
    conn.send("up")
    try:
        conn.recv()
    except EOFError:
        return


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a test's process group)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
