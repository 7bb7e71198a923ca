"""CUDA IPC that works where containers deny ``pidfd_getfd``, and weight buckets.

``shareable``: a tensor made shareable after the fact (:func:`hybridmem.ipc_shareable`;
the scope is the card's, :func:`hybridmem.ipc_safe`);
``capabilities`` (with its child program ``_probe`` started by ``_launch``): what
this machine allows; ``bucket`` / ``receiver``: the weight-sync producer and
consumer, over the wire format ``_wire`` and the batch plan ``_plan``. This face
imports nothing: ``hybridmem doctor`` starts the probe before torch loads.
"""
