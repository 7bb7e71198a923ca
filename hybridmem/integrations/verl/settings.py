"""The verl drop-in's settings, read from the environment of the process that uses them.

Each is read when a link is made or a sync starts, so a value set before verl builds
its sender (or its worker) is the one used; a bad value raises ``ValueError`` naming
the variable, the value and the allowed ones.

- ``HYBRIDMEM_VERL_TIMEOUT``: the bound on every wait of either end (:func:`timeout_s`).
- ``HYBRIDMEM_VERL_TRANSPORT``: how the bucket crosses (:func:`transport`).
- ``HYBRIDMEM_VERL_BUFFERS``: how many buffers a bucket rotates (:func:`buffers`).
- ``HYBRIDMEM_VERL_KEEP_BUCKET``: whether the bucket stays between syncs (:func:`keep_bucket`).

Scope: process-wide (the environment); no state of its own.
"""

from __future__ import annotations

import os

from hybridmem.ipc.bucket_options import MAX_BUFFERS

__all__ = [
    "DEFAULT_BUFFERS",
    "DEFAULT_KEPT_BUFFERS",
    "DEFAULT_TIMEOUT_S",
    "TIMEOUT_ENV",
    "buffers",
    "keep_bucket",
    "timeout_s",
    "transport",
]

#: How long either end waits for the other, per message and for the first connection.
DEFAULT_TIMEOUT_S = 120.0
TIMEOUT_ENV = "HYBRIDMEM_VERL_TIMEOUT"
_TRANSPORT_ENV = "HYBRIDMEM_VERL_TRANSPORT"
_BUFFERS_ENV = "HYBRIDMEM_VERL_BUFFERS"
_KEEP_ENV = "HYBRIDMEM_VERL_KEEP_BUCKET"
#: How many buffers a sync's bucket rotates unless told otherwise: the count that
#: measured fastest on an H100 for a bucket made and freed each sync (a third buffer
#: costs more to allocate and open than it saves at 1-8 GiB, and saves nothing at 15).
DEFAULT_BUFFERS = 2
#: The same for a bucket kept between syncs: a third lets the trainer fill one while
#: the engine reads another and the answer for a third is on its way.
DEFAULT_KEPT_BUFFERS = 3


def timeout_s() -> float:
    """The links' bound on every wait: ``HYBRIDMEM_VERL_TIMEOUT`` seconds, else 120."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r}: a number of seconds > 0 is needed") from None
    if not value > 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r}: a number of seconds > 0 is needed")
    return value


def transport() -> str:
    """The bucket's transport, from ``HYBRIDMEM_VERL_TRANSPORT``: auto, cuda, fd or host."""
    raw = os.environ.get(_TRANSPORT_ENV, "").strip() or "auto"
    if raw not in ("auto", "cuda", "fd", "host"):
        raise ValueError(
            f"{_TRANSPORT_ENV}={raw!r}: one of 'auto', 'cuda', 'fd' (no pidfd_getfd in the "
            "vLLM worker needed, expandable segments kept) or 'host'"
        )
    return raw


def buffers(keep: bool = False) -> int:
    """How many buffers a sender's bucket rotates: ``HYBRIDMEM_VERL_BUFFERS``, else the default.

    Each is verl's bucket size, on the trainer's device during a sync (and between
    syncs too with :func:`keep_bucket`); verl's own sender holds one. A bucket made for
    one sync has no more buffers than the sync has batches.

    Args:
        keep: whether the bucket is kept between syncs (default
            :data:`DEFAULT_KEPT_BUFFERS`, else :data:`DEFAULT_BUFFERS`).

    Example:
        >>> import os
        >>> os.environ.pop("HYBRIDMEM_VERL_BUFFERS", None) and None
        >>> buffers(), buffers(keep=True)
        (2, 3)
    """
    default = DEFAULT_KEPT_BUFFERS if keep else DEFAULT_BUFFERS
    raw = os.environ.get(_BUFFERS_ENV, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_BUFFERS:
        raise ValueError(
            f"{_BUFFERS_ENV}={raw!r}: a whole number from 1 to {MAX_BUFFERS} is needed "
            f"(default {DEFAULT_BUFFERS}, {DEFAULT_KEPT_BUFFERS} with a kept bucket; each "
            "buffer is one verl bucket on the trainer's device)"
        )
    return int(raw)


def keep_bucket() -> bool:
    """Whether the bucket stays between syncs: ``HYBRIDMEM_VERL_KEEP_BUCKET`` (default no).

    Unset, ``0`` or ``false``: each sync makes its bucket and frees it, and the worker
    closes its mappings, so nothing of the drop-in stays on either device after
    ``update_weights`` (as with verl's own pair). ``1`` or ``true``: the bucket is
    made and opened once and kept for the process's life (until
    :func:`~hybridmem.integrations.verl.link.close_links`): no allocation, export or
    open per sync, while ``buffers()`` x verl's bucket size stays on every trainer GPU
    through the rollout, mapped by the worker, where the rollout's KV cache was sized
    without it.

    Raises:
        ValueError: another value (the message names the allowed ones).

    Example:
        >>> import os
        >>> os.environ.pop("HYBRIDMEM_VERL_KEEP_BUCKET", None) and None
        >>> keep_bucket()
        False
    """
    raw = os.environ.get(_KEEP_ENV, "").strip().lower()
    if raw in ("", "0", "false", "no"):
        return False
    if raw in ("1", "true", "yes"):
        return True
    raise ValueError(
        f"{_KEEP_ENV}={os.environ.get(_KEEP_ENV)!r}: '1' keeps the bucket between syncs "
        "(faster, held on the device through the rollout), '0' or unset frees it after "
        "each sync, as verl's own pair does"
    )
