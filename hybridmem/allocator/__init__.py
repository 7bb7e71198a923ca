"""The CUDA caching allocator's settings, as torch reads them, merged and applied whole.

From the bottom up: ``cparse`` (C's number readers) and ``parsers`` (torch's two
settings parsers, replayed), ``rules`` (what each torch version knows, refuses and
resets), ``grammar`` (the keys hybridmem knows, each value turned into torch's
syntax), ``effective`` (a merged view: env, process defaults, active scopes;
``AllocatorState``) and ``state`` (the process-global engine that applies a view
whole). ``import_check`` says, before torch is imported, whether its env would
abort ``import torch``. The scopes users write (``expandable_segments``,
``allocator_settings``, ``set_allocator_defaults``) stand on this in
:mod:`hybridmem.scopes.allocator`.

Nothing here imports torch but ``state`` (through the seam): reaching ``rules`` or
``import_check`` is safe before torch is imported. Scope: process-global.
"""
