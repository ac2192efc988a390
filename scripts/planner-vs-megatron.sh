#!/usr/bin/env bash
# The planner against the GPT runs in Table 1 of Narayanan et al.,
# "Efficient Large-Scale Language Model Training on GPU Clusters Using
# Megatron-LM" (SC 2021, arXiv:2104.04473), on the shipped A100 profile.
# Each row's model (hidden size, heads, layers; sequences of 2048 tokens, a
# vocabulary of 51,200), GPUs and global batch:
#
# - the published layout (tensor and pipeline degrees, full activation
#   recomputation, micro-batches of 1) evaluated by `tessera plan
#   --evaluate`, its throughput in the paper's own measure (its equation 3,
#   which counts the recomputed forward) beside the published teraFLOP/s
#   per GPU;
# - the layout `tessera plan` chooses with the features the paper's runs
#   had (no sequence parallelism, no ZeRO, full recomputation, the
#   schedules it had, not ZB-H1: `--fix`),
#   beside the published one with the same fixed parts and its own best
#   micro-batch and schedule: how much faster the planner thinks its
#   choice is.
#
# Prints one JSON line per row.
#
#   scripts/planner-vs-megatron.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p tessera-cli >&2
tessera=target/release/tessera
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
megatron=(--fix sp=false --fix zero=0 --fix recompute=full --fix schedule=gpipe,1f1b,interleaved)

# The estimated step (seconds) and layout of the best plan `tessera plan` writes.
best() {
    "$tessera" plan --model "$dir/model.toml" --cluster a100-sxm4-80gb --nodes "$1" --global-batch "$2" --out "$dir/plan.toml" "${@:3}" >/dev/null
    head -1 "$dir/plan.toml" | sed -E 's/.*plan`: (.*), estimated ([0-9.]+) s per step.*/\2 \1/'
}

# params (B), heads, hidden, layers, tp, pp, GPUs, batch, published TFLOP/s per GPU
while read -r params heads hidden layers tp pp gpus batch published; do
    dp=$((gpus / (tp * pp)))
    nodes=$(((gpus + 7) / 8))
    cat > "$dir/model.toml" <<TOML
[model]
kind = "gpt2"
n_layer = $layers
n_embd = $hidden
n_head = $heads
vocab_size = 51200
n_positions = 2048
[batch]
seq_len = 2048
[precision]
compute = "bf16"
TOML
    cp "$dir/model.toml" "$dir/run.toml"
    cat >> "$dir/run.toml" <<TOML
[mesh]
dp = $dp
tp = $tp
pp = $pp
[recompute]
mode = "full"
TOML
    sed -i "s/^seq_len = 2048/seq_len = 2048\nmicro_batch = 1\ngrad_accum = $((batch / dp))/" "$dir/run.toml"
    line=$("$tessera" plan --model "$dir/run.toml" --cluster a100-sxm4-80gb --nodes $nodes --evaluate)
    chosen=$(best $nodes "$batch" "${megatron[@]}")
    theirs=$(best $nodes "$batch" "${megatron[@]}" --fix tp=$tp --fix pp=$pp)
    python3 - "$line" "$params" "$hidden" "$layers" "$gpus" "$batch" "$published" "$chosen" "$theirs" <<'PY'
import json, sys
e = json.loads(sys.argv[1])
params, h, l, gpus, batch, published = float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), float(sys.argv[7])
(chosen_s, chosen), (theirs_s, theirs) = [(float(a.split(" ", 1)[0]), a.split(" ", 1)[1]) for a in sys.argv[8:10]]
s, v = 2048, 51200
flops = 96 * batch * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))  # the paper's equation 3
predicted = flops / (e["step_s"] * gpus) / 1e12
print(json.dumps({"params_b": params, "layout": e["layout"], "gpus": gpus, "predicted_tflops_per_gpu": round(predicted, 1),
                  "published_tflops_per_gpu": published, "ratio": round(predicted / published, 2), "memory_gib": round(e["memory_bytes"] / 2**30, 1),
                  "planner_choice": chosen, "published_layout_best": theirs, "published_over_choice": round(theirs_s / chosen_s, 3)}))
PY
done <<'ROWS'
1.7 24 2304 24 1 1 32 512 137
3.6 32 3072 30 2 1 64 512 138
7.5 32 4096 36 4 1 128 512 142
18.4 48 6144 40 8 1 256 1024 135
39.1 64 8192 48 8 2 512 1536 138
76.1 80 10240 60 8 4 1024 1792 140
145.6 96 12288 80 8 8 1536 2304 148
310.1 128 16384 96 8 16 1920 2160 155
ROWS
