//! `bench gpt`: training throughput of gpt-tiny on one rank.
//!
//! gpt-tiny is the character-level GPT of the usual Shakespeare setup:
//! 6 layers, 6 heads, hidden 384, context 256, vocabulary 65, batch 8,
//! AdamW, f32. A step's work is counted as `6·N + 12·L·T·d` FLOPs per token
//! (N weights, L layers, T context, d width); the achieved rate is compared
//! with Tessera's own f32 matmul rate on the model's largest product
//! (`B·T × d × 4d`), measured in the same run, alternating with the
//! training steps so that both see the same machine.
//!
//! Output: a per-op time breakdown (exclusive time of each layer kind,
//! forward and backward, plus loss and optimizer), then JSON lines:
//! `{"bench":"gpt","case":"gpt-tiny","tokens_per_s":..,"gflops":..,"matmul_gflops":..,"ratio":..}`.
//!
//! `--dtype bf16` trains in mixed precision (f32 master weights and
//! optimizer, bf16 activations and products). With `--vs-f32` a second,
//! f32 copy of the same model trains in the same process, its steps
//! alternating with the first's, and the line also carries the f32 step and
//! `ratio_vs_f32` (the first's tokens/s over the f32 copy's).

use anyhow::Result;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tessera::module::{self, Cx, Hooks, Module, RecomputeOverride};
use tessera::observe::{transformer_flops_per_token, PeakRate};
use tessera::ops;
use tessera::optim::{AdamW, AdamWConfig};
use tessera::prelude::*;
use tessera_models::gpt2::{Gpt2, Gpt2Config};

/// Arguments of `bench gpt`.
#[derive(clap::Args)]
pub struct Args {
    /// Timed training steps (after one warm-up step).
    #[arg(long, default_value_t = 4)]
    steps: usize,
    /// Sequences per batch.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Context length.
    #[arg(long, default_value_t = 256)]
    seq: usize,
    /// Print the per-op breakdown (timed through module hooks).
    #[arg(long)]
    breakdown: bool,
    /// Compute dtype of the activations: `f32`, or `bf16` (mixed precision:
    /// f32 master weights and optimizer, bf16 activations and products).
    #[arg(long, default_value = "f32", value_parser = ["f32", "bf16"])]
    dtype: String,
    /// Also train an f32 copy of the model, alternating steps with the
    /// first, and report the ratio of their throughputs.
    #[arg(long)]
    vs_f32: bool,
}

const VOCAB: usize = 65;
const DIM: usize = 384;
const HEADS: usize = 6;
const LAYERS: usize = 6;

/// Exclusive wall time per layer kind (the module path without layer
/// numbers: `h.attn.c_attn`, ...), forward and backward apart; a module's
/// time excludes its children's, so a block's own share is its residual
/// adds and GELU.
#[derive(Default)]
struct Profile {
    stack: Vec<(Instant, Duration)>,
    totals: BTreeMap<String, Duration>,
}

struct Profiler(Mutex<Profile>);

impl Profiler {
    fn kind(path: &str, pass: &str) -> String {
        let numbered = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_digit());
        let name: Vec<&str> = path.split('.').filter(|s| !numbered(s)).collect();
        let name = if path.rsplit('.').next().is_some_and(numbered) { format!("{} (block: residual adds)", name.join(".")) } else { name.join(".") };
        format!("{pass} {name}")
    }

    fn enter(&self) {
        self.0.lock().expect("profile").stack.push((Instant::now(), Duration::ZERO));
    }

    fn exit(&self, path: &str, pass: &str) {
        let mut p = self.0.lock().expect("profile");
        let Some((start, children)) = p.stack.pop() else { return };
        let total = start.elapsed();
        *p.totals.entry(Self::kind(path, pass)).or_default() += total.saturating_sub(children);
        if let Some(parent) = p.stack.last_mut() {
            parent.1 += total;
        }
    }

    fn add(&self, kind: &str, d: Duration) {
        *self.0.lock().expect("profile").totals.entry(kind.to_string()).or_default() += d;
    }

    fn take(&self) -> BTreeMap<String, Duration> {
        std::mem::take(&mut self.0.lock().expect("profile").totals)
    }
}

impl Hooks for Profiler {
    fn before_forward(&self, _path: &str) -> tessera::Result<()> {
        self.enter();
        Ok(())
    }
    fn after_forward(&self, path: &str) -> tessera::Result<()> {
        self.exit(path, "fwd");
        Ok(())
    }
    fn before_backward(&self, _path: &str) -> tessera::Result<()> {
        self.enter();
        Ok(())
    }
    fn after_backward(&self, path: &str) -> tessera::Result<()> {
        self.exit(path, "bwd");
        Ok(())
    }
}

/// One model with its context and optimizer, training on a fixed batch.
struct Run {
    model: Gpt2,
    cx: Cx,
    opt: AdamW,
    x: Tensor,
    y: Tensor,
}

impl Run {
    /// gpt-tiny in `dtype` on `dev`, initialised from seed 1 (the same
    /// weights whatever the dtype: master weights are f32 either way).
    fn new(dev: &Device, dtype: DType, args: &Args, hooks: Option<Arc<Profiler>>) -> Result<Run> {
        let mut cx = Cx::new(dev.clone()).with_seed(1).with_dtype(dtype);
        cx.set_recompute_override(RecomputeOverride::Off);
        if let Some(h) = hooks {
            cx = cx.with_hooks(h);
        }
        let model = module::build(Gpt2::new(&Gpt2Config::tiny(VOCAB, DIM, HEADS, LAYERS, args.seq))?, &cx)?;
        let adamw = AdamWConfig { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 };
        let opt = AdamW::new(&model, adamw)?;
        let tokens = args.batch * args.seq;
        let ids: Vec<u32> = (0..tokens + 1).map(|i| ((i * 7919 + i / 3) % VOCAB) as u32).collect();
        let x = Tensor::from_vec(ids[..tokens].to_vec(), [args.batch, args.seq], dev)?;
        let y = Tensor::from_vec(ids[1..].to_vec(), [args.batch, args.seq], dev)?;
        Ok(Run { model, cx, opt, x, y })
    }

    /// One training step; returns the loss.
    fn step(&mut self, profiler: &Profiler) -> tessera::Result<f64> {
        let (logits, saved) = self.model.forward(&mut self.cx, Act::new(self.x.clone()))?;
        let t = Instant::now();
        let (loss, ce) = ops::cross_entropy(logits.tensor(), &self.y, None)?;
        let dlogits = ops::cross_entropy_backward(logits.tensor(), &self.y, None, &ce, 1.0)?;
        profiler.add("loss (cross-entropy fwd+bwd)", t.elapsed());
        drop(logits);
        self.model.backward(&mut self.cx, saved, Act::new(dlogits))?;
        let t = Instant::now();
        self.opt.step(1e-4)?;
        self.opt.zero_grad();
        profiler.add("optimizer (AdamW)", t.elapsed());
        loss.to_scalar()
    }
}

pub fn run(args: &Args) -> Result<()> {
    let dev = Device::cpu();
    let profiler = Arc::new(Profiler(Mutex::new(Profile::default())));
    let dtype = if args.dtype == "bf16" { DType::BF16 } else { DType::F32 };
    let mut main = Run::new(&dev, dtype, args, args.breakdown.then(|| profiler.clone()))?;
    // The f32 copy is timed but not profiled.
    let quiet = Profiler(Mutex::new(Profile::default()));
    let mut reference = if args.vs_f32 { Some(Run::new(&dev, DType::F32, args, None)?) } else { None };
    let params: usize = module::distinct_params(&main.model)?.iter().map(|n| n.param.global_shape().elem_count()).sum();
    let tokens = args.batch * args.seq;
    let flops = transformer_flops_per_token(params, LAYERS, args.seq, DIM) * tokens as f64;

    main.step(&profiler)?;
    if let Some(r) = &mut reference {
        r.step(&quiet)?;
    }
    profiler.take();
    let (mm_m, mm_k, mm_n) = (tokens, DIM, 4 * DIM);
    let mut step_times = Vec::new();
    let mut ref_times = Vec::new();
    let mut mm_rates = Vec::new();
    let mut loss = 0.0;
    for i in 0..args.steps {
        mm_rates.push(PeakRate::measure_matmul_shape(&dev, mm_m, mm_k, mm_n)?.flops_per_s);
        // Alternate which model goes first, so a burst of other load on the
        // machine is shared out.
        let mut timed_ref = |r: &mut Option<Run>| -> Result<()> {
            if let Some(r) = r {
                let t = Instant::now();
                r.step(&quiet)?;
                ref_times.push(t.elapsed().as_secs_f64());
            }
            Ok(())
        };
        if i % 2 == 1 {
            timed_ref(&mut reference)?;
        }
        let t = Instant::now();
        loss = main.step(&profiler)?;
        step_times.push(t.elapsed().as_secs_f64());
        if i % 2 == 0 {
            timed_ref(&mut reference)?;
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let step_s = median(&mut step_times);
    let mm_gflops = median(&mut mm_rates) / 1e9;
    let gflops = flops / step_s / 1e9;
    if args.breakdown {
        let totals = profiler.take();
        let all: f64 = step_s * args.steps as f64;
        let mut rows: Vec<_> = totals.into_iter().collect();
        rows.sort_by_key(|r| std::cmp::Reverse(r.1));
        println!("gpt-tiny ({}): {params} parameters, {tokens} tokens per step, {:.1} GFLOP per step, loss {loss:.3}", args.dtype, flops / 1e9);
        println!("{:<34} {:>10} {:>7}", "op (exclusive time)", "ms/step", "share");
        for (kind, d) in rows {
            let per_step = d.as_secs_f64() / args.steps as f64;
            println!("{kind:<34} {:>10.1} {:>6.1}%", per_step * 1e3, 100.0 * d.as_secs_f64() / all);
        }
        println!("{:<34} {:>10.1}", "step (median)", step_s * 1e3);
    }
    let mut line = serde_json::json!({
        "bench": "gpt",
        "case": "gpt-tiny",
        "dtype": args.dtype,
        "params": params,
        "loss": loss,
        "tokens_per_s": tokens as f64 / step_s,
        "step_ms": step_s * 1e3,
        "gflops": gflops,
        "matmul_gflops": mm_gflops,
        "matmul_shape": format!("{mm_m}x{mm_k}x{mm_n}"),
        "ratio": gflops / mm_gflops,
    });
    if reference.is_some() {
        let ref_s = median(&mut ref_times);
        line["f32_step_ms"] = serde_json::json!(ref_s * 1e3);
        line["f32_tokens_per_s"] = serde_json::json!(tokens as f64 / ref_s);
        line["ratio_vs_f32"] = serde_json::json!(ref_s / step_s);
    }
    println!("{line}");
    Ok(())
}
