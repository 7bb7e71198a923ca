"""Device memory handed back: cache release and trainer-state offload.

``release``: :func:`hybridmem.release_cache` and its scope; ``offload``:
:class:`hybridmem.Offloader`. Imports nothing here, so that a module can be
reached (``hybridmem.memory.offload.OffloadReport``) without loading the others.
"""
