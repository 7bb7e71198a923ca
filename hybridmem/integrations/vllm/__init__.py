"""hybridmem as a vLLM weight-transfer backend: ``weight_transfer_config={"backend": "hybridmem"}``.

Its modules:

- :mod:`~hybridmem.integrations.vllm.link` (the protocol and what both ends share),
  :mod:`~hybridmem.integrations.vllm.trainer` (``TrainerLink``) and
  :mod:`~hybridmem.integrations.vllm.engine` (``EngineLink``): the two ends over a
  :class:`~hybridmem.WeightBucket`, with no vLLM import: what the backend does,
  testable and measurable where vLLM cannot run;
- :mod:`~hybridmem.integrations.vllm.schema`: the names and shapes a model takes
  (its checkpoint's safetensors headers) and the check of a sync against them;
- :mod:`~hybridmem.integrations.vllm.backend`: vLLM's two engine classes (worker and
  trainer side) over the endpoints; imports vLLM;
- :mod:`~hybridmem.integrations.vllm.plugin`: ``register()``, the entry point in
  vLLM's ``vllm.general_plugins`` group, which vLLM calls in every process it starts.

This package's ``__init__`` imports nothing, so importing it never imports vLLM.
See docs/backends/vllm.md.
"""

BACKEND_NAME = "hybridmem"

__all__ = ["BACKEND_NAME"]
