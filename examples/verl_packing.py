"""verl's Megatron packing, replaced by one import line: same outputs, fewer syncs.

Run: ``python examples/verl_packing.py`` (a GPU if there is one, else the CPU).
Where Megatron is installed, ``preprocess_packed_seqs`` / ``postprocess_packed_seqs``
read tensor- and context-parallel sizes from ``megatron.core.parallel_state`` exactly
as verl's do, and the keywords below can go; here they are given, since this example
runs without Megatron. With FP8 padding, tp 2: each sequence padded to a multiple of
16, the total to a multiple of 256. The lengths come from the host, so on a GPU the
round trip makes no device-to-host sync (checked with torch's sync debug mode).
"""

from __future__ import annotations

import torch

# from verl.models.mcore.util import preprocess_packed_seqs, postprocess_packed_seqs
from hybridmem.packing.verl import postprocess_packed_seqs, preprocess_packed_seqs


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        print("no CUDA GPU here: packing runs on the CPU; on a GPU it runs with no host sync")
    batch, seq_len, vocab = 3, 40, 11
    lengths = [40, 9, 23]
    mask = torch.zeros(batch, seq_len, dtype=torch.bool)
    for row, n in enumerate(lengths):
        mask[row, :n] = True  # right-padded responses, as verl's
    mask = mask.to(device)
    input_ids = torch.randint(1, vocab, (batch, seq_len), device=device)
    embedding = torch.randn(vocab, 8, device=device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any sync below raises
    packed, params = preprocess_packed_seqs(input_ids, mask, True, True, lengths=lengths, tp_size=2)
    output = embedding[packed]  # a "model" on the THD layout: [1, total, 8]
    logits = postprocess_packed_seqs(output, params, mask, batch, seq_len)
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("default")
    print(f"packed {tuple(input_ids.shape)} -> {tuple(packed.shape)} on {device}")
    print(f"cu_seqlens_q {params.cu_seqlens_q.tolist()} (verl's: the padded offsets)")
    print(f"max_seqlen_q {params.max_seqlen_q}")
    expected = torch.where(mask[:, :, None], embedding[input_ids], 0.0)
    torch.testing.assert_close(logits, expected)
    print("postprocessed output equals the padded computation, zeros where the mask is 0")


if __name__ == "__main__":
    main()
