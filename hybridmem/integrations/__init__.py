"""Backends that plug hybridmem into engines' own APIs (each imports its engine lazily).

``import hybridmem`` never imports this package; each integration imports its engine
only in the modules the engine itself loads (``hybridmem.integrations.vllm.backend``).
"""
