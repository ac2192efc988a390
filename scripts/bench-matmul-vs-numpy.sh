#!/usr/bin/env bash
# Ratio of Tessera's f32 CPU matrix product to numpy's (OpenBLAS sgemm), measured
# on this machine in this sitting, interleaved so background load hits both.
#
#   scripts/bench-matmul-vs-numpy.sh [--sizes 1024,2048] [--rounds 5] [--reps 5]
#
# Prints one JSON line per size, e.g.
#   {"bench":"matmul_vs_numpy","case":"2048","tessera_gflops":...,"numpy_gflops":...,"ratio":...}
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv-bench
if ! "$venv/bin/python" -c 'import numpy, threadpoolctl' 2>/dev/null; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet numpy threadpoolctl
fi
cargo build --release --example bench >&2
exec "$venv/bin/python" scripts/bench-matmul-vs-numpy.py --bench target/release/examples/bench "$@"
