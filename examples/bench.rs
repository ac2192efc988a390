//! Micro-benchmarks of Tessera's kernels.
//!
//! Each subcommand measures one kernel family and prints one JSON line per case
//! as its last output, e.g. `{"bench":"matmul","case":"2048","gflops":187.2}`,
//! so scripts can compare runs and other libraries without parsing prose.
//!
//! ```text
//! cargo run --release --example bench -- matmul --sizes 1024,2048
//! ```

use anyhow::{ensure, Result};
use clap::{Parser, Subcommand};
use std::hint::black_box;
use std::time::{Duration, Instant};
use tessera_kernels::cpu::matmul::{matmul, Gemm};

#[derive(Parser)]
#[command(about = "Benchmarks of Tessera's CPU kernels")]
struct Cli {
    #[command(subcommand)]
    bench: Bench,
}

#[derive(Subcommand)]
enum Bench {
    /// f32 square matrix products `C = A·B` of the given sizes.
    Matmul(MatmulArgs),
}

#[derive(clap::Args)]
struct MatmulArgs {
    /// Square sizes to measure (m = k = n); 1024,2048 when neither this nor
    /// `--shapes` is given.
    #[arg(long, value_delimiter = ',')]
    sizes: Vec<usize>,
    /// Shapes `MxKxN` (comma-separated, e.g. `16x1024x4096`), measured after `--sizes`.
    #[arg(long, value_delimiter = ',', value_parser = parse_shape)]
    shapes: Vec<(usize, usize, usize)>,
    /// Timed repetitions per size (after warm-up); the median rate is reported.
    #[arg(long, default_value_t = 9)]
    reps: usize,
    /// Minimum wall time of one repetition in seconds: a repetition runs the
    /// product as many times as needed to last this long.
    #[arg(long, default_value_t = 0.2)]
    min_time: f64,
    /// Time with the calling thread's on-CPU time (Linux) instead of wall time:
    /// meaningful only for single-threaded runs (`RAYON_NUM_THREADS=1`), where
    /// it measures the kernel itself even while other processes share the cores.
    #[arg(long)]
    cpu_time: bool,
    /// Also print every repetition's rate to stderr.
    #[arg(long)]
    verbose: bool,
}

fn main() -> Result<()> {
    match Cli::parse().bench {
        Bench::Matmul(args) => bench_matmul(&args),
    }
}

/// Deterministic inputs in [-1, 1): the values do not affect the speed of a
/// dense product, only that they are finite and not all zero.
fn fill(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s >> 8) as f32 / (1u32 << 23) as f32 - 1.0
        })
        .collect()
}

/// Wall time, or the calling thread's on-CPU time read from
/// `/proc/thread-self/schedstat` (nanoseconds, first field).
struct Clock {
    cpu: bool,
}

impl Clock {
    fn now(&self) -> Duration {
        thread_local!(static START: Instant = Instant::now());
        if !self.cpu {
            return START.with(|s| s.elapsed());
        }
        let stat = std::fs::read_to_string("/proc/thread-self/schedstat")
            .expect("--cpu-time needs Linux /proc/thread-self/schedstat");
        let ns = stat.split_whitespace().next().and_then(|f| f.parse().ok()).unwrap_or(0);
        Duration::from_nanos(ns)
    }
}

fn parse_shape(s: &str) -> Result<(usize, usize, usize), String> {
    let dims: Vec<usize> = s.split('x').map(str::parse).collect::<Result<_, _>>().map_err(|e| format!("{e}"))?;
    match dims[..] {
        [m, k, n] => Ok((m, k, n)),
        _ => Err(format!("shape {s:?} is not MxKxN")),
    }
}

fn bench_matmul(args: &MatmulArgs) -> Result<()> {
    ensure!(args.reps > 0, "--reps must be positive");
    let mut lines = Vec::new();
    let sizes = if args.sizes.is_empty() && args.shapes.is_empty() { vec![1024, 2048] } else { args.sizes.clone() };
    let cases = sizes.into_iter().map(|s| (s.to_string(), (s, s, s)));
    let cases = cases.chain(args.shapes.iter().map(|&(m, k, n)| (format!("{m}x{k}x{n}"), (m, k, n))));
    for (name, (m, k, n)) in cases {
        let g = Gemm::new(1, m, k, n);
        let a = fill(m * k, 1);
        let b = fill(k * n, 2);
        let mut c = vec![0f32; m * n];
        let mut run = || matmul(&g, black_box(&a), black_box(&b), black_box(&mut c));
        // Warm-up: first-touch page faults, thread-pool start, caches, clocks.
        let rate = |iters: usize, t: Duration| g.flops() * iters as f64 / t.as_secs_f64() / 1e9;
        let clock = Clock { cpu: args.cpu_time };
        let t0 = Instant::now();
        let mut iters = 0;
        while iters < 2 || t0.elapsed().as_secs_f64() < args.min_time {
            run();
            iters += 1;
        }
        let per_call = t0.elapsed().as_secs_f64() / iters as f64;
        let inner = ((args.min_time / per_call).ceil() as usize).max(1);
        let mut rates: Vec<f64> = (0..args.reps)
            .map(|_| {
                let t = clock.now();
                for _ in 0..inner {
                    run();
                }
                rate(inner, clock.now() - t)
            })
            .collect();
        if args.verbose {
            eprintln!("matmul {name}: {inner} calls per rep, rates {rates:.1?}");
        }
        rates.sort_by(f64::total_cmp);
        let median = rates[rates.len() / 2];
        lines.push(serde_json::json!({
            "bench": "matmul",
            "case": name,
            "gflops": (median * 10.0).round() / 10.0,
            "best_gflops": (rates[rates.len() - 1] * 10.0).round() / 10.0,
        }));
    }
    for l in lines {
        println!("{l}");
    }
    Ok(())
}
