"""What happened to memory: one reading type, the timeline, the leak watch, the plot.

``memory``: :func:`hybridmem.memory_info` and :class:`~hybridmem.observe.memory.MemoryInfo`,
the reading every report reuses; ``timeline``: spans and events, saved as JSONL and
Chrome traces; ``leakwatch``: growth per cycle; ``plot``: pictures of a timeline.
"""
