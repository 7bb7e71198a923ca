"""Helper processes for the benchmarks, spoken to a line at a time, every wait bounded.

Why: the benchmark scripts start an engine's stand-in (a process that takes device
memory and frees it on command) and wait for its answers. A bare
``stdout.readline()`` waits forever on a stand-in that hangs, and two scripts had
written the same stand-in twice (``benchmarks/reload_rate.py``,
``benchmarks/reload_by_kernel.py``). :class:`LinePeer` waits for each answer with a
deadline and notices a stand-in that exited, and :class:`MemoryPeer` is the one
stand-in. :func:`run_child` runs a process to its end while reading both of its
pipes (a child that fills the pipe not being read blocks forever, and its parent
with it) and kills one that prints nothing for too long: ``hybridmem bench`` runs
each strategy so. Multiprocessing pipes have :class:`hybridmem.bench.engine.BoundedConn`.
"""

from __future__ import annotations

import contextlib
import os
import select
import selectors
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "CHILD_SILENCE_S",
    "MEMORY_PEER_CODE",
    "PEER_TIMEOUT_S",
    "ChildOutput",
    "LinePeer",
    "MemoryPeer",
    "PeerError",
    "run_child",
]

#: The longest a benchmark waits for one answer of a helper process (seconds): a
#: 60 GiB allocation and fill takes well under a second on an H200.
PEER_TIMEOUT_S = 120.0

#: How long :func:`run_child` lets a child print nothing before it kills it (seconds):
#: a bench strategy prints a progress line every cycle, seconds apart even at 64 GiB,
#: and its own waits on its engine end after 600 s (``ENGINE_TIMEOUT_S``).
CHILD_SILENCE_S = 900.0

_SLICE_S = 0.1  # how often a wait checks that the process is still alive

#: The engine's stand-in: ``hold N`` takes and writes N bytes of device memory, ``free``
#: drops them and empties the cache, ``take N`` does both; each is answered ``done``.
MEMORY_PEER_CODE = """
import sys, torch
torch.zeros(1, device="cuda")
print("ready", flush=True)
held = None
for line in sys.stdin:
    word, *rest = line.split()
    if word in ("hold", "take"):
        held = torch.empty(int(rest[0]), dtype=torch.uint8, device="cuda")
        held.fill_(1)
        torch.cuda.synchronize()
    if word in ("free", "take"):
        held = None
        torch.cuda.empty_cache()
    print("done", flush=True)
"""


class PeerError(RuntimeError):
    """A helper process did not answer in time, exited, or answered something else."""


class LinePeer:
    """A Python process run from ``code``, told lines on stdin, answering lines on stdout.

    Args:
        code: the program (``python -c``); it prints ``ready`` once it can take lines.
        what: the process, for errors ("the engine's stand-in").
        timeout_s: the longest any one answer is waited for.

    Example:
        >>> peer = LinePeer('print("ready", flush=True)\\nimport sys\\n'
        ...                 'for l in sys.stdin: print(l.strip(), flush=True)')
        >>> peer.ask("hello", expect="hello")
        >>> peer.close()
        0

    Scope: one process; not thread-safe. Raises :class:`PeerError` naming the process
    and what was awaited when an answer does not come within ``timeout_s``, when the
    process exits, or when it answers otherwise.
    """

    def __init__(
        self, code: str, *, what: str = "helper process", timeout_s: float = PEER_TIMEOUT_S
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r}: expected a number of seconds > 0")
        self.what = what
        self.timeout_s = float(timeout_s)
        self._buffer = b""
        self.process = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        try:
            self.expect("ready")
        except BaseException:  # not left running behind the error
            self.process.kill()
            self.process.wait()
            raise

    def send(self, line: str) -> None:
        """Write ``line`` to the process; its answer is read by :meth:`expect`."""
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(line.encode() + b"\n")
            self.process.stdin.flush()
        except BrokenPipeError as exc:
            raise PeerError(
                f"the {self.what} (pid {self.process.pid}) exited (code "
                f"{self.process.poll()}) before it was told {line!r}"
            ) from exc

    def answer(self) -> str:
        """The next line the process prints, within ``timeout_s``."""
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        deadline = time.monotonic() + self.timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerError(
                    f"the {self.what} (pid {self.process.pid}) printed no answer for "
                    f"{self.timeout_s:g} s: it is stuck (or needs more than "
                    f"timeout_s={self.timeout_s:g})"
                )
            readable, _, _ = select.select([fd], [], [], min(left, _SLICE_S))
            if not readable:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:  # end of file: it exited
                code = self.process.wait(timeout=self.timeout_s)
                raise PeerError(f"the {self.what} (pid {self.process.pid}) exited (code {code})")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode().strip()

    def expect(self, word: str) -> None:
        """Wait for the next answer and check that it is ``word``."""
        got = self.answer()
        if got != word:
            raise PeerError(f"the {self.what} answered {got!r}, not {word!r}")

    def ask(self, line: str, expect: str = "done") -> None:
        """:meth:`send` ``line``, then :meth:`expect` ``expect``."""
        self.send(line)
        self.expect(expect)

    def close(self) -> int:
        """Close its stdin (its loop ends) and wait for it to exit; return its exit code.

        A process still running after ``timeout_s`` is killed, and that is an error.
        """
        if self.process.stdin is not None and not self.process.stdin.closed:
            with contextlib.suppress(BrokenPipeError):  # it had exited already
                self.process.stdin.close()
        try:
            code = self.process.wait(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise PeerError(
                f"the {self.what} (pid {self.process.pid}) did not exit within "
                f"{self.timeout_s:g} s of its input closing: killed"
            ) from None
        if self.process.stdout is not None:
            self.process.stdout.close()
        return code


class MemoryPeer(LinePeer):
    """The engine's stand-in on the same GPU: it holds device memory and frees it on command.

    Example:
        >>> peer = MemoryPeer()               # doctest: +SKIP
        >>> peer.hold(60 << 30)               # doctest: +SKIP
        >>> peer.send("free"); ...; peer.expect("done")   # doctest: +SKIP

    Scope: one process on the current CUDA device (it inherits
    ``CUDA_VISIBLE_DEVICES``); needs a GPU.
    """

    def __init__(self, *, timeout_s: float = PEER_TIMEOUT_S) -> None:
        super().__init__(MEMORY_PEER_CODE, what="engine's stand-in", timeout_s=timeout_s)

    def hold(self, nbytes: int) -> None:
        """Take ``nbytes`` of device memory and write them; returns once it has."""
        self.ask(f"hold {int(nbytes)}")

    def free(self) -> None:
        """Drop what it holds and empty its cache; returns once it has."""
        self.ask("free")

    def take(self, nbytes: int) -> None:
        """:meth:`hold` then :meth:`free`, in one round trip."""
        self.ask(f"take {int(nbytes)}")


@dataclass(frozen=True)
class ChildOutput:
    """What :func:`run_child` saw of a child process.

    Attributes:
        returncode: its exit code; None where it was killed for its silence.
        stdout: all it printed on stdout.
        silent_s: where it was killed, the seconds it had printed nothing; else None.
    """

    returncode: int | None
    stdout: str
    silent_s: float | None = None


def run_child(
    command: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    on_line: Callable[[str], None] | None = None,
    silence_s: float = CHILD_SILENCE_S,
) -> ChildOutput:
    """Run ``command`` to its end, reading stdout and stderr as they come; kill it if silent.

    Both pipes are read at once, so a child that prints more than a pipe holds on
    one while its parent reads the other cannot block them both (a ``for line in
    process.stderr`` loop followed by ``communicate()`` does, past 64 KiB of stdout).

    Args:
        command: the program and its arguments.
        env: its environment (None: this process's).
        on_line: called with each line of its stderr, without the newline, as it comes.
        silence_s: seconds without a byte on either pipe after which it is killed.

    Returns:
        Its exit code and stdout, or, if it was killed, ``silent_s`` set.

    Example:
        >>> run_child([sys.executable, "-c", "print(42)"]).stdout
        '42\\n'

    Scope: the calling thread waits; nothing process-global changes.
    """
    if not silence_s > 0:
        raise ValueError(f"silence_s={silence_s!r}: expected a number of seconds > 0")
    process = subprocess.Popen(
        list(command),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(env) if env is not None else None,
    )
    assert process.stdout is not None
    assert process.stderr is not None
    out = bytearray()
    pending = b""  # stderr after its last newline
    last = time.monotonic()
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        selector.register(process.stderr, selectors.EVENT_READ)
        while selector.get_map():
            silent = time.monotonic() - last
            if silent >= silence_s:
                process.kill()
                process.wait()
                return ChildOutput(None, out.decode(errors="replace"), silent)
            for key, _ in selector.select(timeout=min(silence_s - silent, 1.0)):
                chunk = os.read(key.fd, 65536)
                if not chunk:  # end of file
                    selector.unregister(key.fileobj)
                    continue
                last = time.monotonic()
                if key.fileobj is process.stdout:
                    out += chunk
                    continue
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if on_line is not None:
                        on_line(line.decode(errors="replace"))
    if pending and on_line is not None:
        on_line(pending.decode(errors="replace"))
    process.stdout.close()
    process.stderr.close()
    try:  # both pipes closed: it is exiting
        code = process.wait(timeout=silence_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return ChildOutput(None, out.decode(errors="replace"), silence_s)
    return ChildOutput(code, out.decode(errors="replace"))
