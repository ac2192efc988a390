//! `bench quant_gemv`: decode-shaped products (one row of activations, or a
//! few) with f32, int8, int4 and W8A8 weights, as a linear layer runs them
//! (`ops::matmul(x, w.t())` for f32, `ops::quant_matmul` for the others).
//!
//! Decode reads every weight once per generated token, so it is bound by
//! memory bandwidth once the weights outgrow the caches. Two cases:
//! - `4096x4096`: one square layer (64 MiB in f32, but 16 MiB in int8 and
//!   8.5 MiB in int4, which fit this machine's 32 MiB L3);
//! - `LAYERSx4096x4096` (default 6 layers, 100.7M parameters): a token
//!   passes through every layer in turn, so no format's weights fit in any
//!   cache: the memory-bound case the targets are about.
//!
//! Formats are timed in turn within each repetition (the fastest of
//! `--reps` is kept), so every ratio compares runs on the same machine at
//! the same moment. A `stream` line gives the machine's read bandwidth (a
//! parallel sum over 512 MiB of f32) for scale.
//!
//! With `--cpu-time` the process's on-CPU time replaces wall time (with
//! `RAYON_NUM_THREADS=1`, what one core does, whatever else runs).
//!
//! Output: one JSON line per case, rows and format, e.g.
//! `{"bench":"quant_gemv","case":"6x4096x4096","clock":"wall","threads":2,"rows":1,"format":"int8","ms_per_token":13.1,"tokens_per_s":76.3,"bytes":100761600,"gb_per_s":7.7,"vs_f32":4.06}`.

use anyhow::{ensure, Result};
use rayon::prelude::*;
use std::hint::black_box;
use std::time::Instant;
use tessera::ops::{self, QuantFormat, QuantizedWeight};
use tessera::{DType, Device, Init, RngKey, Tensor};

/// Arguments of `bench quant_gemv`.
#[derive(clap::Args)]
pub struct Args {
    /// Rows of activations per product (1 is decode of one sequence).
    #[arg(long, value_delimiter = ',', default_values_t = [1])]
    rows: Vec<usize>,
    /// Layers of the memory-bound case (each `dim x dim`).
    #[arg(long, default_value_t = 6)]
    layers: usize,
    /// Width of every layer.
    #[arg(long, default_value_t = 4096)]
    dim: usize,
    /// Timed repetitions; the fastest is reported.
    #[arg(long, default_value_t = 7)]
    reps: usize,
    /// Minimum wall time of one repetition of one format, in seconds.
    #[arg(long, default_value_t = 0.3)]
    min_time: f64,
    /// int4 group size.
    #[arg(long, default_value_t = 128)]
    group: usize,
    /// Time with the process's on-CPU time (all threads) instead of wall
    /// time: other load on the machine then disturbs the figures much less
    /// (a thread stalled on memory is still on the CPU).
    #[arg(long)]
    cpu_time: bool,
}

/// One format's weights for every layer.
enum Weights {
    F32(Vec<Tensor>),
    Quant(Vec<QuantizedWeight>),
}

impl Weights {
    fn bytes(&self) -> usize {
        match self {
            Weights::F32(w) => w.iter().map(|t| 4 * t.elem_count()).sum(),
            Weights::Quant(w) => w.iter().map(QuantizedWeight::bytes).sum(),
        }
    }

    /// One token: the product of `x` with every layer.
    fn token(&self, x: &Tensor) -> tessera::Result<()> {
        match self {
            Weights::F32(ws) => ws.iter().try_for_each(|w| ops::matmul(black_box(x), &w.t()?).map(drop)),
            Weights::Quant(ws) => ws.iter().try_for_each(|w| ops::quant_matmul(black_box(x), w, None).map(drop)),
        }
    }
}

/// Seconds per call of `run`, the calls repeated to last `min_time`; on-CPU
/// seconds of the whole process when `cpu`.
fn seconds_per_call(min_time: f64, cpu: bool, run: &mut dyn FnMut()) -> f64 {
    let t0 = Instant::now();
    run();
    let once = t0.elapsed().as_secs_f64().max(1e-7);
    let iters = ((min_time / once).ceil() as usize).clamp(1, 100_000);
    let (t, c) = (Instant::now(), if cpu { super::process_cpu_time() } else { Default::default() });
    for _ in 0..iters {
        run();
    }
    let secs = if cpu { (super::process_cpu_time() - c).as_secs_f64() } else { t.elapsed().as_secs_f64() };
    secs / iters as f64
}

/// The machine's read bandwidth: a parallel wrapping sum over 512 MiB of
/// u32 (integer sums vectorise; a float sum would be bound by its adds'
/// latency, not by memory), GB/s.
fn stream_gb_per_s(min_time: f64, reps: usize) -> f64 {
    let v = vec![1u32; 128 << 20];
    let sum = || v.par_chunks(1 << 16).map(|c| c.iter().fold(0u32, |a, &b| a.wrapping_add(b))).reduce(|| 0, u32::wrapping_add);
    let best = (0..reps).map(|_| seconds_per_call(min_time, false, &mut || _ = black_box(sum()))).fold(f64::INFINITY, f64::min);
    (v.len() * 4) as f64 / best / 1e9
}

/// Runs the benchmark and prints its JSON lines.
pub fn run(args: &Args) -> Result<()> {
    ensure!(args.reps > 0 && args.layers > 0 && args.dim > 0, "--reps, --layers and --dim must be positive");
    let dev = Device::cpu();
    let d = args.dim;
    let mut lines = Vec::new();
    let stream = stream_gb_per_s(args.min_time, args.reps);
    eprintln!("stream read: {stream:.1} GB/s over {} threads", rayon::current_num_threads());
    lines.push(
        serde_json::json!({"bench": "quant_gemv", "case": "stream", "threads": rayon::current_num_threads(), "gb_per_s": (stream * 10.0).round() / 10.0}),
    );
    for (case, layers) in [(format!("{d}x{d}"), 1), (format!("{}x{d}x{d}", args.layers), args.layers)] {
        let f32w: Vec<Tensor> = (0..layers)
            .map(|l| Tensor::rand(Init::Normal { mean: 0.0, std: 0.02 }, RngKey::new(7, l as u64), [d, d], DType::F32, &dev))
            .collect::<tessera::Result<_>>()?;
        let formats = [QuantFormat::Int8, QuantFormat::Int4 { group_size: args.group }, QuantFormat::W8A8];
        let mut all: Vec<(String, Weights)> = vec![("f32".into(), Weights::F32(f32w.clone()))];
        for f in formats {
            let q = f32w.iter().map(|w| ops::quantize(w, f)).collect::<tessera::Result<Vec<_>>>()?;
            all.push((f.name().to_string(), Weights::Quant(q)));
        }
        drop(f32w);
        for &rows in &args.rows {
            let x = Tensor::rand(Init::Normal { mean: 0.0, std: 1.0 }, RngKey::new(9, rows as u64), [rows, d], DType::F32, &dev)?;
            let mut best = vec![f64::INFINITY; all.len()];
            for _ in 0..args.reps {
                for (b, (_, w)) in best.iter_mut().zip(&all) {
                    let s = seconds_per_call(args.min_time, args.cpu_time, &mut || w.token(&x).expect("the product ran once before"));
                    *b = b.min(s);
                }
            }
            for ((name, w), &secs) in all.iter().zip(&best) {
                let gb = w.bytes() as f64 / secs / 1e9;
                let vs = best[0] / secs;
                eprintln!("{case:<14} rows {rows:>3} {name:<5} {:>8.3} ms/token {:>7.1} tokens/s {gb:>6.1} GB/s {vs:>5.2}x f32", secs * 1e3, 1.0 / secs);
                lines.push(serde_json::json!({
                    "bench": "quant_gemv",
                    "case": case,
                    "clock": if args.cpu_time { "cpu" } else { "wall" },
                    "threads": rayon::current_num_threads(),
                    "rows": rows,
                    "format": name,
                    "ms_per_token": (secs * 1e6).round() / 1e3,
                    "tokens_per_s": (10.0 / secs).round() / 10.0,
                    "bytes": w.bytes(),
                    "gb_per_s": (gb * 10.0).round() / 10.0,
                    "vs_f32": (vs * 100.0).round() / 100.0,
                }));
            }
        }
    }
    for l in lines {
        println!("{l}");
    }
    Ok(())
}
