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

# The other kernels keep their block's partials in static __shared__ arrays
# (the block reduction's scratch, top-k's best entries); the emulation runs
# one block at a time, so function-static arrays stand in for them.
for f in loss embedding rope reduce topk norm adamw elementwise convert; do
    sed -e 's/extern "C" //' -e 's/__shared__ \(float\|unsigned int\) /static \1 /' "kernels/cuda/$f.cu" >"$dir/$f.inc"
    if grep -q '__shared__\|asm(' "$dir/$f.inc"; then
        echo "cuda-host-check: kernels/cuda/$f.cu has device-only code the emulation does not replace" >&2
        exit 1
    fi
done
cp kernels/cuda/host_check/rows.h "$dir/"
# ops.cpp: loss, embedding, RoPE, max_abs, top-k; norm.cpp: the norms and
# AdamW; elementwise.cpp: activations, bias, axpy, the strided copy.
for check in ops norm elementwise; do
    cp "kernels/cuda/host_check/$check.cpp" "$dir/"
    g++ -std=c++20 -O1 -pthread -w "$dir/$check.cpp" -o "$dir/$check"
    "$dir/$check"
done
