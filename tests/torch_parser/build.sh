#!/usr/bin/env bash
# Build probe.cpp against torch's CUDA wheels, one binary per version (dev tool, no GPU).
#
#   bash tests/torch_parser/build.sh WORKDIR [VERSION ...]
#
# Downloads each CUDA wheel (about 0.5-0.9 GB; pip's cache is used), extracts its C++
# headers and libc10*.so, and builds WORKDIR/probe-VERSION. Needs g++, a CUDA
# toolkit's cuda_runtime.h (CUDA_HOME, default /usr/local/cuda) and the CUDA runtime
# libraries the wheels link (libcudart.so.12 from the nvidia-cuda-runtime-cu12 wheel,
# libcudart.so.13 from CUDA_HOME). record.py runs the binaries.
set -euo pipefail
work=${1:?usage: build.sh WORKDIR [VERSION ...]}
shift
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(2.4.1 2.5.1 2.6.0 2.7.1 2.8.0 2.9.1 2.10.0 2.11.0 2.12.0 2.13.0 2.14.1 2.15.0)
# PIP_CONFIG_FILE=/dev/null: a machine's pip configuration may cap torch (a constraints
# file); the probe needs each wheel's libraries, whatever the machine would install.
export PIP_CONFIG_FILE=/dev/null
here=$(cd "$(dirname "$0")" && pwd)
cuda=${CUDA_HOME:-/usr/local/cuda}
mkdir -p "$work/wheels" "$work/rt"
# --isolated: take PyPI's CUDA wheel even where a local index offers a CPU build
pip --isolated download -q --no-deps nvidia-cuda-runtime-cu12 --only-binary=:all: \
    --python-version 3.11 --platform manylinux2014_x86_64 -d "$work/rt"
(cd "$work/rt" && unzip -q -o ./*.whl)
rt12="$work/rt/nvidia/cuda_runtime/lib"
for v in "${versions[@]}"; do
    n=$(echo "$v" | awk -F. '{print $1*100+$2}')
    pip --isolated download -q --no-deps "torch==$v" --only-binary=:all: --python-version 3.11 \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d "$work/wheels/$v"
    x="$work/x/$v"
    mkdir -p "$x"
    unzip -q -o "$work/wheels/$v"/torch-*.whl 'torch/lib/libc10.so' 'torch/lib/libc10_cuda.so' \
        'torch/include/c10/*' 'torch/include/torch/headeronly/*' -d "$x" 2>/dev/null || true
    abi=1
    [ "$n" -le 206 ] && abi=0      # wheels before 2.7 use the old C++ ABI
    g++ -std=c++17 -O0 -DTORCH_V="$n" -D_GLIBCXX_USE_CXX11_ABI=$abi -DPYTORCH_C10_DRIVER_API_SUPPORTED \
        -I"$x/torch/include" -I"$cuda/include" "$here/probe.cpp" \
        -L"$x/torch/lib" -Wl,-rpath-link,"$rt12:$cuda/lib64:$x/torch/lib" -lc10_cuda -lc10 \
        -o "$work/probe-$v"
    echo "built $work/probe-$v"
done
