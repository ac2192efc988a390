#!/usr/bin/env bash
# Checks the logic of the CUDA attention kernels, and of the softmax,
# cross-entropy, embedding, RoPE, max_abs and top-k kernels, on the CPU:
# compiles their sources as C++ against a host emulation of the CUDA features
# they use (kernels/cuda/host_check/shim.h) and compares their results with
# double-precision references (top-k with an exact one). Needs g++ with C++20; no GPU, no CUDA.
#
#   scripts/cuda-host-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

# Three device-only constructs get host stand-ins: the read of the shared
# memory size register, the C linkage of the entry points (the check calls the
# templates directly), and the shared array (the shim's global one).
src=kernels/cuda/attention.cu
sed -e 's/asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(smem));/smem = emu_smem_bytes;/' \
    -e 's/extern "C" //' \
    -e 's/extern __shared__ float smem\[\];//' "$src" >"$dir/attention.inc"
if grep -q 'asm(\|extern __shared__' "$dir/attention.inc"; then
    echo "cuda-host-check: $src has device-only code the emulation does not replace" >&2
    exit 1
fi
cp kernels/cuda/host_check/shim.h kernels/cuda/host_check/attention.cpp "$dir/"
g++ -std=c++20 -O1 -pthread -w "$dir/attention.cpp" -o "$dir/attention"
"$dir/attention"

# The row and lookup kernels declare their block-reduction scratch as a
# static __shared__ array; the emulation runs one block at a time, so a
# function-static array stands in for it.
for f in loss embedding rope reduce; do
    sed -e 's/extern "C" //' -e 's/__shared__ float scratch\[32\];/static float scratch[32];/' "kernels/cuda/$f.cu" >"$dir/$f.inc"
    if grep -q '__shared__\|asm(' "$dir/$f.inc"; then
        echo "cuda-host-check: kernels/cuda/$f.cu has device-only code the emulation does not replace" >&2
        exit 1
    fi
done
# topk.cu keeps its block's partials in two static __shared__ arrays; the
# same function-static stand-in serves.
sed -e 's/extern "C" //' -e 's/__shared__ \(float\|unsigned int\) /static \1 /' kernels/cuda/topk.cu >"$dir/topk.inc"
if grep -q '__shared__\|asm(' "$dir/topk.inc"; then
    echo "cuda-host-check: kernels/cuda/topk.cu has device-only code the emulation does not replace" >&2
    exit 1
fi
cp kernels/cuda/host_check/rows.h kernels/cuda/host_check/ops.cpp "$dir/"
g++ -std=c++20 -O1 -pthread -w "$dir/ops.cpp" -o "$dir/ops"
"$dir/ops"

# The norms, the multi-tensor AdamW step, the element-wise kernels and the
# strided copy, the same way.
for f in norm adamw elementwise convert; do
    sed -e 's/extern "C" //' -e 's/__shared__ float scratch\[32\];/static float scratch[32];/' "kernels/cuda/$f.cu" >"$dir/$f.inc"
    if grep -q '__shared__\|asm(' "$dir/$f.inc"; then
        echo "cuda-host-check: kernels/cuda/$f.cu has device-only code the emulation does not replace" >&2
        exit 1
    fi
done
cp kernels/cuda/host_check/norm.cpp "$dir/"
g++ -std=c++20 -O1 -pthread -w "$dir/norm.cpp" -o "$dir/norm"
"$dir/norm"
cp kernels/cuda/host_check/elementwise.cpp "$dir/"
g++ -std=c++20 -O1 -pthread -w "$dir/elementwise.cpp" -o "$dir/elementwise"
"$dir/elementwise"
