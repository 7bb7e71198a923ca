"""The vLLM backend's link over a WeightBucket, without importing vLLM: what both ends share.

vLLM drives a weight update through its control plane, one blocking call at a time
(``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
``finish_weight_update``); the data goes another way. Here it goes through one
:class:`~hybridmem.WeightBucket`, allocated and exported once:

1. :class:`~hybridmem.integrations.vllm.trainer.TrainerLink` allocates the bucket
   and listens on a fresh abstract Unix socket; its ``init_info()`` (address,
   one-time token, timeout) is JSON-native, so it rides vLLM's in-process, HTTP
   and Ray clients alike (:func:`parse_init_info` checks it).
2. :class:`~hybridmem.integrations.vllm.engine.EngineLink` (in vLLM's worker, from
   ``init_weight_transfer_engine``)
   connects, proves the token, opens the bucket and answers with the names and
   shapes its model takes (its checkpoint's safetensors headers: see
   :mod:`~hybridmem.integrations.vllm.schema`). The trainer then checks every sync
   against them before sending a byte.
3. Each sync is a marker (``("sync", n)``: what a failed sync left unread is
   skipped up to it), then the bucket's own protocol over that connection, while vLLM's
   ``update_weights`` call waits in the worker. The worker holds every tensor of
   the sync and checks them before anything is loaded: a trainer that dies, times
   out or sends a wrong name or shape leaves the model untouched, serving its
   previous weights.

Transports are the bucket's (``"cuda"``, ``"fd"``, ``"host"``, chosen as
:class:`~hybridmem.WeightBucket` chooses). Host buffers' names are unlinked as soon
as the engine opened them, and the engine lets go of the buffers when the trainer
exits (a watcher on its pid), so nothing outlives the two processes.

Scope: one trainer link serves one engine worker (tensor and pipeline parallel size
1); each link's methods are called from one thread at a time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hybridmem._checks import check_seconds

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "INIT_KEYS",
    "PREFIX",
    "PROTOCOL",
    "TOKEN_BYTES",
    "Weights",
    "bounded_timeout",
    "parse_init_info",
]

#: The link's message protocol (on top of the bucket's own).
PROTOCOL = 1
#: How long either side waits for the other, per message and per control call (s).
DEFAULT_TIMEOUT_S = 120.0
#: Every link's socket name starts with this, after the abstract namespace's NUL.
PREFIX = b"hybridmem-vllm-"
#: The one-time token's length, in bytes.
TOKEN_BYTES = 16
#: The keys of a trainer's ``init_info``.
INIT_KEYS = frozenset({"address", "token", "timeout", "protocol", "transport", "keep_staging"})

#: One sync, as the worker applies it.
Weights = list[tuple[str, torch.Tensor]]


#: What a refused or failed sync leaves of the model, said in each such error: its
#: weights as they were, which after vLLM's level-2 sleep and wake is no data at all.
UNTOUCHED = (
    "the model's weights are as they were before this sync (after a level-2 sleep and "
    "wake they hold no data: sync in full before generating)"
)


def bounded_timeout(timeout: object) -> float:
    """Validate a link's ``timeout=``: seconds > 0; None is refused (no unbounded wait)."""
    return check_seconds("timeout", timeout)


def parse_init_info(info: Mapping[str, Any]) -> tuple[bytes, bytes, float, bool]:
    """Validate a trainer's ``init_info``; return (address, token, timeout, keep_staging).

    Raises:
        ValueError: a missing, unknown or malformed key (named), or another protocol.
    """
    if not isinstance(info, Mapping):
        raise ValueError(f"init_info must be a dict, got {type(info).__name__}")
    missing = sorted(INIT_KEYS - set(info))
    unknown = sorted(set(info) - INIT_KEYS)
    if missing or unknown:
        raise ValueError(
            f"init_info for the hybridmem backend: missing {missing}, unknown {unknown}; "
            "pass TrainerLink.init_info() unchanged (the trainer side builds it)"
        )
    if info["protocol"] != PROTOCOL:
        raise ValueError(
            f"the trainer speaks link protocol {info['protocol']!r}, this engine {PROTOCOL}: "
            "install the same hybridmem version on both sides"
        )
    try:
        address = b"\0" + str(info["address"]).encode()
        token = bytes.fromhex(str(info["token"]))
    except ValueError as exc:
        raise ValueError(f"init_info has a malformed token: {exc}") from None
    if not address.startswith(b"\0" + PREFIX) or len(token) != TOKEN_BYTES:
        raise ValueError(f"init_info's address {info['address']!r} or token is not the trainer's")
    if not isinstance(info["keep_staging"], bool):
        raise ValueError(f"init_info's keep_staging must be a bool, got {info['keep_staging']!r}")
    return address, token, bounded_timeout(info["timeout"]), info["keep_staging"]
