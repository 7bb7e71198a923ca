"""The hybrid engine: backend profiles with their engine adapters, phases, the switch.

``backends``: the registry of profiles (which primitives each phase runs for vLLM,
SGLang, or a plugin's engine) and the adapters; ``phases``: :func:`hybridmem.phase`;
``switch``: :class:`hybridmem.HybridSwitch`.
"""
