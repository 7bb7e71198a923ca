"""How a WeightBucket's buffers cross the process boundary: one module per transport.

``base`` is the interface (what blocks a transport here, allocation and export, the
consumer's open, the buffers and their teardown); ``cuda`` (CUDA IPC of classic
segments), ``fd`` (expandable segments, their pages' fds passed over a Unix socket)
and ``host`` (POSIX shared memory) implement it; ``choice`` holds the registry and the
one function that chooses (``auto``, ``fallback``). A fourth transport is one module
plus one entry in ``choice.TRANSPORTS``.
"""
