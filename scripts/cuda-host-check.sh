#!/usr/bin/env bash
# Checks the logic of the CUDA attention kernels on the CPU: compiles
# kernels/cuda/attention.cu as C++ against a host emulation of the CUDA
# features it uses (kernels/cuda/host_check/shim.h) and compares its results
# with a double-precision reference. Needs g++ with C++20; no GPU, no CUDA.
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
