"""The trainer's state off the device and back: offload, reload, compaction.

``offload``: :class:`hybridmem.Offloader` (with its pinned ``host_pool``, the
``reload_feed`` and the report); ``compact`` and ``one_segment``: resident tensors
packed out of the allocator's rounding; ``targets``: what modules, optimizers and
tensors hold on the device. Cache release is the card's
(:mod:`hybridmem.scopes.release`). Imports nothing here, so that a module can be
reached (``hybridmem.memory.offload.OffloadReport``) without loading the others.
"""
