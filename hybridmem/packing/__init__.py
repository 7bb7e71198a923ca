"""Sequence packing (the THD layout) without device-to-host syncs.

- :func:`pack` / :func:`unpack`: a padded batch to one sequence of valid tokens and
  back; :func:`plan` plans without moving data; :func:`fp8_alignment` gives verl's
  FP8 padding. See ``hybridmem.packing.core``.
- ``hybridmem.packing.verl``: verl's ``preprocess_packed_seqs`` /
  ``postprocess_packed_seqs``, same arguments, same outputs, bit for bit.

Example:
    >>> from hybridmem.packing import pack, unpack              # doctest: +SKIP
    >>> packed = pack(input_ids, attention_mask, lengths=lengths, align=tp)  # doctest: +SKIP
"""

from hybridmem.packing._layout import fp8_alignment
from hybridmem.packing.core import CuSeqlens, PackedBatch, PackPlan, pack, plan, unpack

__all__ = ["CuSeqlens", "PackPlan", "PackedBatch", "fp8_alignment", "pack", "plan", "unpack"]
