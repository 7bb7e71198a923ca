"""Move the weights a trainer keeps on the GPU out of classic segments, once.

A model built before any expandable-segments scope has each weight over 1 MiB in a
classic segment rounded up to 2 MiB; while the weight lives, no release returns the
rest. ``hm.compact`` moves them (and the optimizer state that shares those segments)
into expandable segments in place; the cache a release leaves shrinks. On a machine
without a GPU it says what it would do, and stops.

Run: ``python examples/compact_resident.py``.
"""

from __future__ import annotations

import logging

import torch

import hybridmem as hm

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
MiB = 1 << 20


def cached_after_release() -> float:
    """MiB the caching allocator keeps after a release (0 without a GPU)."""
    hm.release_cache()
    info = hm.memory_info()
    return (info.reserved - info.allocated) / MiB if info.available else 0.0


def main() -> None:
    if not torch.cuda.is_available():
        print(
            "compact_resident.py needs a CUDA GPU: there it moves the resident weights out of "
            "classic segments and prints the cache a release leaves before and after; "
            "nothing to do here"
        )
        return
    device = "cuda"
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(8):  # weights of 10.7 MiB each, as a 1024-wide Llama's MLP
        blocks += [torch.nn.Linear(1024, 2731, bias=False), torch.nn.Linear(2731, 1024)]
    model = torch.nn.Sequential(*blocks).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(8, 1024, device=device)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    offloader = hm.Offloader(optimizer)  # the state leaves for each rollout...
    offloader.offload()
    print(f"cache kept around the resident weights: {cached_after_release():.1f} MiB")
    offloader.reload()

    report = hm.compact(model, optimizer)  # once, before the first switch
    print(report)

    offloader.offload()
    print(f"after compact: {cached_after_release():.1f} MiB")
    offloader.reload()


if __name__ == "__main__":
    main()
