#!/usr/bin/env bash
# bf16 on CPU, Tessera against PyTorch, measured on this machine in this
# sitting, interleaved so background load hits both sides:
#
#   matmul  bf16 C = A·B at --size (2048), Tessera's bf16 GEMM vs torch.matmul
#   gpt     gpt-tiny training in bf16 (f32 master weights): Tessera's tokens/s
#           against an f32 copy of the same model trained in the same process
#           (steps alternating), and against PyTorch eager with bf16 autocast
#           on the same model, batch and optimizer
#
#   scripts/bench-bf16-vs-torch.sh [--cases matmul,gpt] [--rounds 5] [--size 2048] [--steps 6]
#
# PyTorch is a reference here only; it is no part of the framework. Prints one
# JSON line per case, each with median per-round ratios.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv-bench
if ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
    python3 -m venv "$venv"
    # The CPU build is enough; the default wheel from PyPI also runs on CPU.
    "$venv/bin/pip" install --quiet numpy threadpoolctl torch
fi
cargo build --release --example bench >&2
exec "$venv/bin/python" scripts/bench-bf16-vs-torch.py --bench target/release/examples/bench "$@"
