"""Which transport a bucket or an ``ipc_safe`` scope uses: decided once, here.

The registry of transports by name (a fourth is one module plus one entry in
:data:`TRANSPORTS`), and :func:`choose_transport`, the one function that turns what
was asked (``transport=``, ``fallback=``) and what this machine allows into a
transport object.
"""

from __future__ import annotations

from hybridmem import _torch
from hybridmem._errors import IpcUnavailableError
from hybridmem._log import warn_once
from hybridmem.ipc.transports.base import Fallback, Probe, Transport
from hybridmem.ipc.transports.cuda import CudaTransport
from hybridmem.ipc.transports.fd import FdTransport
from hybridmem.ipc.transports.host import HostTransport

__all__ = ["AUTO", "TRANSPORTS", "choose_transport", "transport_named"]

#: Every transport by the name its handle carries. A fourth: its module, and a line here.
TRANSPORTS: dict[str, type[Transport]] = {
    CudaTransport.name: CudaTransport,
    FdTransport.name: FdTransport,
    HostTransport.name: HostTransport,
}
#: What ``"auto"`` asks for: CUDA IPC of classic segments, host memory where blocked.
AUTO = CudaTransport.name


def transport_named(name: object) -> Transport:
    """A fresh transport of the name a handle carries.

    Raises:
        ValueError: no transport has that name (the peers run different hybridmem).
    """
    kind = TRANSPORTS.get(name) if isinstance(name, str) else None
    if kind is None:
        raise ValueError(
            f"unknown transport {name!r} (known: {', '.join(TRANSPORTS)}): run the same "
            "hybridmem version on both sides"
        )
    return kind()


def choose_transport(
    requested: str,
    fallback: Fallback,
    device: int,
    *,
    who: str,
    probe: Probe = "off",
    host_without_cuda: bool = False,
) -> Transport:
    """The transport to use for ``device``, given what was asked and what works here.

    The one place the choice is made. ``fallback="host"`` is host memory.
    Otherwise the transport asked (``"auto"``: ``"cuda"``) is taken unless it says what
    blocks it here; then ``fallback="raise"`` raises, and ``"auto"`` warns once and
    tries the transport it falls back to (``fd`` -> ``cuda`` -> ``host``).

    Args:
        requested: ``"auto"`` or a name in :data:`TRANSPORTS` (checked by the caller).
        fallback: ``"auto"``, ``"host"`` or ``"raise"``.
        device: the CUDA device index.
        who: the caller as the user wrote it (``"WeightBucket"``), for messages.
        probe: how CUDA IPC's health is judged (see :data:`~.base.Probe`).
        host_without_cuda: where no CUDA device is visible at all, take host memory
            without a warning (a bucket between CPU processes uses it by design).

    Returns:
        The transport object, which its user asks from then on.

    Raises:
        IpcUnavailableError: the transport asked cannot be used and ``fallback="raise"``.

    Example:
        >>> choose_transport("auto", "host", 0, who="WeightBucket").name
        'host'
    """
    if fallback == "host":
        return HostTransport()
    kind = TRANSPORTS[AUTO if requested == "auto" else requested]
    while True:
        blocker = kind.blocker(device, probe)
        if blocker is None:
            return kind()
        if fallback == "raise" or kind.falls_back_to is None:
            raise IpcUnavailableError(kind.refused(who, device, blocker))
        # Without any GPU, host memory is what a bucket is for: no warning then.
        expected = host_without_cuda and kind.falls_back_to == "host"
        if not (expected and not _torch.cuda_available()):
            warn_once(f"{kind.name}-blocked:{blocker}", kind.passed_over(who, device, blocker))
        kind = TRANSPORTS[kind.falls_back_to]
