#!/usr/bin/env bash
# The main job (examples/configs/arith.toml: dp2 x tp2 x pp2, three-digit
# addition) trained from the same seed with its data-parallel gradients sent
# whole, as bf16, as PowerSGD factors, and as PowerSGD factors after a
# warm-up of whole steps (a tenth of the run): the gradient bytes a rank
# sends per step, the loss over the last 100 steps and the held-out exact
# match of each, and the ratios to the uncompressed run. Prints one JSON
# line per setting (the last lines).
#
#   scripts/grad-compression-main-job.sh                 # rank 4, 2000 steps
#   RANK=2 STEPS=1000 scripts/grad-compression-main-job.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --example train
mkdir -p runs
rank=${RANK:-4}
steps=${STEPS:-2000}
warmup=$((steps / 10))
cases=(
    "none|mesh.grad_compression=\"none\""
    "bf16|mesh.grad_compression=\"bf16\""
    "powersgd|mesh.grad_compression=\"powersgd\" mesh.powersgd_rank=$rank"
    "powersgd-warmup|mesh.grad_compression=\"powersgd\" mesh.powersgd_rank=$rank mesh.powersgd_warmup=$warmup"
)
for c in "${cases[@]}"; do
    name=${c%%|*}
    sets=()
    for s in ${c#*|}; do sets+=(--set "$s"); done
    out=runs/arith-grad-$name
    target/release/examples/train --fresh --out "$out" --steps "$steps" "${sets[@]}" --set run.progress=false > "$out.log" 2>&1 ||
        { tail -5 "$out.log" >&2; exit 1; }
done
python3 - "$rank" "$warmup" <<'EOF'
import json, sys
rank, warmup = int(sys.argv[1]), int(sys.argv[2])
def load(name):
    out = f"runs/arith-grad-{name}"
    steps = [json.loads(l) for l in open(f"{out}/metrics.jsonl")]
    tail = steps[-100:]
    return {
        "loss_last_100": sum(s["loss"] for s in tail) / len(tail),
        "grad_bytes_per_step": sum(s["grad_bytes"] for s in steps) / len(steps),
        "step_time_s": sorted(s["step_time_s"] for s in steps)[len(steps) // 2],
        "exact_match": json.load(open(f"{out}/eval.json"))["exact_match"],
    }
base = load("none")
labels = {"none": "none", "bf16": "bf16", "powersgd": f"powersgd rank {rank}", "powersgd-warmup": f"powersgd rank {rank}, {warmup} steps whole first"}
for name, label in labels.items():
    r = load(name)
    print(json.dumps({"bench": "grad-compression", "case": label, **r,
                      "bytes_ratio": r["grad_bytes_per_step"] / base["grad_bytes_per_step"],
                      "loss_ratio": r["loss_last_100"] / base["loss_last_100"],
                      "step_time_ratio": r["step_time_s"] / base["step_time_s"]}))
EOF
