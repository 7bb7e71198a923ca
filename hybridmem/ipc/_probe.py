"""The child program behind :func:`hybridmem.ipc_capabilities` (run by path, not imported).

``python _ipc_probe.py produce --device N [--cuda]`` starts a consumer child
(``consume``) at once, so both import torch in parallel, then plays the producer:
with ``--cuda`` it allocates one tensor in a classic segment and one in an
expandable segment and exports both the way ``torch.multiprocessing`` does, and
the expandable one again by fd passing (:func:`hybridmem.ipc_export`). The
consumer checks the two syscalls an expandable-segment import needs
(``pidfd_open`` + ``pidfd_getfd``, on itself and on the producer), then opens
the three exports and checks their bytes. The producer prints one JSON object.

Everything that can fail is caught and reported as text: the parent turns the
facts into :class:`hybridmem.ipc.capabilities.IpcCapabilities`. Run by path (``sys.path[0]`` is
the package folder), so the syscall-only probe never imports torch.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys
import threading
import time
from typing import IO, Any

# Run by path, sys.path[0] is this folder: leave it off the path, so that its
# modules (bucket, shareable...) never stand in for top-level modules that torch or
# others import. The parent put the folder that holds hybridmem/ on PYTHONPATH.
_HERE = os.path.dirname(os.path.abspath(__file__))
if not __package__ and sys.path and os.path.abspath(sys.path[0]) == _HERE:
    del sys.path[0]

from hybridmem._platform import linux as _linux  # noqa: E402

CLASSIC_VALUE = 7
EXPANDABLE_VALUE = 9
# Large enough for the large pool (> 1 MiB); expandable pages are 20 MiB there.
_NBYTES = 4 << 20
_HANDLE_NAMES = {1: "posix_fd", 8: "fabric"}


def _send(stream: IO[bytes], obj: object) -> None:
    data = pickle.dumps(obj)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _receive(stream: IO[bytes]) -> Any:
    header = stream.read(8)
    if len(header) < 8:
        raise EOFError("the producer closed the pipe")
    (size,) = struct.unpack("<Q", header)
    return pickle.loads(stream.read(size))  # our own parent process wrote it


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()


def _warm_up(device: int, facts: dict[str, Any], who: str) -> threading.Thread:
    """Create the device's CUDA context in a thread while this process imports torch.

    Importing torch takes seconds and creating a context hundreds of milliseconds;
    done one after the other they were most of ``hybridmem doctor``'s wall time.
    """

    def run() -> None:
        from hybridmem._platform import cuda_vmm

        try:  # the reference is never dropped: the context lives as torch's would
            cuda_vmm.initialize()
            cuda_vmm.primary_context(device)
        except (cuda_vmm.DriverError, KeyError) as exc:
            # torch then makes the context itself, later: only slower
            facts[f"{who}_context_error"] = _error(exc)
        _stamp(facts, f"{who}_context")

    thread = threading.Thread(target=run, name="hybridmem-probe-context", daemon=True)
    thread.start()
    return thread


def _stamp(facts: dict[str, Any], name: str) -> None:
    """Note when ``name`` was reached (wall clock: both processes share it)."""
    facts.setdefault("timings", {})[name] = time.time()


def _handle_type(ptr: int) -> str | None:
    from hybridmem._platform import cuda_driver

    flags = cuda_driver.pointer_attribute(ptr, cuda_driver.POINTER_ALLOWED_HANDLE_TYPES)
    if flags is None:
        return None
    names = [name for bit, name in _HANDLE_NAMES.items() if flags & bit]
    return "+".join(names) if names else "none"


def _export(
    device: int, facts: dict[str, Any], warm: threading.Thread | None = None
) -> dict[str, Any]:
    """Allocate one tensor of each segment kind on ``device``; export both."""
    exports: dict[str, Any] = {}
    try:
        import torch

        from hybridmem import _torch

        _stamp(facts, "producer_torch")
        if warm is not None:
            warm.join()

        if not _torch.cuda_available():
            facts["cuda_error"] = "no CUDA device is visible to the probe"
            return exports
        torch.cuda.set_device(device)
        tensors = {}
        # Expandable first, in a fresh cache: a classic segment made first would have
        # a free remainder that the second tensor reuses, whatever the setting says.
        for kind, value in (("expandable", EXPANDABLE_VALUE), ("classic", CLASSIC_VALUE)):
            _torch.set_allocator_settings(f"expandable_segments:{kind == 'expandable'}")
            _torch.empty_cache()
            tensors[kind] = torch.full((_NBYTES,), value, dtype=torch.uint8, device=device)
            facts[f"{kind}_legacy_ipc"] = _torch.is_legacy_ipc_capable(tensors[kind])
        torch.cuda.synchronize(device)
        if facts["expandable_legacy_ipc"] is not False:
            facts["expandable_export_error"] = (
                "the probe could not allocate in an expandable segment (is the backend "
                "cudaMallocAsync, or this torch without expandable segments?)"
            )
        facts["expandable_handle"] = _handle_type(tensors["expandable"].data_ptr())
        for kind, tensor in tensors.items():
            if f"{kind}_export_error" in facts:
                continue
            try:
                exports[kind] = _torch.export_cuda_tensor(tensor)
            except Exception as exc:  # torch refuses (too old, IPC handles off)
                facts[f"{kind}_export_error"] = _error(exc)
        if facts["expandable_legacy_ipc"] is False:
            # The same expandable tensor once more, its pages' fds passed over a
            # Unix socket (hm.ipc_export): needs no pidfd_getfd in the consumer.
            try:
                from hybridmem.ipc.export import ipc_export

                exports["fd_passing"] = ipc_export(tensors["expandable"], timeout=60.0)
            except Exception as exc:
                facts["fd_export_error"] = _error(exc)
        facts["keep"] = tensors  # alive until the consumer answered; dropped before printing
    except Exception as exc:
        facts["cuda_error"] = _error(exc)
    return exports


def produce(device: int, cuda: bool) -> tuple[dict[str, Any], subprocess.Popen[bytes]]:
    """Run the producer side; return the facts of both sides and the consumer process.

    The consumer answers and closes its output before it exits, so its facts are
    here while its CUDA context is still being torn down: the caller prints first
    and waits for it after.
    """
    args = [sys.executable, os.path.abspath(__file__), "consume", "--device", str(device)]
    if cuda:
        args.append("--cuda")
    consumer = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    if consumer.stdin is None or consumer.stdout is None:  # pragma: no cover - PIPE given
        raise RuntimeError("no pipe to the consumer")
    facts: dict[str, Any] = {"producer_pid": os.getpid()}
    _stamp(facts, "producer_start")
    warm = _warm_up(device, facts, "producer") if cuda else None
    exports = _export(device, facts, warm) if cuda else {}
    _stamp(facts, "exported")
    try:
        _send(consumer.stdin, {"pid": os.getpid(), "fd": consumer.stdin.fileno(), **exports})
        answer = json.loads(consumer.stdout.read().decode() or "{}")
    except (OSError, EOFError, ValueError) as exc:
        answer = {"consumer_error": _error(exc)}
    facts.pop("keep", None)
    timings = {**facts.get("timings", {}), **answer.pop("timings", {})}
    facts.update(answer)
    facts["timings"] = timings
    _stamp(facts, "answered")
    return facts, consumer


def consume(device: int, cuda: bool) -> dict[str, Any]:
    """Run the consumer side; return its facts."""
    facts: dict[str, Any] = {
        "seccomp": _linux.seccomp_mode(),
        "self_fetch_errno": _linux.errno_name(_linux.fetch_fd(os.getpid(), 0)),
    }
    _stamp(facts, "consumer_start")
    if cuda:
        warm = _warm_up(device, facts, "consumer")
        try:  # start importing while the producer allocates
            import torch

            from hybridmem import _torch

            _stamp(facts, "consumer_torch")
            warm.join()
            if _torch.cuda_available():  # the context too, while the producer allocates
                torch.cuda.set_device(device)
        except Exception as exc:
            facts["cuda_error"] = _error(exc)
            cuda = False
    request = _receive(sys.stdin.buffer)
    facts["producer_fetch_errno"] = _linux.errno_name(
        _linux.fetch_fd(int(request["pid"]), int(request["fd"]))
    )
    if cuda:
        for kind, value in (("classic", CLASSIC_VALUE), ("expandable", EXPANDABLE_VALUE)):
            if kind not in request:
                continue
            rebuild, args = request[kind]
            try:
                tensor = _torch.import_cuda_tensor(rebuild, args, device)
                facts[f"{kind}_ok"] = bool((tensor == value).all().item())
                del tensor
            except Exception as exc:
                facts[f"{kind}_ok"] = False
                facts[f"{kind}_import_error"] = _error(exc)
        if "fd_passing" in request:  # ("fd" is the pipe's fd number, for fetch_fd)
            try:
                tensor = request["fd_passing"].open(timeout=30.0)
                facts["fd_ok"] = bool((tensor == EXPANDABLE_VALUE).all().item())
                del tensor
            except Exception as exc:
                facts["fd_ok"] = False
                facts["fd_import_error"] = _error(exc)
    _stamp(facts, "consumer_done")
    return facts


def _answer(facts: dict[str, Any]) -> None:
    """Write the facts and close standard output: the reader needs no wait for the exit.

    A process that used CUDA takes a while to exit (its context is torn down);
    whoever reads this answer gets end-of-file now instead.
    """
    sys.stdout.write(json.dumps(facts))
    sys.stdout.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # the pipe's last write end closes
    os.close(devnull)


def main(argv: list[str]) -> int:
    role = argv[0]
    device = int(argv[argv.index("--device") + 1]) if "--device" in argv else 0
    cuda = "--cuda" in argv
    if role == "produce":
        facts, consumer = produce(device, cuda)
        _answer(facts)
        try:  # reaped, not left behind; its answer is already out
            consumer.wait(timeout=60)
        except subprocess.TimeoutExpired:
            consumer.kill()
    else:
        _answer(consume(device, cuda))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
