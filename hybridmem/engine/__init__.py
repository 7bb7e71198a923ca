"""The hybrid engine's switch: :class:`hybridmem.HybridSwitch` and what it stands on.

``switch`` (its stages as data in ``switch_stages``; offload, reload, settling, ranks
and recovery each in a module of its own), ``switch_phase`` (how the switch runs a
phase's recipe), ``ranks`` and ``reports``; ``memory_saver`` (what the doctor knows of
torch_memory_saver). The phases, profiles and registry it uses are the card's
(:mod:`hybridmem.scopes`).
"""
