#!/usr/bin/env bash
# The GPU check: runs the CUDA tests and the GPU benchmarks against PyTorch in
# the same run, and writes the figures to a file. Two steps, because the GPU
# machine may have no Rust toolchain and no network:
#
#   scripts/gpu-check.sh prepare        # where cargo works: builds gpu-bundle/
#   scripts/gpu-check.sh run [OUT]      # on the GPU machine (PyTorch installed)
#
# `run` builds the bundle itself when it is missing and cargo is there. It
# prints and writes (to OUT, default gpu-check.jsonl) one JSON line per test
# binary and per benchmark, then the ratios the CUDA issue sets as targets:
#   gemm       bf16 8192³ through cuBLAS vs torch.matmul        (target ≥ 0.9)
#   fp8-gemm   E4M3 8192³ through cuBLASLt vs torch._scaled_mm   (reported)
#   gpt2       GPT-2 124M bf16 training tokens/s vs torch eager (target ≥ 1.0)
#   attention  fused causal attention forward+backward TFLOP/s (reported)
# and the planner's profile of the node (`tessera profile --device cuda`).
# Each step has a time limit, so the whole run stays within 7 minutes, and the
# full output of every step is kept in OUT's -logs.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
bundle=gpu-bundle
mode=${1:-run}

prepare() {
    set -e
    echo "gpu-check: building the benchmark and the GPU test binaries (release, --features cuda)" >&2
    cargo build --release --features cuda --example bench
    cargo build --release --features cuda -p tessera-cli
    local tests
    tests=$(cargo test --release --features cuda -p tessera-tests --test cuda --test cuda_ops --test nccl --test trainer --no-run \
        --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"] + " " + m["executable"])')
    rm -rf "$bundle" && mkdir -p "$bundle"
    cp target/release/examples/bench "$bundle/bench"
    cp target/release/tessera "$bundle/tessera"
    while read -r name exe; do cp "$exe" "$bundle/test-$name"; done <<<"$tests"
    strip "$bundle"/* 2>/dev/null || true
    du -sh "$bundle" >&2
    set +e
}

# Directory of unversioned names for the CUDA libraries found on this machine
# (PyTorch's NVIDIA wheels, then the toolkit): the bindings look for
# libnvrtc.so, libcublas.so, libcublasLt.so and libnccl.so among others, and a
# machine may carry a newer major version than the one they name.
cuda_libs() {
    local dir=/tmp/tessera-cuda-libs
    mkdir -p "$dir"
    local roots
    roots=$(python3 - <<'EOF' 2>/dev/null
import glob, os, site
dirs = []
for p in site.getsitepackages():
    dirs += glob.glob(os.path.join(p, "nvidia", "*", "lib")) + glob.glob(os.path.join(p, "nvidia", "cu*", "lib"))
print("\n".join(sorted(set(dirs))))
EOF
)
    for lib in nvrtc cublas cublasLt nccl; do
        local found=""
        for d in $roots /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu; do
            found=$(ls "$d"/lib"$lib".so* 2>/dev/null | sort -V | tail -1)
            [ -n "$found" ] && break
        done
        if [ -n "$found" ]; then
            ln -sf "$found" "$dir/lib$lib.so"
            echo "gpu-check: lib$lib.so -> $found" >&2
        else
            echo "gpu-check: lib$lib.so not found; what needs it will report that" >&2
        fi
    done
    echo "$dir"
}

run() {
    local out=${1:-gpu-check.jsonl}
    : >"$out"
    # Every step's full output, kept beside OUT as one archive at the end.
    local logs=${out%.jsonl}-logs
    rm -rf "$logs" && mkdir -p "$logs"
    if [ ! -x "$bundle/bench" ]; then
        command -v cargo >/dev/null || { echo "gpu-check: no $bundle/ and no cargo here; run 'scripts/gpu-check.sh prepare' where cargo works and bring $bundle/" >&2; exit 1; }
        prepare
    fi
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a /dev/stderr |
        python3 -c 'import json,sys; n,d,m=[s.strip() for s in sys.stdin.read().split(",")]; print(json.dumps({"check":"gpu","name":n,"driver":d,"memory":m}))' >>"$out"
    export LD_LIBRARY_PATH="$(cuda_libs)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export TESSERA_KERNEL_CACHE=${TESSERA_KERNEL_CACHE:-/tmp/tessera-kernel-cache}

    # The GPU tests: each binary with a time limit, all at once (they share the
    # GPU's memory, which is ample; device time is what the check is short of);
    # failures are recorded, not fatal.
    local t pids=()
    for t in "$bundle"/test-*; do
        local name=${t##*/test-}
        # Of the trainer's tests only the GPU run; the rest are the CPU suite's.
        local filter=()
        [ "$name" = trainer ] && filter=(gpu)
        timeout 150 "$t" --test-threads=1 "${filter[@]}" >"$logs/tests-$name.log" 2>&1 &
        pids+=("$!:$name")
    done
    local entry
    for entry in "${pids[@]}"; do
        wait "${entry%%:*}"
        local rc=$? name=${entry#*:}
        local log=$logs/tests-$name.log summary skipped
        summary=$(grep -E '^test result:' "$log" | tail -1)
        # A test that cannot run here (two GPUs on a one-GPU machine) passes
        # after printing why; count those apart from the ones that ran.
        skipped=$(grep -c 'skipped: ' "$log")
        echo "gpu-check: tests $name: rc=$rc $summary ($skipped skipped)" >&2
        grep -E 'FAILED|panicked|skipped: ' "$log" | cut -c1-200 | head -20 >&2
        python3 -c 'import json,sys; print(json.dumps({"check":"tests","binary":sys.argv[1],"rc":int(sys.argv[2]),"summary":sys.argv[3],"skipped":int(sys.argv[4])}))' "$name" "$rc" "$summary" "$skipped" >>"$out"
    done

    # The benchmarks, Tessera then PyTorch for each case, in the same run.
    local case
    for case in gemm fp8-gemm attention gpt2; do
        local ours theirs
        ours=$(RUST_BACKTRACE=1 timeout 90 "$bundle/bench" cuda "$case" 2>"$logs/bench-$case.log" | tail -1)
        [ -n "$ours" ] || ours=$(python3 -c 'import json,sys; print(json.dumps({"bench":"cuda","case":sys.argv[1],"error":sys.argv[2]}))' "$case" "$(tail -3 "$logs/bench-$case.log")")
        theirs=$(timeout 60 python3 scripts/torch_reference.py "$case" 2>"$logs/torch-$case.log" | tail -1)
        [ -n "$theirs" ] || theirs=$(python3 -c 'import json,sys; print(json.dumps({"bench":"torch","case":sys.argv[1],"error":sys.argv[2]}))' "$case" "$(tail -3 "$logs/torch-$case.log")")
        echo "$ours" | tee -a "$out"
        echo "$theirs" | tee -a "$out"
    done

    # CPU ranks with cores to spare for their communication threads (the
    # development machine has two, which the ranks' products fill): how much
    # tensor-parallel communication overlapping it with the products hides.
    RUST_BACKTRACE=0 timeout 60 "$bundle/bench" tp-overlap --tp 2 --threads-per-rank 4 --pieces 2 2>/dev/null | tail -1 | tee -a "$out"

    # The planner's profile of this node: cuBLAS products by shape, NCCL's
    # all-reduce by group size (the profile itself is kept beside OUT).
    local gpus profile=${out%.jsonl}-profile.toml
    gpus=$(nvidia-smi -L | wc -l)
    if RUST_BACKTRACE=1 timeout 60 "$bundle/tessera" profile --device cuda --gpus "$gpus" --seconds-per-figure 0.1 --name this-node --out "$profile" 2>"$logs/profile.log"; then
        python3 - "$profile" <<'EOF' | tee -a "$out"
import json, sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))
d = p["device"]
best = {dt: max((r for r in d["matmul"] if r["dtype"] == dt), key=lambda r: r["flops"]) for dt in ("f32", "bf16")}
print(json.dumps({"check": "profile", "device": d["name"], "memory_gib": round(d["memory_bytes"] / 2**30, 1),
                  "memory_bandwidth_gbs": round(d["memory_bandwidth"] / 1e9, 1),
                  "best_tflops": {dt: round(r["flops"] / 1e12, 1) for dt, r in best.items()},
                  "best_shape": {dt: [r["m"], r["n"], r["k"]] for dt, r in best.items()},
                  "attention_tflops": {k: round(v / 1e12, 1) for k, v in d.get("attention_flops", {}).items()},
                  "all_reduce": [{"gpus": f["size"], "latency_us": round(f["latency"] * 1e6, 1), "bandwidth_gbs": round(f["bandwidth"] / 1e9, 1)} for f in p["intra_node"].get("by_size", [])]}))
EOF
    else
        python3 -c 'import json,sys; print(json.dumps({"check":"profile","error":sys.argv[1]}))' "$(tail -3 "$logs/profile.log")" | tee -a "$out"
    fi

    # The same node as a job of processes with a GPU each (NCCL ids through
    # the job's store), the path a profile of several nodes takes.
    local job_profile=${out%.jsonl}-job-profile.toml
    if RUST_BACKTRACE=1 timeout 60 "$bundle/tessera" launch --nproc-per-node "$gpus" -- "$bundle/tessera" profile --device cuda --seconds-per-figure 0.05 --name this-job --out "$job_profile" 2>"$logs/job-profile.log"; then
        python3 - "$job_profile" <<'EOF' | tee -a "$out"
import json, sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))
print(json.dumps({"check": "profile_job", "gpus_per_node": p["gpus_per_node"], "device": p["device"]["name"],
                  "all_reduce": [{"gpus": f["size"], "latency_us": round(f["latency"] * 1e6, 1), "bandwidth_gbs": round(f["bandwidth"] / 1e9, 1)} for f in p["intra_node"].get("by_size", [])]}))
EOF
    else
        python3 -c 'import json,sys; print(json.dumps({"check":"profile_job","error":sys.argv[1]}))' "$(tail -3 "$logs/job-profile.log")" | tee -a "$out"
    fi

    # Ratios against the targets.
    python3 - "$out" <<'EOF' | tee -a "$out"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
get = lambda bench, case: next((r for r in rows if r.get("bench") == bench and r.get("case") == case), {})
for case, key, target in [("gemm", "tflops", 0.9), ("gpt2", "tokens_per_s", 1.0), ("attention", "tflops", None), ("fp8-gemm", "tflops", None)]:
    a, b = get("cuda", case), get("torch", case)
    ratio = a[key] / b[key] if key in a and key in b and b[key] else None
    print(json.dumps({"check": "ratio", "case": case, "measure": key, "tessera": a.get(key), "torch": b.get(key),
                      "ratio": ratio, "target": target, "met": None if ratio is None or target is None else ratio >= target}))
EOF
    tar czf "$logs.tgz" -C "$(dirname "$logs")" "$(basename "$logs")" && rm -rf "$logs"
    echo "gpu-check: figures in $out, every step's output in $logs.tgz" >&2
}

case "$mode" in
    prepare) prepare ;;
    run) shift; run "$@" ;;
    *) echo "usage: scripts/gpu-check.sh [prepare | run [OUT]]" >&2; exit 2 ;;
esac
