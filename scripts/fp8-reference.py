#!/usr/bin/env python3
"""Writes FP8 conversions by ml_dtypes (the library JAX and NumPy use) for
the kernels' ignored test `encoding_agrees_with_ml_dtypes`:

    pip install ml_dtypes numpy
    python3 scripts/fp8-reference.py target/fp8-reference.txt
    cargo test -p tessera-kernels --lib fp8 -- --ignored --nocapture

One line per value: its f32 bits, its E4M3 code and its E5M2 code."""
import sys

import ml_dtypes
import numpy as np

out = sys.argv[1] if len(sys.argv) > 1 else "target/fp8-reference.txt"
rng = np.random.default_rng(0)
x = np.concatenate([rng.standard_normal(200_000).astype(np.float32) * s for s in [1e-4, 1e-2, 1, 30, 400, 20_000]])
edges = np.array([0.0, -0.0, 448, -448, 464, 57344, 2**-9, 2**-10, 3 * 2**-11, 2**-16, 2**-17], dtype=np.float32)
x = np.concatenate([x, edges])
e4 = x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
e5 = x.astype(ml_dtypes.float8_e5m2).view(np.uint8)
with open(out, "w") as f:
    for bits, a, b in zip(x.view(np.uint32), e4, e5):
        f.write(f"{bits} {a} {b}\n")
print(f"wrote {len(x)} values to {out}")
