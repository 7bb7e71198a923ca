"""The card's wing: the scopes a sharding manager stacks, and what they stand on.

Read in this order: ``allocator`` (:func:`hybridmem.expandable_segments`,
:func:`hybridmem.allocator_settings`, :func:`hybridmem.set_allocator_defaults`),
``release`` (:func:`hybridmem.release_cache`, :func:`hybridmem.aggressive_cache_release`)
and ``garbage`` (when a release collects Python's garbage), ``ipc_safe``
(:func:`hybridmem.ipc_safe`), then the phases: ``profiles`` (what a backend profile is),
``recipes`` (the built-in ones), ``engines`` (duck-typed engine adapters), ``registry``
(:func:`hybridmem.register_backend`, :func:`hybridmem.get_backend`,
:func:`hybridmem.list_backends`) and ``phases`` (:func:`hybridmem.phase`).

The wing stands on the allocator model (:mod:`hybridmem.allocator`), the memory reading
(:mod:`hybridmem.observe.memory`), the torch seam and the scope base; it imports nothing
of offload, weight transfer, the switch, the bench or the CLI (a test says so). This
face imports nothing, so a module is reached by its path without loading the others.
"""
