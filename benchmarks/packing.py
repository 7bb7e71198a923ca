"""Sequence packing: hybridmem.packing against the hand-written per-sample loop and verl's own.

For batches of 8, 64 and 256 rows of ``--seq-len`` (4096) tokens, right-padded with
valid lengths drawn uniformly from [1, seq_len] (fixed seed), and three payloads
(token ids, log-probs: no hidden dimension; hidden states of 4096 bf16), it times
pack + unpack and counts device-to-host syncs (torch's sync debug mode, "warn",
one warning per sync) for:

- the loop: what verl 0.9.1's ``preprocess_packed_seqs`` / ``postprocess_packed_seqs``
  do: ``.tolist()`` of the lengths, then ``x[i, mask[i]]`` per sample in each direction;
- verl's own pair, read from verl's wheel where ``HYBRIDMEM_VERL_WHEEL`` names it
  (tests/verl_oracle.py; Megatron's parallel state stood in for, tp = align = 8), beside
  ``hybridmem.packing.verl``'s pair with the lengths from the mask and from the host;
- hybridmem with the lengths on the host (``lengths=``), and from the mask alone.

Floors: a pack must read the valid rows and write the packed ones; an unpack must
read the valid rows and write the whole padded output; both at the device's copy rate
measured in the same run (a ``copy_`` of 4 GiB, read + write bytes per second).
Times are wall clock from an idle device (synchronised before and after: the host's
time to queue the kernels counts) for a fresh batch (pack plans it, the first unpack
uses the indices pack built) and for the same batch again (``packed.pack(other)``,
a second ``unpack``); ``device`` times are the device's alone (CUDA events with the
queue kept full, as in a training step that never waits for the device).

Targets (issues #15, #24): zero syncs with host lengths and one from the mask, through
the verl pair too; >= 20x the loop at batch 256 without a hidden dimension; with hidden
4096, unpack and pack within 1.5x of their floors at batch 8 and 1.1x at 64 and 256;
never slower than the loop at batch 8.

Run: ``python benchmarks/packing.py [--json FILE]`` (a CUDA GPU).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from hybridmem.packing import pack, unpack
from hybridmem.packing import verl as hm_verl
from hybridmem.packing._triton import enabled as triton_enabled
from tests import verl_oracle

PAYLOADS = {
    "ids": ((), torch.int64),
    "logprobs": ((), torch.float32),
    "hidden4096_bf16": ((4096,), torch.bfloat16),
}


def timed(fn: Callable[[], object], repeat: int) -> float:
    """Median seconds of ``fn`` over ``repeat`` runs (after one warm-up), device synced."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def syncs(fn: Callable[[], object]) -> int:
    """How many synchronising CUDA calls ``fn`` makes (torch's sync debug mode)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(w.message) for w in caught)


def device_ms(fn: Callable[[], object], repeat: int) -> float:
    """Median device milliseconds of ``fn``, its kernels queued behind a busy device.

    A ``torch.cuda._sleep`` kernel holds the device while the host queues ``fn``'s
    kernels, so the events between them time the device's work alone.
    """
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is None:
        return float("nan")
    fn()
    samples = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        sleep(20_000_000)  # about 10 ms of device time: longer than any queueing here
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(float(start.elapsed_time(end)))
    return statistics.median(samples)


def loop_pack(x: torch.Tensor, mask: torch.Tensor, align: int) -> tuple[torch.Tensor, Any]:
    """The hand-written pattern: lengths to the host, then a boolean index per sample."""
    seqlens = mask.sum(dim=-1, dtype=torch.int32)
    lens = seqlens.tolist()
    padded = [-(-n // align) * align for n in lens]
    starts = [0]
    for n in padded:
        starts.append(starts[-1] + n)
    out = torch.zeros((starts[-1], *x.shape[2:]), dtype=x.dtype, device=x.device)
    for i in range(x.shape[0]):
        out[starts[i] : starts[i] + lens[i]] = x[i, mask[i]]
    return out.unsqueeze(0), (lens, starts)


def loop_unpack(out: torch.Tensor, mask: torch.Tensor, meta: Any) -> torch.Tensor:
    lens, starts = meta
    batch, seq_len = mask.shape
    full = torch.zeros((batch, seq_len, *out.shape[2:]), dtype=out.dtype, device=out.device)
    for i in range(batch):
        full[i, mask[i]] = out[0, starts[i] : starts[i] + lens[i]]
    return full


def copy_rate() -> float:
    """Device copy rate in bytes moved (read + written) per second."""
    src = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * (4 << 30) / timed(lambda: dst.copy_(src), 10)


def case(batch: int, seq_len: int, payload: str, rate: float, repeat: int) -> dict[str, Any]:
    rest, dtype = PAYLOADS[payload]
    gen = torch.Generator().manual_seed(batch * 7 + seq_len)
    lengths = torch.randint(1, seq_len + 1, (batch,), generator=gen).tolist()
    mask = (torch.arange(seq_len)[None, :] < torch.tensor(lengths)[:, None]).cuda()
    if dtype == torch.int64:
        x = torch.randint(1, 32000, (batch, seq_len), device="cuda")
    else:
        x = torch.randn((batch, seq_len, *rest), device="cuda").to(dtype)
    align = 8
    packed = pack(x, mask, lengths=lengths, align=align)
    ref, meta = loop_pack(x, mask, align)
    assert torch.equal(packed.tensor, ref), "hybridmem and the loop disagree"
    assert torch.equal(unpack(packed.tensor, packed, seq_len=seq_len), loop_unpack(ref, mask, meta))

    def loop_round() -> torch.Tensor:
        out, found = loop_pack(x, mask, align)
        return loop_unpack(out, mask, found)

    def ours() -> torch.Tensor:
        made = pack(x, mask, lengths=lengths, align=align)
        return unpack(made.tensor, made, seq_len=seq_len)

    row_bytes = x[0, 0].nbytes
    n_valid = sum(lengths)
    total = sum(-(-n // align) * align for n in lengths)
    unpack_floor = (n_valid + batch * seq_len) * row_bytes / rate
    pack_floor = (n_valid + total) * row_bytes / rate
    row: dict[str, Any] = {
        "batch": batch,
        "seq_len": seq_len,
        "payload": payload,
        "valid_tokens": n_valid,
        "loop_ms": timed(loop_round, repeat) * 1e3,
        "loop_pack_ms": timed(lambda: loop_pack(x, mask, align), repeat) * 1e3,
        "loop_syncs": syncs(loop_round),
        # a fresh batch each time: pack plans it, the first unpack uses what pack built
        "hm_ms": timed(ours, repeat) * 1e3,
        "pack_ms": timed(lambda: pack(x, mask, lengths=lengths, align=align), repeat) * 1e3,
        "pack_from_mask_ms": timed(lambda: pack(x, mask, align=align), repeat) * 1e3,
        # the same batch again: another tensor packed, another output unpacked
        "pack_again_ms": timed(lambda: packed.pack(x), repeat) * 1e3,
        "unpack_again_ms": timed(lambda: unpack(packed.tensor, packed, seq_len=seq_len), repeat)
        * 1e3,
        "pack_device_ms": device_ms(lambda: pack(x, mask, lengths=lengths, align=align), repeat),
        "unpack_device_ms": device_ms(
            lambda: unpack(packed.tensor, packed, seq_len=seq_len), repeat
        ),
        "syncs_host_lengths": syncs(ours),
        "syncs_pack_from_mask": syncs(lambda: pack(x, mask, align=align)),
        "unpack_floor_ms": unpack_floor * 1e3,
        "pack_floor_ms": pack_floor * 1e3,
    }
    fresh = pack(x, mask, align=align)
    row["syncs_unpack_after_mask_pack"] = syncs(
        lambda: unpack(fresh.tensor, fresh, seq_len=seq_len)
    )
    row["unpack_ms"] = row["hm_ms"] - row["pack_ms"]
    row["speedup"] = row["loop_ms"] / row["hm_ms"]
    for name, floor in (("unpack", unpack_floor), ("pack", pack_floor)):
        for kind in ("", "_again", "_device"):
            row[f"{name}{kind}_over_floor"] = row[f"{name}{kind}_ms"] / (floor * 1e3)
    row.update(verl_figures(x, mask, lengths, seq_len, align, repeat))
    return row


@functools.cache
def stand_ins() -> tuple[verl_oracle.FakeMegatron, Any]:
    """Megatron's stand-in and verl's util module (None without its wheel), read once."""
    fake = verl_oracle.FakeMegatron()
    return fake, verl_oracle.load(fake)


def verl_figures(
    x: torch.Tensor, mask: torch.Tensor, lengths: list[int], seq_len: int, align: int, repeat: int
) -> dict[str, Any]:
    """verl's pair (where its wheel is named) and hybridmem's verl pair: syncs and times."""
    fake, module = stand_ins()
    fake.set(align, 1, 0)  # tp = align: verl pads each sequence to a multiple of tp
    batch = mask.shape[0]
    with verl_oracle.installed(fake.modules()):

        def hm_round(host: bool) -> torch.Tensor:
            out, params = hm_verl.preprocess_packed_seqs(x, mask, lengths=lengths if host else None)
            return hm_verl.postprocess_packed_seqs(out, params, mask, batch, seq_len)

        found: dict[str, Any] = {
            "hm_verl_syncs_host_lengths": syncs(lambda: hm_round(True)),
            "hm_verl_syncs_from_mask": syncs(lambda: hm_round(False)),
            "hm_verl_ms": timed(lambda: hm_round(False), repeat) * 1e3,
        }
        if module is not None:

            def verl_round() -> torch.Tensor:
                out, params = module.preprocess_packed_seqs(x, mask)
                back: torch.Tensor = module.postprocess_packed_seqs(
                    out, params, mask, batch, seq_len
                )
                return back

            assert torch.equal(verl_round(), hm_round(False)), "verl and hybridmem disagree"
            found["verl_syncs"] = syncs(verl_round)
            found["verl_ms"] = timed(verl_round, repeat) * 1e3
        return found


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    out = []

    def say(ok: bool, text: str) -> None:
        out.append(f"{'ok  ' if ok else 'MISS'} {text}")

    say(all(r["syncs_host_lengths"] == 0 for r in rows), "zero syncs with host lengths")
    say(
        all(
            r["syncs_pack_from_mask"] == 1 and r["syncs_unpack_after_mask_pack"] == 0 for r in rows
        ),
        "one sync in pack from the mask, none in unpack after",
    )
    say(
        all(
            r["hm_verl_syncs_host_lengths"] == 0 and r["hm_verl_syncs_from_mask"] == 1 for r in rows
        ),
        "the verl pair: zero syncs with host lengths, one from the mask",
    )
    for r in rows:
        name = f"{r['path']}: {r['payload']} batch {r['batch']}"
        if r["batch"] == 256 and not r["payload"].startswith("hidden"):
            say(r["speedup"] >= 20, f"{name}: {r['speedup']:.1f}x the loop (>= 20x)")
        if r["payload"].startswith("hidden"):
            limit = 1.5 if r["batch"] <= 8 else 1.1
            for what in ("unpack", "pack"):
                for kind, words in (
                    ("", "fresh batch"),
                    ("_again", "same batch"),
                    ("_device", "device"),
                ):
                    ratio = r[f"{what}{kind}_over_floor"]
                    say(
                        ratio <= limit,
                        f"{name}: {what} ({words}) {ratio:.2f}x its floor (<= {limit}x)",
                    )
        if r["batch"] == 8:
            say(r["speedup"] >= 1.0, f"{name}: {r['speedup']:.1f}x the loop (>= 1x)")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument(
        "--paths",
        nargs="+",
        default=["triton", "torch"],
        choices=["triton", "torch"],
        help="hybridmem's paths to measure: Triton's kernels (where installed), torch's calls",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/packing.py needs a CUDA GPU", file=sys.stderr)
        return 2
    rate = copy_rate()
    torch.cuda.empty_cache()
    print(f"device copy rate: {rate / 1e9:.0f} GB/s (read + write), {torch.cuda.get_device_name()}")
    rows = []
    for path in args.paths:
        os.environ["HYBRIDMEM_PACKING_TRITON"] = "1" if path == "triton" else "0"
        if path == "triton" and not triton_enabled():
            print("Triton is not installed: no triton path", file=sys.stderr)
            continue
        for payload in PAYLOADS:
            for batch in args.batches:
                row = case(batch, args.seq_len, payload, rate, args.repeat)
                rows.append({"path": path, **row})
                torch.cuda.empty_cache()  # the case's tensors are gone: hand their memory back
    head = (
        f"{'path':<7}{'payload':<16}{'batch':>6}{'loop ms':>9}{'syncs':>6}"
        f"{'verl ms':>9}{'syncs':>6}"
        f"{'hm ms':>8}{'syncs':>6}{'mask':>5}{'speedup':>8}"
        f"{'pack/fl':>8}{'again':>7}{'device':>7}{'unpk/fl':>8}{'again':>7}{'device':>7}"
    )
    print(head)
    for r in rows:
        verl_ms = (
            f"{r['verl_ms']:>9.2f}{r['verl_syncs']:>6}" if "verl_ms" in r else f"{'-':>9}{'-':>6}"
        )
        print(
            f"{r['path']:<7}{r['payload']:<16}{r['batch']:>6}{r['loop_ms']:>9.2f}{r['loop_syncs']:>6}{verl_ms}"
            f"{r['hm_ms']:>8.2f}{r['syncs_host_lengths']:>6}{r['syncs_pack_from_mask']:>5}"
            f"{r['speedup']:>7.1f}x{r['pack_over_floor']:>7.2f}x{r['pack_again_over_floor']:>6.2f}x"
            f"{r['pack_device_over_floor']:>6.2f}x{r['unpack_over_floor']:>7.2f}x"
            f"{r['unpack_again_over_floor']:>6.2f}x{r['unpack_device_over_floor']:>6.2f}x"
        )
    found = verdicts(rows)
    print("\n".join(found))
    if args.json:
        report: dict[str, Any] = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
        }
        report.update(copy_rate_gbps=rate / 1e9, rows=rows, verdicts=found)
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
