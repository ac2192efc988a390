#!/usr/bin/env bash
# Checks the logic of the CUDA kernels on the CPU: the attention kernels
# (CUDA-core and tensor-core), paged attention and the KV-cache write,
# softmax, cross-entropy, embedding, RoPE, max_abs, top-k, the norms, AdamW,
# the element-wise kernels, the strided copy, the FP8 operands and the
# quantized products (int8, int4, W8A8). Compiles their sources as C++ against a host emulation
# of the CUDA features they use (kernels/cuda/host_check/shim.h, shim_mma.h)
# and compares their results with double-precision references (top-k with an
# exact one).
# Needs g++ with C++20; no GPU, no CUDA.
#
#   scripts/cuda-host-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

# Both attention sources start with attention_common.cuh, as the runtime
# compiles them. Three device-only constructs get host stand-ins: the read of the shared
# memory size register, the C linkage of the entry points (the check calls the
# templates directly), and the shared array (the shim's global one).
src=kernels/cuda/attention.cu
sed -e 's/asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(smem));/smem = emu_smem_bytes;/' \
    -e 's/extern "C" //' \
    -e 's/extern __shared__ float smem\[\];//' kernels/cuda/attention_common.cuh "$src" >"$dir/attention.inc"
if grep -q 'asm(\|extern __shared__' "$dir/attention.inc"; then
    echo "cuda-host-check: $src has device-only code the emulation does not replace" >&2
    exit 1
fi
cp kernels/cuda/host_check/shim.h kernels/cuda/host_check/attention_case.h kernels/cuda/host_check/attention.cpp "$dir/"
g++ -std=c++20 -O1 -pthread -w "$dir/attention.cpp" -o "$dir/attention"
"$dir/attention"

# The tensor-core kernels keep their device-only instructions (mma, the
# 16-bit packing, the shared array and its size register) in one block that
# only a CUDA compiler sees; shim_mma.h supplies host versions of those
# functions. The tiles are 16-bit arrays read as 32- and 64-bit words, hence
# -fno-strict-aliasing.
src=kernels/cuda/attention_tc.cu
sed -e 's/extern "C" //' kernels/cuda/attention_common.cuh "$src" >"$dir/attention_tc.inc"
if g++ -std=c++20 -E -P -x c++ "$dir/attention_tc.inc" | grep -q 'asm\|__shared__'; then
    echo "cuda-host-check: $src has device-only code outside the block the emulation replaces" >&2
    exit 1
fi
cp kernels/cuda/host_check/shim_mma.h kernels/cuda/host_check/attention_case.h kernels/cuda/host_check/attention_tc.cpp "$dir/"
g++ -std=c++20 -O1 -pthread -w -fno-strict-aliasing "$dir/attention_tc.cpp" -o "$dir/attention_tc"
"$dir/attention_tc"

# Paged attention keeps its shared arrays (of every type) in its entry
# points; the emulation runs one block at a time, so function-static arrays
# stand in for them. paged.cpp: the cache write, the attention against a
# double-precision reference, and a token alone against the same token in a
# batch, in f32, bf16 and f16.
sed -e 's/extern "C" //' -e 's/__shared__ /static /' kernels/cuda/paged_attention.cu >"$dir/paged_attention.inc"
if grep -q '__shared__\|asm(' "$dir/paged_attention.inc"; then
    echo "cuda-host-check: kernels/cuda/paged_attention.cu has device-only code the emulation does not replace" >&2
    exit 1
fi
cp kernels/cuda/host_check/shim.h kernels/cuda/host_check/rows.h kernels/cuda/host_check/paged.cpp "$dir/"
g++ -std=c++20 -O1 -pthread -w "$dir/paged.cpp" -o "$dir/paged"
"$dir/paged"

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

# FP8: the nearest code's value, against a brute force over the code table.
sed -e 's/extern "C" //' kernels/cuda/fp8.cu >"$dir/fp8.inc"
cp kernels/cuda/host_check/fp8.cpp "$dir/"
g++ -std=c++20 -O1 -pthread -w "$dir/fp8.cpp" -o "$dir/fp8"
"$dir/fp8"

# Ring attention's merge: softmax over the union of two key sets.
sed -e 's/extern "C" //' kernels/cuda/attention_merge.cu >"$dir/attention_merge.inc"
cp kernels/cuda/host_check/attention_merge.cpp "$dir/"
g++ -std=c++20 -O1 -pthread -w "$dir/attention_merge.cpp" -o "$dir/attention_merge"
"$dir/attention_merge"

# The quantized products keep dp4a (inline PTX) in a block only a CUDA
# compiler sees; quant.cpp supplies its host version. The row quantization's
# block reduction uses a static __shared__ array, as the row kernels above.
src=kernels/cuda/quant.cu
sed -e 's/extern "C" //' -e 's/__shared__ float /static float /' "$src" >"$dir/quant.inc"
if g++ -std=c++20 -E -P -x c++ "$dir/quant.inc" | grep -q 'asm\|__shared__'; then
    echo "cuda-host-check: $src has device-only code outside the block the emulation replaces" >&2
    exit 1
fi
cp kernels/cuda/host_check/quant.cpp "$dir/"
g++ -std=c++20 -O1 -pthread -w "$dir/quant.cpp" -o "$dir/quant"
"$dir/quant"
