#!/usr/bin/env bash
# Installs the CUDA compilers the kernel gate needs, NVRTC and ptxas, from
# NVIDIA's PyPI wheels into a virtual environment. They run on a machine with
# no GPU and no CUDA toolkit. Prints the environment to use them:
#
#   eval "$(scripts/cuda-toolchain.sh)"
#   cargo test -p tessera-core --features cuda --test cuda_kernels
#
# The venv goes to $TESSERA_CUDA_TOOLCHAIN (default: .cuda-toolchain in the
# repository root); a second run reuses it. The wheel version follows the CUDA
# API version the runtime's bindings are pinned to (`cuda-12080`).
set -euo pipefail
cd "$(dirname "$0")/.."

version=12.8.93
venv=${TESSERA_CUDA_TOOLCHAIN:-$PWD/.cuda-toolchain}

if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv" >&2
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    "nvidia-cuda-nvrtc-cu12==$version" "nvidia-cuda-nvcc-cu12==$version" >&2

site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
nvrtc_lib=$site/nvidia/cuda_nvrtc/lib
ptxas=$site/nvidia/cuda_nvcc/bin/ptxas
for f in "$nvrtc_lib/libnvrtc.so.12" "$ptxas"; do
    if [ ! -e "$f" ]; then
        echo "cuda-toolchain: expected $f after installing the wheels, it is missing" >&2
        exit 1
    fi
done

echo "export LD_LIBRARY_PATH=$nvrtc_lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
echo "export TESSERA_PTXAS=$ptxas"
