#!/usr/bin/env bash
# The planner against Megatron-Core's H100 runs: the model table of the
# NVIDIA/Megatron-LM repository's README (images/model_table.png,
# "Performance Benchmarking"): GPT models of 1.7 B to 462 B parameters on 48
# to 6,144 H100 GPUs, sequences of 4,096 tokens, a vocabulary of 131,072,
# each row's tensor, pipeline and data-parallel degrees, global batch and
# measured MFU. Tessera's `gpt2` kind stands for their GPT (a 4h GELU MLP;
# the README does not give the MLP), with Megatron-Core's usual features
# for such runs: sequence parallelism with tensor parallelism, the
# distributed optimizer (ZeRO-1), micro-batches of one, 1F1B.
#
# For each row, on the shipped H100 profile:
# - the published layout estimated by `tessera plan --evaluate`: its MFU
#   beside the published one, and its memory per GPU;
# - the layout `tessera plan` chooses for the same GPUs and batch, and how
#   much faster it thinks its choice is than the published degrees (with
#   their best micro-batch, schedule, recompute and ZeRO stage), the
#   schedules those of Megatron-Core (with ZB_H1=1, ZB-H1 too).
#
# Prints one JSON line per row.
#
#   scripts/planner-vs-megatron-core.sh
#   ZB_H1=1 scripts/planner-vs-megatron-core.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p tessera-cli >&2
tessera=target/release/tessera
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

# The schedules Megatron-Core runs (not ZB-H1), so that the comparison is
# of the degrees; `ZB_H1=1` lets the planner choose it too.
schedules=(--fix schedule=gpipe,1f1b,interleaved)
[ "${ZB_H1:-0}" = 1 ] && schedules=()

# The estimated step (seconds) and layout of the best plan `tessera plan` writes.
best() {
    "$tessera" plan --model "$dir/model.toml" --cluster h100-sxm5-80gb --nodes "$1" --global-batch "$2" --out "$dir/plan.toml" "${@:3}" >/dev/null 2>&1 || { echo "inf none"; return; }
    head -1 "$dir/plan.toml" | sed -E 's/.*plan`: (.*), estimated ([0-9.]+) s per step.*/\2 \1/'
}

# params (B), heads, hidden, layers, tp, pp, dp, GPUs, batch, published MFU (%)
while read -r params heads hidden layers tp pp dp gpus batch mfu; do
    nodes=$(((gpus + 7) / 8))
    cat > "$dir/model.toml" <<TOML
[model]
kind = "gpt2"
n_layer = $layers
n_embd = $hidden
n_head = $heads
vocab_size = 131072
n_positions = 4096
[batch]
seq_len = 4096
[precision]
compute = "bf16"
TOML
    sed -e "s/^seq_len = 4096/seq_len = 4096\nmicro_batch = 1\ngrad_accum = $((batch / dp))/" "$dir/model.toml" > "$dir/run.toml"
    sp=false; [ "$tp" -gt 1 ] && sp=true
    printf '[mesh]\ndp = %s\ntp = %s\npp = %s\nsp = %s\n[zero]\nstage = 1\n' "$dp" "$tp" "$pp" "$sp" >> "$dir/run.toml"
    line=$("$tessera" plan --model "$dir/run.toml" --cluster h100-sxm5-80gb --nodes $nodes --evaluate)
    chosen=$(best $nodes "$batch" "${schedules[@]}")
    theirs=$(best $nodes "$batch" "${schedules[@]}" --fix tp=$tp --fix pp=$pp --fix dp=$dp)
    python3 - "$line" "$params" "$gpus" "$mfu" "$chosen" "$theirs" <<'PY'
import json, sys
e = json.loads(sys.argv[1])
params, gpus, mfu = float(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
(chosen_s, chosen), (theirs_s, theirs) = [(float(a.split(" ", 1)[0]), a.split(" ", 1)[1]) for a in sys.argv[5:7]]
print(json.dumps({"params_b": params, "gpus": gpus, "layout": e["layout"], "predicted_mfu": round(100 * e["mfu"], 1), "published_mfu": mfu,
                  "ratio": round(100 * e["mfu"] / mfu, 2), "memory_gib": round(e["memory_bytes"] / 2**30, 1),
                  "planner_choice": chosen, "published_degrees_best": theirs,
                  "published_over_choice": round(theirs_s / chosen_s, 3) if theirs_s != float("inf") else None}))
PY
done <<'ROWS'
1.7 16 2048 24 1 1 48 48 192 41
7.1 32 4096 30 2 1 48 96 192 47
16 48 6144 32 4 1 48 192 192 49
32 56 7168 48 8 1 48 384 192 46
70 64 8192 84 8 2 48 768 384 42
119 80 10240 92 8 4 48 1536 768 43
177 96 12288 96 8 6 48 2304 1152 44
314 128 16384 96 8 8 48 3072 1536 48
462 144 18432 112 8 16 48 6144 3072 47
ROWS
