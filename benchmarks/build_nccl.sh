#!/usr/bin/env bash
# Build NCCL's shared library from NVIDIA/nccl's source for one GPU architecture.
#
# Usage: benchmarks/build_nccl.sh SOURCE.tar.gz OUTDIR [SM]
#   SOURCE.tar.gz  `git archive --prefix=nccl/` of NVIDIA/nccl (2.29.7 or newer has
#                  ncclCommSuspend / ncclCommResume / ncclCommMemStats)
#   OUTDIR         where libnccl.so.2 lands (stripped)
#   SM             compute capability without the dot (default: the current GPU's)
#
# The build keeps only the device kernels a one-node measurement reaches (ring and
# tree all-reduce, all-gather, broadcast, reduce-scatter of the common types, send/
# recv): NCCL's own ONLY_FUNCS filter. A collective outside that set fails inside
# NCCL; communicators of one rank use none of them. Load the result under torch with
#   LD_PRELOAD=OUTDIR/libnccl.so.2 python ...
# (torch links libnccl.so.2 by its soname; NCCL keeps its ABI across 2.x).
set -euo pipefail
src=$1; out=$2; sm=${3:-}
if [[ -z "$sm" ]]; then
  sm=$(python3 -c 'import torch; a,b=torch.cuda.get_device_capability(); print(f"{a}{b}")')
fi
work=${NCCL_BUILD_DIR:-/tmp/nccl-build}
mkdir -p "$work" "$out"
tar xzf "$src" -C "$work"
cd "$work/nccl"
types='(f32|bf16|f16|f64|i32|i64|u8|i8)'
funcs="AllReduce (Sum|MinMax) $types (RING|TREE) *|AllGather RING *|Broadcast RING *|ReduceScatter Sum $types RING *|SendRecv"
start=$(date +%s)
make -j"$(nproc)" -C src lib \
  NVCC_GENCODE="-gencode=arch=compute_${sm},code=sm_${sm}" \
  ONLY_FUNCS="$funcs" >"$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
lib=$(ls build/lib/libnccl.so.2.* | head -1)
strip -s -o "$out/libnccl.so.2" "$lib"
echo "built $(basename "$lib") for sm_${sm} in $(( $(date +%s) - start )) s: $(du -h "$out/libnccl.so.2" | cut -f1)"
