"""vLLM's weight-transfer engine classes for the ``hybridmem`` backend (imports vLLM).

Worker side: :class:`HybridmemWeightTransferEngine`, created by vLLM in each worker
when the engine runs with ``weight_transfer_config={"backend": "hybridmem"}``.
Trainer side: :class:`HybridmemTrainerWeightTransferEngine`, made by vLLM's
``WeightTransferTrainerFactory.trainer_init(HybridmemTrainerInitInfo(rank=...),
client=..., source=...)``. Both are registered by
:func:`hybridmem.integrations.vllm.plugin.register`, which vLLM calls in every
process through its ``vllm.general_plugins`` entry point; nothing else is needed.

The data moves through :mod:`hybridmem.integrations.vllm.link`. The worker applies
a sync only once all of it arrived and fits the model's checkpoint (names and
shapes), through vLLM's layerwise reload (initialise, ``load_weights``, finalise) in
one step, so a failed sync never leaves a half-reloaded model, and weights take
effect on every backend (the CPU backend keeps a prepacked copy that a bare
``load_weights`` would not refresh).

Checked against vLLM 0.32.0 (run on CPU, in CI) and 0.33.0 (its wheel's sources read:
the same factories, engine classes, reload and client calls; its ``WeightSource``
yields through ``iter_full()``, which :func:`full_tensors` follows).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from hybridmem._log import logger
from hybridmem.integrations.vllm import BACKEND_NAME
from hybridmem.integrations.vllm.engine import EngineLink
from hybridmem.integrations.vllm.link import DEFAULT_TIMEOUT_S, UNTOUCHED, Weights
from hybridmem.integrations.vllm.schema import checkpoint_schema
from hybridmem.integrations.vllm.sleep_state import refuse_while_asleep
from hybridmem.integrations.vllm.trainer import TrainerLink
from hybridmem.ipc.bucket import SyncReport

__all__ = [
    "HybridmemInitInfo",
    "HybridmemTrainerInitInfo",
    "HybridmemTrainerWeightTransferEngine",
    "HybridmemUpdateInfo",
    "HybridmemWeightTransferEngine",
    "LLMClient",
]


@dataclass
class HybridmemInitInfo(WeightTransferInitInfo):
    """What the worker gets at ``init_weight_transfer_engine``: the trainer's link."""

    address: str
    token: str
    timeout: float
    protocol: int
    transport: str
    keep_staging: bool = False


@dataclass
class HybridmemUpdateInfo(WeightTransferUpdateInfo):
    """What the worker gets at each ``update_weights``: which sync comes over the link."""

    sync: int
    tensors: int
    weight_version: str | None = None
    link: str | None = None  # the trainer link it comes over (a replaced one's is refused)


@dataclass
class HybridmemTrainerInitInfo(TrainerInitInfo):
    """Trainer-side options (``rank`` is vLLM's: rank 0 sends, the others iterate).

    Attributes:
        bucket_bytes: bytes per bucket buffer (256 MiB).
        buffers: bucket buffers (2).
        transport: ``"auto"``, ``"cuda"``, ``"fd"`` (expandable segments, no
            ``pidfd_getfd`` needed) or ``"host"`` (an engine without CUDA).
        fallback: ``"auto"``, ``"host"`` or ``"raise"`` (as ``WeightBucket``).
        timeout: the longest wait for the engine, per message and per call (s).
        keep_staging: the worker keeps each sync's staging copy cached (faster; one
            model's worth of device memory stays reserved in the worker, out of
            reach of vLLM's KV cache). Default False: given back once applied.
    """

    backend: ClassVar[str] = BACKEND_NAME
    bucket_bytes: int = 256 << 20
    buffers: int = 2
    transport: str = "auto"
    fallback: str = "auto"
    timeout: float = DEFAULT_TIMEOUT_S
    keep_staging: bool = False


class LLMClient:
    """vLLM's trainer-side client protocol over an in-process ``vllm.LLM`` (or a Ray actor's).

    vLLM ships clients for its HTTP server and for Ray actors; an ``LLM`` in the
    trainer's own process takes its requests wrapped (``{"init_info": ...}``). This
    forwards the four calls of ``VLLMWeightSyncClient``.

    Example:
        >>> engine = WeightTransferTrainerFactory.trainer_init(   # doctest: +SKIP
        ...     HybridmemTrainerInitInfo(rank=0), client=LLMClient(llm), source=ModuleSource(model))
    """

    def __init__(self, llm: Any) -> None:
        missing = [
            m
            for m in ("init_weight_transfer_engine", "update_weights", "finish_weight_update")
            if not callable(getattr(llm, m, None))
        ]
        if missing:
            raise TypeError(
                f"LLMClient needs a vllm.LLM (0.32 or later); {type(llm).__name__} lacks "
                f"{', '.join(missing)}"
            )
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version=weight_version)


def model_schema(model_dir: str, hf_config: Any) -> dict[str, tuple[int, ...]] | None:
    """The checkpoint's names and shapes, plus ``lm_head.weight`` where it is tied.

    A tied ``lm_head`` is absent from the checkpoint but in every trainer's state
    dict; vLLM's models skip it on load, so it is accepted with the embedding's shape.
    """
    schema = checkpoint_schema(model_dir)
    if schema is None or not getattr(hf_config, "tie_word_embeddings", False):
        return schema
    embeddings = [k for k in schema if k.endswith("embed_tokens.weight")]
    if "lm_head.weight" not in schema and len(embeddings) == 1:
        schema["lm_head.weight"] = schema[embeddings[0]]
    return schema


def full_tensors(source: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The source's full tensors, as vLLM's ``WeightSource`` yields them in 0.32 and 0.33.

    vLLM 0.32 iterates the source itself; 0.33 asks ``iter_full()`` (full tensors,
    gathered where sharded) of a source that ``implements_iter_full()``, and has no
    ``__iter__``.

    Raises:
        TypeError: a source with neither (the message names its type).
    """
    iter_full = getattr(source, "iter_full", None)
    implements = getattr(source, "implements_iter_full", None)
    if callable(iter_full) and (not callable(implements) or implements()):
        return iter(iter_full())
    if hasattr(source, "__iter__"):
        return iter(source)
    raise TypeError(
        f"the hybridmem backend sends full tensors: {type(source).__name__} has neither "
        "iter_full() (vLLM 0.33) nor __iter__ (vLLM 0.32)"
    )


class HybridmemWeightTransferEngine(WeightTransferEngine[HybridmemInitInfo, HybridmemUpdateInfo]):
    """The worker's side: receives whole syncs from a trainer's WeightBucket."""

    init_info_cls = HybridmemInitInfo
    update_info_cls = HybridmemUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        world = int(getattr(self.parallel_config, "world_size", 1))
        if world != 1:
            raise ValueError(
                f"the hybridmem weight-transfer backend serves one worker per engine; this "
                f"engine has {world} (tensor x pipeline parallel). Use vLLM's 'ipc' or "
                "'nccl' backend for sharded engines"
            )
        self.link: EngineLink | None = None
        self.weight_version: str | None = None

    def init_transfer_engine(self, init_info: HybridmemInitInfo) -> None:
        """Connect to the trainer's link (closing an earlier one)."""
        if self.link is not None:
            self.link.close()
        schema = model_schema(str(self.model_config.model), self.model_config.hf_config)
        self.link = EngineLink(vars(init_info), self.device, schema)

    def start_weight_update(self) -> None:
        """Check the link and that the weights are awake: the reload runs once the sync is here.

        Raises:
            EngineAsleepError: the engine's weights sleep in vLLM's pool (an update
                into them would touch unmapped memory); nothing was received.
        """
        refuse_while_asleep("weights", "a weight update")
        if self.link is None or self.link.closed:
            raise RuntimeError(
                "no live hybridmem link: call init_weight_transfer_engine first (the "
                f"trainer's trainer_init does); {UNTOUCHED}"
            )

    def receive_weights(self, update_info: HybridmemUpdateInfo) -> None:
        """Receive one sync whole, check it, then reload it in one step.

        Raises:
            EngineAsleepError: the engine's weights sleep in vLLM's pool; nothing was
                received (the trainer's send times out or is aborted; the model's
                weights are as they were).
        """
        refuse_while_asleep("weights", "a weight update")
        if self.link is None:
            raise RuntimeError("no hybridmem link: call init_weight_transfer_engine first")
        self.link.update(self._reload, update_info.sync, update_info.link)
        self.weight_version = update_info.weight_version
        logger.info(
            "vLLM worker: sync %d applied (%d tensors, version %s)",
            update_info.sync,
            update_info.tensors,
            update_info.weight_version,
        )

    def _reload(self, weights: Weights) -> None:
        # Layerwise reload makes the weights take effect on every backend (the CPU
        # one repacks them) and keeps the kernels' storage (CUDA graphs stay valid).
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        model: Any = self.model  # vLLM's models add load_weights to nn.Module
        finalize: Any = finalize_layerwise_reload  # untyped in vLLM 0.32
        initialize_layerwise_reload(model)
        try:
            with disable_mtp_completeness_check():
                model.load_weights(weights)
        except BaseException as exc:
            finalize(model, self.model_config)
            raise RuntimeError(
                f"vLLM's load_weights failed after the sync was checked ({exc}); layers "
                "loaded before the failure hold the new weights, the rest the old ones"
            ) from exc
        finalize(model, self.model_config)

    def finish_weight_update(self) -> None:
        """Nothing left to do: the sync was reloaded whole in ``update_weights``."""

    def shutdown(self) -> None:
        """Let go of the trainer's buffers and the connection."""
        if self.link is not None:
            self.link.close()
            self.link = None


class HybridmemTrainerWeightTransferEngine(TrainerWeightTransferEngine[HybridmemTrainerInitInfo]):
    """The trainer's side: one persistent WeightBucket, exported once, reused every sync."""

    init_info_cls = HybridmemTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None,
        is_sender: bool,
        link: TrainerLink | None,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.link = link
        self.last_report: SyncReport | None = None

    @classmethod
    def trainer_init(
        cls,
        init_info: HybridmemTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> HybridmemTrainerWeightTransferEngine:
        """Allocate the bucket (sender only) and connect the engine's worker to it."""
        if source is None:
            raise ValueError(
                "the hybridmem backend sends a full state each round: pass source= (vLLM's "
                "ModuleSource(model), or any WeightSource)"
            )
        link = None
        if init_info.is_sender:
            device = torch.cuda.current_device() if torch.cuda.is_available() else None
            link = TrainerLink(
                init_info.bucket_bytes,
                device,
                buffers=init_info.buffers,
                transport=init_info.transport,  # type: ignore[arg-type]
                fallback=init_info.fallback,  # type: ignore[arg-type]
                timeout=init_info.timeout,
                keep_staging=init_info.keep_staging,
            )
            try:
                link.connect(client.init_weight_transfer_engine)
            except BaseException:
                link.close()
                raise
        return cls(client=client, source=source, is_sender=init_info.is_sender, link=link)

    def send_weights(self, weight_version: str | None = None) -> None:
        """Send the source's tensors: start, update (over the bucket), finish.

        Every rank iterates the source (gathers are collectives); rank 0 sends.
        Every tensor, name and shape is checked (against the engine's checkpoint
        too) before vLLM is told anything: a refusal raises before
        ``start_weight_update``, so the worker has no update left open.
        """
        assert self.source is not None
        items = [(name, tensor.detach().contiguous()) for name, tensor in full_tensors(self.source)]
        if not self.is_sender or self.link is None:
            return
        self.last_report = self.link.sync(
            items,
            self.client.update_weights,
            weight_version=weight_version,
            start=self.client.start_weight_update,  # after the checks, as vLLM needs
        )
        self.client.finish_weight_update(weight_version=weight_version)
        logger.info("vLLM trainer: %s", self.last_report)

    def shutdown(self) -> None:
        """Free the bucket and close the link."""
        if self.link is not None:
            self.link.close()
            self.link = None
