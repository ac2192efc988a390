//! `bench cuda`: the GPU figures of `scripts/gpu-check.sh`, each one JSON line.
//!
//! * `gemm`: a square matrix product (`--size`, bf16 by default) through the
//!   runtime's cuBLAS path; TFLOP/s.
//! * `fp8-gemm`: the same square product of E4M3 operands with a bf16
//!   output, as a linear layer under FP8 runs it (the codes encoded from the
//!   operands' values at each call, then cuBLASLt on the FP8 tensor cores);
//!   TFLOP/s.
//! * `attention`: the fused causal attention forward and backward on the
//!   packed q/k/v layout of a GPT-2 layer (`--batch`, `--seq`, 12 heads of
//!   64); TFLOP/s counted as FlashAttention's benchmarks count them
//!   (`4·b·h·T²·d`, halved for the causal mask, backward 2.5× the forward).
//! * `gpt2`: GPT-2 124M training steps (12 layers, 12 heads, width 768,
//!   vocabulary 50257 padded to 50304, `--seq` 1024, `--batch`), bf16 compute
//!   with f32 master weights, AdamW; tokens/s and MFU against `--peak-tflops`
//!   (the GPU's dense bf16 rate), counting `6·N + 12·L·T·d` FLOPs per token.
//!   Then one more step in phases (`phases`: forward, loss, backward,
//!   optimizer), each from an idle device: the host's time to queue it, the
//!   time until the device has run it, and the device work it asked for.
//!
//! Every case times whole iterations between device synchronisations, after
//! warm-up iterations that compile and cache the kernels.

use anyhow::{bail, Result};
use std::time::Instant;
use tessera::module::{self, Cx, Module, RecomputeOverride};
use tessera::observe::transformer_flops_per_token;
use tessera::ops::{self, AttnOpts, QkvHeads};
use tessera::optim::{AdamW, AdamWConfig};
use tessera::prelude::*;
use tessera::{Init, RngKey};
use tessera_models::gpt2::{Gpt2, Gpt2Config};

/// What `bench cuda` measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Case {
    Gemm,
    Fp8Gemm,
    Attention,
    Gpt2,
}

/// Arguments of `bench cuda`.
#[derive(clap::Args)]
pub struct Args {
    /// What to measure.
    #[arg(value_enum)]
    case: Case,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// `gemm`: m = k = n.
    #[arg(long, default_value_t = 8192)]
    size: usize,
    /// `gemm`: element type (f32, bf16 or f16).
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// `attention`, `gpt2`: sequences per step.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// `attention`, `gpt2`: sequence length.
    #[arg(long, default_value_t = 1024)]
    seq: usize,
    /// Timed iterations (after warm-up).
    #[arg(long, default_value_t = 10)]
    iters: usize,
    /// `gpt2`: the GPU's dense bf16 peak in TFLOP/s, for MFU (H100 / H200 SXM: 989).
    #[arg(long, default_value_t = 989.0)]
    peak_tflops: f64,
}

pub fn run(args: &Args) -> Result<()> {
    if args.iters == 0 {
        bail!("--iters must be positive");
    }
    let dev = Device::cuda(args.device)?;
    match args.case {
        Case::Gemm => gemm(args, &dev),
        Case::Fp8Gemm => fp8_gemm(args, &dev),
        Case::Attention => attention(args, &dev),
        Case::Gpt2 => gpt2(args, &dev),
    }
}

fn dtype(name: &str) -> Result<DType> {
    Ok(match name {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        other => bail!("--dtype {other}: use f32, bf16 or f16"),
    })
}

/// Seconds per call of `f`, the mean over `iters` calls after `warmup`,
/// each batch bracketed by device synchronisations.
fn time(dev: &Device, warmup: usize, iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..warmup {
        f()?;
    }
    dev.synchronize()?;
    let t = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    dev.synchronize()?;
    Ok(t.elapsed().as_secs_f64() / iters as f64)
}

fn random(seed: u64, shape: &[usize], dtype: DType, dev: &Device) -> Result<Tensor> {
    Ok(Tensor::rand(Init::Normal { mean: 0.0, std: 1.0 }, RngKey::new(seed, 0), shape.to_vec(), dtype, dev)?)
}

fn gemm(args: &Args, dev: &Device) -> Result<()> {
    let n = args.size;
    let dt = dtype(&args.dtype)?;
    let (a, b) = (random(1, &[n, n], dt, dev)?, random(2, &[n, n], dt, dev)?);
    let s = time(dev, 3, args.iters, || {
        ops::matmul(&a, &b)?;
        Ok(())
    })?;
    let tflops = 2.0 * (n as f64).powi(3) / s / 1e12;
    println!("{}", serde_json::json!({"bench": "cuda", "case": "gemm", "size": n, "dtype": args.dtype, "ms": s * 1e3, "tflops": tflops}));
    Ok(())
}

/// `A · Bᵀ` of E4M3 operands (`--size` square, bf16 values, bf16 output) as a
/// linear layer runs it under FP8: each call encodes both operands' codes
/// and multiplies them on the FP8 tensor cores (`ops::matmul_fp8`).
fn fp8_gemm(args: &Args, dev: &Device) -> Result<()> {
    let n = args.size;
    let fmt = ops::Fp8Format::E4M3;
    let a = ops::fp8_values(&random(1, &[n, n], DType::BF16, dev)?, fmt, 16.0)?;
    let b = ops::fp8_values(&random(2, &[n, n], DType::BF16, dev)?, fmt, 16.0)?;
    let bt = b.t()?;
    let s = time(dev, 3, args.iters, || {
        ops::matmul_fp8(&a, fmt, &bt, fmt, 1.0 / 256.0)?;
        Ok(())
    })?;
    let tensor_cores = match dev {
        Device::Cuda(d) => d.has_fp8_tensor_cores(),
        Device::Cpu(_) => false,
    };
    let tflops = 2.0 * (n as f64).powi(3) / s / 1e12;
    println!(
        "{}",
        serde_json::json!({"bench": "cuda", "case": "fp8-gemm", "size": n, "dtype": "e4m3", "out": "bf16", "fp8_tensor_cores": tensor_cores, "ms": s * 1e3, "tflops": tflops})
    );
    Ok(())
}

fn attention(args: &Args, dev: &Device) -> Result<()> {
    let heads = QkvHeads { q_heads: 12, kv_heads: 12, head_dim: 64 };
    let (b, t) = (args.batch, args.seq);
    let qkv = random(3, &[b, t, heads.width()], DType::BF16, dev)?;
    let dy = random(4, &[b, t, heads.q_heads * heads.head_dim], DType::BF16, dev)?;
    let opts = AttnOpts::causal();
    let fwd = time(dev, 3, args.iters, || {
        ops::attention_packed(&qkv, heads, opts)?;
        Ok(())
    })?;
    let (out, lse) = ops::attention_packed(&qkv, heads, opts)?;
    let bwd = time(dev, 3, args.iters, || {
        ops::attention_packed_backward(&qkv, &out, &lse, &dy, heads, opts)?;
        Ok(())
    })?;
    let fwd_flops = 4.0 * (b * heads.q_heads * t * t * heads.head_dim) as f64 * 0.5;
    let tflops = 3.5 * fwd_flops / (fwd + bwd) / 1e12;
    println!(
        "{}",
        serde_json::json!({"bench": "cuda", "case": "attention", "batch": b, "seq": t, "heads": 12, "head_dim": 64, "dtype": "bf16",
            "fwd_ms": fwd * 1e3, "bwd_ms": bwd * 1e3, "fwd_tflops": fwd_flops / fwd / 1e12, "tflops": tflops})
    );
    Ok(())
}

fn gpt2(args: &Args, dev: &Device) -> Result<()> {
    const VOCAB: usize = 50304;
    let (layers, width, heads) = (12, 768, 12);
    let mut cx = Cx::new(dev.clone()).with_seed(1).with_dtype(DType::BF16);
    cx.set_recompute_override(RecomputeOverride::Off);
    let model = module::build(Gpt2::new(&Gpt2Config::tiny(VOCAB, width, heads, layers, args.seq))?, &cx)?;
    let mut opt = AdamW::new(&model, AdamWConfig { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 })?;
    let params: usize = module::distinct_params(&model)?.iter().map(|n| n.param.global_shape().elem_count()).sum();
    let tokens = args.batch * args.seq;
    let ids: Vec<u32> = (0..tokens + 1).map(|i| ((i * 7919 + i / 3) % 50257) as u32).collect();
    let x = Tensor::from_vec(ids[..tokens].to_vec(), [args.batch, args.seq], dev)?;
    let y = Tensor::from_vec(ids[1..].to_vec(), [args.batch, args.seq], dev)?;
    let mut loss = Tensor::zeros([1], DType::F32, dev)?;
    let s = time(dev, 2, args.iters, || {
        let (logits, saved) = model.forward(&mut cx, Act::new(x.clone()))?;
        let (l, ce) = ops::cross_entropy(logits.tensor(), &y, None)?;
        let dlogits = ops::cross_entropy_backward(logits.tensor(), &y, None, &ce, 1.0)?;
        drop(logits);
        model.backward(&mut cx, saved, Act::new(dlogits))?;
        opt.step(1e-4)?;
        opt.zero_grad();
        loss = l;
        Ok(())
    })?;

    // The same step once more in phases, each between synchronisations:
    // the host's time to queue a phase against the time until the device has
    // run it, and what the phase asked of the device. A phase whose host
    // time is near its device time is bound by the host (launches, uploads,
    // reads back), not by its kernels.
    let mut phases = Phases::new(dev)?;
    let (logits, saved) = phases.time("forward", || Ok(model.forward(&mut cx, Act::new(x.clone()))?))?;
    let dlogits = phases.time("loss", || {
        let (_, ce) = ops::cross_entropy(logits.tensor(), &y, None)?;
        Ok(ops::cross_entropy_backward(logits.tensor(), &y, None, &ce, 1.0)?)
    })?;
    drop(logits);
    phases.time("backward", || Ok(model.backward(&mut cx, saved, Act::new(dlogits))?))?;
    phases.time("optimizer", || {
        opt.step(1e-4)?;
        opt.zero_grad();
        Ok(())
    })?;

    let flops = transformer_flops_per_token(params, layers, args.seq, width) * tokens as f64;
    println!(
        "{}",
        serde_json::json!({"bench": "cuda", "case": "gpt2", "params": params, "batch": args.batch, "seq": args.seq, "dtype": "bf16",
            "step_ms": s * 1e3, "tokens_per_s": tokens as f64 / s, "tflops": flops / s / 1e12, "mfu": flops / s / 1e12 / args.peak_tflops,
            "loss": loss.to_dtype(DType::F32)?.to_vec::<f32>()?.first().copied(), "phases": phases.rows})
    );
    Ok(())
}

/// Phases of a step timed one at a time (see `gpt2`).
struct Phases<'a> {
    dev: &'a Device,
    rows: Vec<serde_json::Value>,
}

impl<'a> Phases<'a> {
    fn new(dev: &'a Device) -> Result<Self> {
        dev.synchronize()?;
        Ok(Phases { dev, rows: Vec::new() })
    }

    /// Runs `f` from an idle device: the host's time to return, the time
    /// until the device is idle again, and the device work between.
    fn time<T>(&mut self, name: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let work = || match self.dev {
            Device::Cuda(d) => d.work(),
            Device::Cpu(_) => Default::default(),
        };
        let before = work();
        let t = Instant::now();
        let out = f()?;
        let host = t.elapsed().as_secs_f64();
        self.dev.synchronize()?;
        let device = t.elapsed().as_secs_f64();
        let w = work() - before;
        self.rows.push(serde_json::json!({"phase": name, "host_ms": host * 1e3, "device_ms": device * 1e3,
            "kernels": w.kernels, "gemms": w.gemms, "uploads": w.uploads, "host_reads": w.host_reads}));
        Ok(out)
    }
}
