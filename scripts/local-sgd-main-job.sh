#!/usr/bin/env bash
# The main job (examples/configs/arith.toml: dp2 x tp2 x pp2, three-digit
# addition) trained from the same seed synchronously (gradients all-reduced
# every step) and with Local SGD / DiLoCo ([local_sgd]: the replicas meet
# every H steps): the bytes a rank sends per token trained, the loss over the
# last 100 steps and the held-out exact match of each, and the ratios to the
# synchronous run. Prints one JSON line per setting (the last lines).
#
#   scripts/local-sgd-main-job.sh                 # 2000 steps
#   STEPS=1000 scripts/local-sgd-main-job.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --example train
mkdir -p runs
steps=${STEPS:-2000}
# H divides the main job's checkpoint interval (100): checkpoints fall on meetings.
cases=(
    "sync|local_sgd.every=0"
    "diloco-5|local_sgd.every=5"
    "diloco-20|local_sgd.every=20"
    "diloco-50|local_sgd.every=50"
    "diloco-20-m05|local_sgd.every=20 local_sgd.outer_momentum=0.5"
    "average-20|local_sgd.every=20 local_sgd.outer_lr=1.0 local_sgd.outer_momentum=0.0"
)
for c in "${cases[@]}"; do
    name=${c%%|*}
    sets=()
    for s in ${c#*|}; do sets+=(--set "$s"); done
    out=runs/arith-local-$name
    target/release/examples/train --fresh --out "$out" --steps "$steps" "${sets[@]}" --set run.progress=false > "$out.log" 2>&1 ||
        { tail -5 "$out.log" >&2; exit 1; }
done
python3 - <<'PY'
import json, tomllib
def load(name):
    out = f"runs/arith-local-{name}"
    cfg = tomllib.load(open(f"{out}/config.toml", "rb"))
    b, m = cfg["batch"], cfg["mesh"]
    tokens_per_step = m["dp"] * m["ep"] * b["micro_batch"] * b["grad_accum"] * b["seq_len"]
    steps = [json.loads(l) for l in open(f"{out}/metrics.jsonl")]
    tail = steps[-100:]
    return {
        "loss_last_100": sum(s["loss"] for s in tail) / len(tail),
        "bytes_per_token": sum(s["grad_bytes"] for s in steps) / (len(steps) * tokens_per_step),
        "step_time_s": sorted(s["step_time_s"] for s in steps)[len(steps) // 2],
        "exact_match": json.load(open(f"{out}/eval.json"))["exact_match"],
    }
base = load("sync")
labels = {"sync": "synchronous", "diloco-5": "DiLoCo, H = 5", "diloco-20": "DiLoCo, H = 20",
          "diloco-50": "DiLoCo, H = 50", "diloco-20-m05": "DiLoCo, H = 20, outer momentum 0.5",
          "average-20": "Local SGD (averaging), H = 20"}
for name, label in labels.items():
    r = load(name)
    print(json.dumps({"bench": "local-sgd", "case": label, **r,
                      "bytes_ratio": r["bytes_per_token"] / base["bytes_per_token"],
                      "loss_ratio": r["loss_last_100"] / base["loss_last_100"],
                      "step_time_ratio": r["step_time_s"] / base["step_time_s"]}))
PY
