"""Interleaved comparison of Tessera's bf16 CPU work with PyTorch's; run through
bench-bf16-vs-torch.sh, which prepares the venv and builds the benchmark.

Each round measures both sides back to back (alternating which goes first),
each in its own process; the reported ratios are medians over rounds of the
per-round ratios, so a burst of background load during one round cannot bias
the result. The ratio of each side's best round is reported too.

The PyTorch model is gpt-tiny as examples/bench/gpt.rs builds it with
tessera-models' GPT-2: 6 layers, 6 heads, width 384, context 256, vocabulary
65, learned positions, pre-norm blocks with biased linear layers, tanh GELU,
a final LayerNorm and an output head tied to the token embedding, no
dropout; batch 8, AdamW (lr 1e-4, betas 0.9/0.95, eps 1e-8, weight decay
0.1), the same token ids. bf16 autocast runs the products (and attention)
in bf16 with f32 weights, as Tessera's mixed precision does.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

TORCH_PROBE = r"""
import json, math, statistics, sys, time
import torch
import torch.nn as nn
import torch.nn.functional as F

case = sys.argv[1]

def matmul(size, reps, min_time):
    torch.manual_seed(0)
    a = (torch.rand(size, size) * 2 - 1).bfloat16()
    b = (torch.rand(size, size) * 2 - 1).bfloat16()
    c = torch.empty(size, size, dtype=torch.bfloat16)
    flops = 2.0 * size ** 3
    t0, n = time.perf_counter(), 0
    while n < 2 or time.perf_counter() - t0 < min_time:
        torch.matmul(a, b, out=c)
        n += 1
    inner = max(1, math.ceil(min_time / ((time.perf_counter() - t0) / n)))
    rates = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner):
            torch.matmul(a, b, out=c)
        rates.append(flops * inner / (time.perf_counter() - t) / 1e9)
    return {"gflops": statistics.median(rates), "best_gflops": max(rates)}

class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln_1, self.ln_2 = nn.LayerNorm(d, eps=1e-5), nn.LayerNorm(d, eps=1e-5)
        self.c_attn, self.attn_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.attn_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

class Gpt(nn.Module):
    def __init__(self, vocab, d, h, layers, ctx):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.h = nn.ModuleList(Block(d, h) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d, eps=1e-5)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))

def gpt(dtype, steps):
    vocab, d, h, layers, ctx, batch = 65, 384, 6, 6, 256, 8
    torch.manual_seed(1)
    model = Gpt(vocab, d, h, layers, ctx)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    tokens = batch * ctx
    ids = torch.tensor([(i * 7919 + i // 3) % vocab for i in range(tokens + 1)])
    x, y = ids[:-1].view(batch, ctx), ids[1:].view(batch, ctx)
    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=(dtype == "bf16")):
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, vocab), y.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)
    step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t)
    s = statistics.median(times)
    return {"params": params, "step_ms": s * 1e3, "tokens_per_s": tokens / s, "loss": loss}

if case == "matmul":
    out = matmul(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
elif case == "gpt":
    out = gpt(sys.argv[2], int(sys.argv[3]))
elif case == "info":
    out = {"torch": torch.__version__, "threads": torch.get_num_threads(), "mkldnn": torch.backends.mkldnn.is_available(),
           "cpu_capability": torch.backends.cpu.get_cpu_capability()}
print(json.dumps(out))
"""


def run_json(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def torch_probe(*args):
    return run_json([sys.executable, "-c", TORCH_PROBE, *[str(a) for a in args]])


def rounds(n, first, second):
    """Runs `first` and `second` once per round, alternating which goes first."""
    results = []
    for r in range(n):
        if r % 2 == 0:
            a = first()
            b = second()
        else:
            b = second()
            a = first()
        results.append((a, b))
    return results


def r3(x):
    return round(x, 3)


def matmul_case(args):
    s = args.size
    res = rounds(
        args.rounds,
        lambda: run_json([args.bench, "matmul", "--dtype", "bf16", "--sizes", str(s), "--reps", str(args.reps), "--min-time", str(args.min_time)]),
        lambda: torch_probe("matmul", s, args.reps, args.min_time),
    )
    ratios = []
    for i, (t, p) in enumerate(res):
        ratios.append(t["gflops"] / p["gflops"])
        print(f"matmul {s} round {i}: tessera {t['gflops']:.1f} torch {p['gflops']:.1f} GFLOP/s ratio {ratios[-1]:.3f}", file=sys.stderr)
    tess = [t["gflops"] for t, _ in res]
    torch = [p["gflops"] for _, p in res]
    print(json.dumps({
        "bench": "bf16_matmul_vs_torch",
        "case": str(s),
        "tessera_gflops": round(statistics.median(tess), 1),
        "torch_gflops": round(statistics.median(torch), 1),
        "ratio": r3(statistics.median(ratios)),
        "tessera_best_gflops": round(max(tess), 1),
        "torch_best_gflops": round(max(torch), 1),
        "best_ratio": r3(max(tess) / max(torch)),
        "rounds": args.rounds,
    }), flush=True)


def gpt_case(args):
    res = rounds(
        args.rounds,
        lambda: run_json([args.bench, "gpt", "--dtype", "bf16", "--vs-f32", "--steps", str(args.steps)]),
        lambda: torch_probe("gpt", "bf16", args.steps),
    )
    vs_f32, vs_torch = [], []
    for i, (t, p) in enumerate(res):
        vs_f32.append(t["ratio_vs_f32"])
        vs_torch.append(t["tokens_per_s"] / p["tokens_per_s"])
        print(f"gpt-tiny round {i}: tessera bf16 {t['step_ms']:.0f} ms, tessera f32 {t['f32_step_ms']:.0f} ms, "
              f"torch bf16 autocast {p['step_ms']:.0f} ms; bf16/f32 {vs_f32[-1]:.3f}, bf16/torch {vs_torch[-1]:.3f}", file=sys.stderr)
    med = lambda k, side: statistics.median(x[side][k] for x in res)
    best = lambda k, side: max(x[side][k] for x in res)
    print(json.dumps({
        "bench": "bf16_gpt_vs_torch",
        "case": "gpt-tiny",
        "tessera_bf16_tokens_per_s": round(med("tokens_per_s", 0), 1),
        "tessera_f32_tokens_per_s": round(med("f32_tokens_per_s", 0), 1),
        "torch_bf16_tokens_per_s": round(med("tokens_per_s", 1), 1),
        "ratio_vs_tessera_f32": r3(statistics.median(vs_f32)),
        "ratio_vs_torch_bf16": r3(statistics.median(vs_torch)),
        "best_ratio_vs_tessera_f32": r3(best("tokens_per_s", 0) / best("f32_tokens_per_s", 0)),
        "best_ratio_vs_torch_bf16": r3(best("tokens_per_s", 0) / best("tokens_per_s", 1)),
        "tessera_loss": r3(res[-1][0]["loss"]),
        "torch_loss": r3(res[-1][1]["loss"]),
        "rounds": args.rounds,
        "steps": args.steps,
    }), flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bench", required=True, help="path to the built Tessera bench binary")
    p.add_argument("--cases", default="matmul,gpt")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--size", type=int, default=2048)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--min-time", type=float, default=0.2)
    p.add_argument("--steps", type=int, default=6, help="timed training steps per side and round")
    args = p.parse_args()
    print(json.dumps({"bench": "torch_info", **torch_probe("info")}), file=sys.stderr)
    for case in args.cases.split(","):
        {"matmul": matmul_case, "gpt": gpt_case}[case](args)


if __name__ == "__main__":
    main()
