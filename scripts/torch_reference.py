#!/usr/bin/env python3
"""PyTorch references for scripts/gpu-check.sh, one JSON line per case.

The same three measurements as `bench cuda` (examples/bench/cuda.rs), made
the same way (warm-up, then whole iterations between synchronisations):

  gemm       torch.matmul of two square bf16 matrices (--size)
  fp8-gemm   torch._scaled_mm of the same matrices cast to E4M3 at each call
             (bf16 output), as `bench cuda fp8-gemm` encodes at each call
  attention  F.scaled_dot_product_attention, causal, forward and backward,
             on a GPT-2 layer's shape (--batch, --seq, 12 heads of 64)
  gpt2       GPT-2 124M training steps in eager mode (bf16 autocast, f32
             weights, fused AdamW), the configuration `bench cuda gpt2` runs

A reference for comparisons only; no part of the framework.
"""
import argparse
import json
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def timed(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters


def gemm(args):
    n = args.size
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    s = timed(lambda: a @ b, 3, args.iters)
    return {"case": "gemm", "size": n, "dtype": "bf16", "ms": s * 1e3, "tflops": 2 * n**3 / s / 1e12}


def fp8_gemm(args):
    n = args.size
    a = (torch.randn(n, n, device="cuda") * 0.1).to(torch.bfloat16)
    b = (torch.randn(n, n, device="cuda") * 0.1).to(torch.bfloat16)
    one = torch.tensor(1.0, device="cuda")
    fp8 = torch.float8_e4m3fn

    def step():
        # _scaled_mm takes the second operand column-major: b's transpose, as a linear layer's weight.
        return torch._scaled_mm(a.to(fp8), b.to(fp8).t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    s = timed(step, 3, args.iters)
    return {"case": "fp8-gemm", "size": n, "dtype": "e4m3", "out": "bf16", "ms": s * 1e3, "tflops": 2 * n**3 / s / 1e12}


def attention(args):
    b, t, h, d = args.batch, args.seq, 12, 64
    q, k, v = (torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dy = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16)
    fwd = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), 3, args.iters)

    def fwd_bwd():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(dy)

    both = timed(fwd_bwd, 3, args.iters)
    fwd_flops = 4 * b * h * t * t * d * 0.5
    return {"case": "attention", "batch": b, "seq": t, "fwd_ms": fwd * 1e3, "bwd_ms": (both - fwd) * 1e3,
            "fwd_tflops": fwd_flops / fwd / 1e12, "tflops": 3.5 * fwd_flops / both / 1e12}


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class Gpt2(nn.Module):
    def __init__(self, vocab=50304, d=768, h=12, layers=12, ctx=1024):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.h = nn.ModuleList(Block(d, h) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        # GPT-2's initialisation (as `bench cuda gpt2`): PyTorch's default
        # N(0, 1) embedding, tied to the head, starts the loss near 90.
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def gpt2(args):
    torch.manual_seed(1)
    model = Gpt2(ctx=args.seq).cuda()
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    tokens = args.batch * args.seq
    ids = torch.tensor([(i * 7919 + i // 3) % 50257 for i in range(tokens + 1)], device="cuda")
    x, y = ids[:-1].view(args.batch, args.seq), ids[1:].view(args.batch, args.seq)
    last = {}

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        last["loss"] = loss

    s = timed(step, 2, args.iters)
    layers, d = 12, 768
    flops = (6 * params + 12 * layers * args.seq * d) * tokens
    return {"case": "gpt2", "params": params, "batch": args.batch, "seq": args.seq, "step_ms": s * 1e3,
            "tokens_per_s": tokens / s, "tflops": flops / s / 1e12, "mfu": flops / s / 1e12 / args.peak_tflops,
            "loss": float(last["loss"])}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("case", choices=["gemm", "fp8-gemm", "attention", "gpt2"])
    p.add_argument("--size", type=int, default=8192)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    args = p.parse_args()
    result = {"gemm": gemm, "fp8-gemm": fp8_gemm, "attention": attention, "gpt2": gpt2}[args.case](args)
    result = {"bench": "torch", **{k: (round(v, 4) if isinstance(v, float) and math.isfinite(v) else v) for k, v in result.items()}}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
