"""Interleaved comparison of Tessera's f32 matmul with numpy's; run through
bench-matmul-vs-numpy.sh, which prepares the venv and builds the benchmark.

Each round measures both sides at one size back to back (alternating which goes
first), each as the median of several timed repetitions after a warm-up; the
reported ratio is the median over rounds of the per-round ratios, so a burst of
background load during one round cannot bias the result. The ratio of the best
rounds is reported too.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

# Measures numpy in its own process, with the same method as the Rust bench:
# warm-up, then `reps` repetitions of at least `min_time` seconds each.
NUMPY_PROBE = r"""
import json, math, statistics, sys, time
import numpy as np
s, reps, min_time = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
rng = np.random.default_rng(0)
a = rng.uniform(-1, 1, (s, s)).astype(np.float32)
b = rng.uniform(-1, 1, (s, s)).astype(np.float32)
c = np.empty((s, s), np.float32)
flops = 2.0 * s ** 3
t0, n = time.perf_counter(), 0
while n < 2 or time.perf_counter() - t0 < min_time:
    np.matmul(a, b, out=c)
    n += 1
inner = max(1, math.ceil(min_time / ((time.perf_counter() - t0) / n)))
rates = []
for _ in range(reps):
    t = time.perf_counter()
    for _ in range(inner):
        np.matmul(a, b, out=c)
    rates.append(flops * inner / (time.perf_counter() - t) / 1e9)
print(json.dumps({"gflops": statistics.median(rates)}))
"""

BLAS_INFO = r"""
import json, numpy as np, threadpoolctl
np.ones((64, 64), np.float32) @ np.ones((64, 64), np.float32)
info = [{k: d.get(k) for k in ("internal_api", "version", "architecture", "num_threads")}
        for d in threadpoolctl.threadpool_info() if d.get("user_api") == "blas"]
print(json.dumps({"numpy": np.__version__, "blas": info}))
"""


def numpy_env():
    # These variables, when set for older OpenBLAS builds, force a slower core
    # type and cache size on a current numpy; measure what numpy picks itself.
    env = dict(os.environ)
    env.pop("OPENBLAS_CORETYPE", None)
    env.pop("OPENBLAS_L2_SIZE", None)
    return env


def run_json(cmd, env=None):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bench", required=True, help="path to the built Tessera bench binary")
    p.add_argument("--sizes", default="1024,2048")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--min-time", type=float, default=0.2)
    args = p.parse_args()

    info = run_json([sys.executable, "-c", BLAS_INFO], env=numpy_env())
    print(json.dumps({"bench": "numpy_blas", **info}), file=sys.stderr)

    for s in [int(x) for x in args.sizes.split(",")]:
        tessera, numpy, ratios = [], [], []
        for r in range(args.rounds):
            def measure_tessera():
                return run_json([args.bench, "matmul", "--sizes", str(s), "--reps", str(args.reps),
                                 "--min-time", str(args.min_time)])["gflops"]

            def measure_numpy():
                return run_json([sys.executable, "-c", NUMPY_PROBE, str(s), str(args.reps),
                                 str(args.min_time)], env=numpy_env())["gflops"]

            if r % 2 == 0:
                t, n = measure_tessera(), measure_numpy()
            else:
                n, t = measure_numpy(), measure_tessera()
            tessera.append(t)
            numpy.append(n)
            ratios.append(t / n)
            print(f"size {s} round {r}: tessera {t:.1f} numpy {n:.1f} GFLOP/s ratio {t / n:.3f}",
                  file=sys.stderr)
        print(json.dumps({
            "bench": "matmul_vs_numpy",
            "case": str(s),
            "tessera_gflops": round(statistics.median(tessera), 1),
            "numpy_gflops": round(statistics.median(numpy), 1),
            "ratio": round(statistics.median(ratios), 3),
            # Best round of each side: what each reaches when the machine is
            # quiet, a useful second view when other work shares the cores.
            "tessera_best_gflops": round(max(tessera), 1),
            "numpy_best_gflops": round(max(numpy), 1),
            "best_ratio": round(max(tessera) / max(numpy), 3),
            "rounds": args.rounds,
        }), flush=True)


if __name__ == "__main__":
    main()
