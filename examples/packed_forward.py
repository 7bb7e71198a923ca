"""Pack a padded batch into the THD layout, run a toy "model" on it, unpack the output.

Run: ``python examples/packed_forward.py`` (a GPU if there is one, else the CPU).
The lengths come from the host, as a trainer has them from its data loader, so on a
GPU the whole round trip makes no device-to-host sync; the script checks that with
torch's sync debug mode.
"""

from __future__ import annotations

import torch

from hybridmem.packing import pack, unpack


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        print("no CUDA GPU here: packing runs on the CPU; on a GPU it runs with no host sync")
    batch, seq_len, hidden = 4, 32, 16
    lengths = [32, 7, 0, 19]  # one full row, one empty row
    # left padding, as some rollout engines return it: any mask works
    mask = torch.zeros(batch, seq_len, dtype=torch.bool)
    for row, n in enumerate(lengths):
        mask[row, seq_len - n :] = True
    mask = mask.to(device)
    hidden_states = torch.randn(batch, seq_len, hidden, device=device)
    weight = torch.randn(hidden, hidden, device=device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any sync below raises
    packed = pack(hidden_states, mask, lengths=lengths, align=8)
    out = unpack(packed.tensor @ weight, packed, seq_len=seq_len)
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("default")
    print(f"packed {tuple(hidden_states.shape)} -> {tuple(packed.tensor.shape)} on {device}")
    print(f"cu_seqlens_padded {packed.cu_seqlens_padded.tolist()}, max_seqlen {packed.max_seqlen}")
    print("PackedSeqParams keys:", ", ".join(sorted(packed.seq_params())))
    expected = torch.where(mask[:, :, None], hidden_states @ weight, 0.0)
    torch.testing.assert_close(out, expected)
    print("unpacked output equals the padded computation, zeros where the mask is 0")


if __name__ == "__main__":
    main()
