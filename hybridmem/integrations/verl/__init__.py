"""hybridmem as a drop-in for verl's colocated weight update, verl's code unchanged.

Its modules:

- :mod:`~hybridmem.integrations.verl.transfer`: ``BucketedWeightSender`` and
  ``BucketedWeightReceiver`` with verl 0.9.1's signatures and callback contract,
  through one persistent :class:`~hybridmem.WeightBucket` per ``zmq_handle``;
- :mod:`~hybridmem.integrations.verl.batches`: verl's batching rule, replayed;
- :mod:`~hybridmem.integrations.verl.link`: the two ends kept for a process's life;
- :mod:`~hybridmem.integrations.verl.allocator`: ``set_expandable_segments`` keeping
  the user's settings, and the colocated update restored on failure;
- :mod:`~hybridmem.integrations.verl.install`: ``install()``, which puts them in
  verl's place in this process (``HYBRIDMEM_VERL=1`` in processes vLLM starts),
  and :func:`hybridmem.integrations.sglang.update_weights` in its SGLang rollout's.

This package's ``__init__`` imports nothing: importing it imports neither verl nor
torch. SGLang's route is :mod:`hybridmem.integrations.sglang`. See docs/backends/verl.md.
"""
