#!/usr/bin/env bash
# The main job (examples/configs/arith.toml: dp2 x tp2 x pp2, three-digit
# addition) trained from the same seed in f32 and with every linear layer's
# products in FP8 (precision.fp8: E4M3 inputs and weights, E5M2 gradients,
# delayed scaling): the loss over the last 100 steps, the held-out exact
# match and the median step time of each, and the ratios to f32. On CPU
# ranks FP8 is emulated (each operand rounded to its codes' values, then an
# f32 product), so its step time is the emulation's cost, not FP8's speed.
# Prints one JSON line per setting (the last lines).
#
#   scripts/fp8-main-job.sh                 # 2000 steps
#   STEPS=1000 scripts/fp8-main-job.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --example train
mkdir -p runs
steps=${STEPS:-2000}
for c in "f32|precision.fp8=false" "fp8|precision.fp8=true"; do
    name=${c%%|*}
    out=runs/arith-precision-$name
    target/release/examples/train --fresh --out "$out" --steps "$steps" --set "${c#*|}" --set run.progress=false > "$out.log" 2>&1 ||
        { tail -5 "$out.log" >&2; exit 1; }
done
python3 - <<'PY'
import json
def load(name):
    out = f"runs/arith-precision-{name}"
    steps = [json.loads(l) for l in open(f"{out}/metrics.jsonl")]
    tail = steps[-100:]
    return {
        "loss_last_100": sum(s["loss"] for s in tail) / len(tail),
        "step_time_s": sorted(s["step_time_s"] for s in steps)[len(steps) // 2],
        "exact_match": json.load(open(f"{out}/eval.json"))["exact_match"],
    }
base = load("f32")
for name, label in {"f32": "f32", "fp8": "FP8 (E4M3 forward, E5M2 gradients, CPU emulation)"}.items():
    r = load(name)
    print(json.dumps({"bench": "fp8-main-job", "case": label, **r,
                      "loss_ratio": r["loss_last_100"] / base["loss_last_100"],
                      "step_time_ratio": r["step_time_s"] / base["step_time_s"]}))
PY
