#!/usr/bin/env bash
# Checks the logic of the CUDA attention kernels (CUDA-core and tensor-core),
# and of the softmax, cross-entropy, embedding, RoPE and max_abs kernels, on
# the CPU: compiles their sources as C++ against a host emulation of the CUDA
# features they use (kernels/cuda/host_check/shim.h, shim_mma.h) and compares
# their results with double-precision references. Needs g++ with C++20; no GPU, no CUDA.
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

# The tensor-core kernels keep their device-only instructions (mma, the
# 16-bit packing, the shared array and its size register) in one block that
# only a CUDA compiler sees; shim_mma.h supplies host versions of those
# functions. The tiles are 16-bit arrays read as 32- and 64-bit words, hence
# -fno-strict-aliasing.
src=kernels/cuda/attention_tc.cu
sed -e 's/extern "C" //' "$src" >"$dir/attention_tc.inc"
if g++ -std=c++20 -E -P -x c++ "$dir/attention_tc.inc" | grep -q 'asm\|__shared__'; then
    echo "cuda-host-check: $src has device-only code outside the block the emulation replaces" >&2
    exit 1
fi
cp kernels/cuda/host_check/shim_mma.h kernels/cuda/host_check/attention_tc.cpp "$dir/"
g++ -std=c++20 -O1 -pthread -w -fno-strict-aliasing "$dir/attention_tc.cpp" -o "$dir/attention_tc"
"$dir/attention_tc"

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
cp kernels/cuda/host_check/ops.cpp "$dir/"
g++ -std=c++20 -O1 -pthread -w "$dir/ops.cpp" -o "$dir/ops"
"$dir/ops"
