"""Start the CUDA IPC probe's child program without importing torch.

``hybridmem doctor`` starts the probe first thing, so that its two interpreters
import torch while the doctor's own process does (each import takes seconds);
:func:`hybridmem.ipc_capabilities` then adopts the running probe instead of
starting another. Everything here is standard library only.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["ProbeRun", "discard_pending", "driver_present", "start_early", "take"]

PROBE = Path(__file__).with_name("_probe.py")
TIMEOUT_S = 120.0

_pending: dict[int, ProbeRun] = {}
_lock = threading.Lock()


def driver_present() -> bool:
    """Whether an NVIDIA driver is loaded here (a cheap hint; torch has the last word)."""
    return any(Path(p).exists() for p in ("/dev/nvidiactl", "/proc/driver/nvidia/version"))


class ProbeRun:
    """One run of the probe program (producer and its consumer) on ``device``.

    Args:
        device: the device index to probe, in the caller's numbering.
        cuda: probe CUDA IPC (the children import torch); False checks only the
            pidfd syscalls (no torch, a fraction of a second).
    """

    def __init__(self, device: int, cuda: bool) -> None:
        self.device = device
        self.cuda = cuda
        self.started = time.perf_counter()
        package_parent = str(PROBE.parents[2])  # the folder that holds hybridmem/
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
        command = [sys.executable, str(PROBE), "produce", "--device", str(device)]
        if cuda:
            command.append("--cuda")
        self._error: str | None = None
        self._process: subprocess.Popen[str] | None = None
        self._out: list[str] = []
        self._err: list[str] = []
        self._readers: list[threading.Thread] = []
        try:
            self._process = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
            )
        except OSError as exc:
            self._error = f"could not start the IPC probe: {exc}"
            return
        # The probe writes its facts and closes its output before its CUDA contexts
        # are torn down: reading to end-of-file, not waiting for the exit, saves that.
        for stream, sink in ((self._process.stdout, self._out), (self._process.stderr, self._err)):
            reader = threading.Thread(
                target=_drain, args=(stream, sink), name="hybridmem-probe-reader", daemon=True
            )
            reader.start()
            self._readers.append(reader)

    def facts(self) -> dict[str, Any]:
        """Wait for the probe; return its facts (an error fact when it failed).

        ``elapsed_s`` is the time since the probe started, not since this call.
        """
        facts = self._wait()
        facts["elapsed_s"] = time.perf_counter() - self.started
        return facts

    def _remaining(self) -> float:
        return max(1.0, TIMEOUT_S - (time.perf_counter() - self.started))

    def _wait(self) -> dict[str, Any]:
        process = self._process
        if process is None:
            return {"cuda_error": self._error or "the IPC probe did not start"}
        out_reader = self._readers[0]
        out_reader.join(self._remaining())
        if out_reader.is_alive():
            self.discard()
            return {"cuda_error": f"the IPC probe did not finish within {TIMEOUT_S:.0f} s"}
        out = "".join(self._out)
        try:
            facts = json.loads(out)
        except ValueError:
            facts = None
        if isinstance(facts, dict):
            # The probe is still exiting (tearing its contexts down): reaped off the path.
            threading.Thread(
                target=process.wait, name="hybridmem-probe-reaper", daemon=True
            ).start()
            return facts
        try:  # it failed: its exit status and last words say why
            process.wait(timeout=self._remaining())
        except subprocess.TimeoutExpired:
            self.discard()
        self._readers[1].join(5.0)
        tail = ("".join(self._err) or out).strip().splitlines()[-3:]
        if facts is not None:
            return {"cuda_error": "the IPC probe said nothing"}
        return {
            "cuda_error": f"the IPC probe failed (exit {process.returncode}): {' | '.join(tail)}"
        }

    def discard(self) -> None:
        """Stop the probe if it still runs (its consumer exits when the pipe closes)."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        for reader in self._readers:
            reader.join(5.0)


def _drain(stream: Any, sink: list[str]) -> None:
    """Read ``stream`` to its end into ``sink`` (a reader thread)."""
    if stream is None:
        return
    with contextlib.suppress(OSError, ValueError):  # closed under us by a kill
        sink.append(stream.read())


def start_early(device: int, cuda: bool | None = None) -> ProbeRun:
    """Start a probe now, for :func:`take` to hand to ``ipc_capabilities`` later.

    Args:
        device: the device index the later ``ipc_capabilities`` call will ask for.
        cuda: None guesses from the driver's presence (:func:`driver_present`).
    """
    run = ProbeRun(device, driver_present() if cuda is None else cuda)
    with _lock:
        previous = _pending.pop(device, None)
        _pending[device] = run
    if previous is not None:
        previous.discard()
    return run


def take(device: int, cuda: bool) -> ProbeRun | None:
    """The early probe for ``device``, if one was started that answers for ``cuda``."""
    with _lock:
        run = _pending.pop(device, None)
    if run is None:
        return None
    if cuda and not run.cuda:  # started without CUDA, but torch sees a GPU: probe again
        run.discard()
        return None
    return run


def discard_pending() -> None:
    """Stop every early probe nobody took."""
    with _lock:
        runs = list(_pending.values())
        _pending.clear()
    for run in runs:
        run.discard()
