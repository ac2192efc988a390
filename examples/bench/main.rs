//! Micro-benchmarks of Tessera's kernels.
//!
//! Each subcommand measures one kernel family and prints one JSON line per case
//! as its last output, e.g. `{"bench":"matmul","case":"2048","gflops":187.2}`,
//! so scripts can compare runs and other libraries without parsing prose.
//!
//! ```text
//! cargo run --release --example bench -- matmul --sizes 1024,2048
//! cargo run --release --example bench -- matmul --dtype bf16 --sizes 2048
//! cargo run --release --example bench -- collectives --max-bytes 16M
//! cargo run --release --example bench -- collectives --backend shm --ranks 2,4 --min-bytes 1M --max-bytes 64M
//! mpirun -np 2 target/release/examples/bench collectives --backend mpi   # built with --features mpi
//! cargo run --release --example bench -- gpt
//! cargo run --release --example bench -- elementwise
//! cargo run --release --example bench -- attention
//! cargo run --release --example bench -- serve
//! cargo run --release --example bench -- serve --cases quant
//! cargo run --release --example bench -- serve-http
//! cargo run --release --example bench -- quant_gemv --rows 1,4
//! cargo run --release --example bench -- pipeline --stages 2 --microbatches 8
//! cargo run --release --example bench -- tp-overlap --tp 2 --pieces 4
//! cargo run --release --example bench -- offload --dp 2
//! ```

mod attention;
mod collectives;
mod collectives_mpi;
mod context_parallel;
mod cuda;
mod elementwise;
mod gpt;
mod offload;
mod pipeline;
mod quant;
mod serve;
mod serve_http;
mod tp_overlap;

use anyhow::{ensure, Result};
use clap::{Parser, Subcommand};
use std::hint::black_box;
use std::time::{Duration, Instant};
use tessera::bf16;
use tessera_kernels::cpu::matmul::{matmul, matmul_bf16};
use tessera_kernels::desc::Gemm;

#[derive(Parser)]
#[command(about = "Benchmarks of Tessera's CPU kernels")]
struct Cli {
    #[command(subcommand)]
    bench: Bench,
}

#[derive(Subcommand)]
enum Bench {
    /// Square matrix products `C = A·B` of the given sizes, f32 or bf16.
    Matmul(MatmulArgs),
    /// All-reduce, all-gather and reduce-scatter bandwidth, ranks as threads
    /// or as processes (`--backend`), with memory copies of the same size,
    /// measured alongside, for scale.
    Collectives(CollectivesArgs),
    /// Training throughput of gpt-tiny on one rank, as a share of the f32
    /// matmul rate measured in the same run.
    Gpt(gpt::Args),
    /// Nanoseconds per element of the f32 activation kernels (GELU, SiLU,
    /// SwiGLU, forward and backward) on one thread and on the thread pool.
    Elementwise(elementwise::Args),
    /// GFLOP/s of the fused f32 attention forward and backward (gpt-tiny's
    /// layer shape by default) on the thread pool.
    Attention(attention::Args),
    /// The serving engine: continuous vs static batching, speculative vs
    /// plain decoding, paged vs reserved KV memory, quantized vs f32
    /// weights (ratios from one run).
    Serve(serve::Args),
    /// The OpenAI HTTP server under a load of Poisson arrivals against the
    /// engine's in-process clients: throughput, TTFT and TPOT, and the HTTP
    /// layer's cost (ratios from one run).
    #[command(name = "serve-http")]
    ServeHttp(serve_http::Args),
    /// GPU figures (bf16 GEMM, attention, GPT-2 124M training) on a CUDA
    /// device; needs a build with `--features cuda` and a GPU.
    Cuda(cuda::Args),
    /// Decode-shaped products (a row of activations by a weight) with f32,
    /// int8, int4 and W8A8 weights: time per token, GB/s and the ratios to
    /// f32, one layer and a 100M-parameter stack that fits no cache.
    #[command(name = "quant_gemv")]
    QuantGemv(quant::Args),
    /// Pipeline schedules run for real on CPU stages: ZB-H1 against 1F1B,
    /// the idle time of every stage traced, beside the simulator's figure.
    Pipeline(pipeline::Args),
    /// Tensor-parallel communication of a sequence-parallel GPT-2 hidden
    /// behind the products, with the collectives whole and cut into pieces
    /// (exposed against carried communication, and the step times).
    #[command(name = "tp-overlap")]
    TpOverlap(tp_overlap::Args),
    /// Context parallelism (ring attention) on CPU ranks: the longest
    /// sequence a fixed per-rank memory budget trains at each cp degree,
    /// and the step time against cp = 1 on the budget's sequence.
    #[command(name = "context-parallel")]
    ContextParallel(context_parallel::Args),
    /// ZeRO-Offload and activation offload on CPU ranks (host = a second
    /// memory pool): device memory saved and step time against the same
    /// run without offload, and the share of the host update hidden.
    Offload(offload::Args),
}

#[derive(clap::Args)]
struct MatmulArgs {
    /// Square sizes to measure (m = k = n); 1024,2048 when neither this nor
    /// `--shapes` is given.
    #[arg(long, value_delimiter = ',')]
    sizes: Vec<usize>,
    /// Shapes `MxKxN` (comma-separated, e.g. `16x1024x4096`), measured after
    /// `--sizes`; a suffix `:tn`, `:nt` or `:tt` stores `A` and/or `B`
    /// transposed, as a linear layer's forward (`:nt`) and weight gradient (`:tn`) do.
    #[arg(long, value_delimiter = ',', value_parser = parse_shape)]
    shapes: Vec<Shape>,
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
    /// Element type of the operands and the result: `f32`, or `bf16` (f32
    /// accumulation, the result rounded once to bf16).
    #[arg(long, default_value = "f32", value_parser = ["f32", "bf16"])]
    dtype: String,
}

#[derive(clap::Args)]
struct CollectivesArgs {
    /// How the ranks communicate: `inproc` (threads of this process),
    /// `shm` (processes, shared memory), `tcp` (processes, TCP) or `mpi`
    /// (the processes of an `mpirun` job; `--ranks` is ignored). For `shm`
    /// and `tcp` the bench starts the processes itself, or is one of them when
    /// a launcher started it (then `--ranks` is the launcher's world size).
    #[arg(long, default_value_t = Backend::Inproc)]
    backend: Backend,
    /// Numbers of ranks to measure.
    #[arg(long, value_delimiter = ',', default_values_t = [2, 4, 8])]
    ranks: Vec<usize>,
    /// Smallest message in bytes (suffixes K, M, G allowed); sizes grow by 4×.
    #[arg(long, default_value = "1K", value_parser = parse_bytes)]
    min_bytes: usize,
    /// Largest message in bytes (suffixes K, M, G allowed).
    #[arg(long, default_value = "256M", value_parser = parse_bytes)]
    max_bytes: usize,
    /// Collectives to measure.
    #[arg(long, value_delimiter = ',', default_values_t = [Coll::Allreduce, Coll::Allgather, Coll::Reducescatter])]
    ops: Vec<Coll>,
    /// Minimum wall time of one timed repetition, in seconds.
    #[arg(long, default_value_t = 0.05)]
    min_time: f64,
    /// Timed repetitions per case; the fastest is reported (the others are
    /// mostly time-slicing noise on a shared machine).
    #[arg(long, default_value_t = 3)]
    reps: usize,
}

/// How the ranks of `bench collectives` communicate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Backend {
    /// Ranks are threads of this process (`tessera::dist::inproc`).
    Inproc,
    /// Ranks are processes of one node, through shared memory.
    Shm,
    /// Ranks are processes, through TCP.
    Tcp,
    /// Ranks are the processes of an `mpirun` job, through MPI (a build
    /// with `--features mpi`), against plain MPI calls.
    Mpi,
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Backend::Inproc => "inproc",
            Backend::Shm => "shm",
            Backend::Tcp => "tcp",
            Backend::Mpi => "mpi",
        })
    }
}

/// A collective measured by `bench collectives`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Coll {
    Allreduce,
    Allgather,
    Reducescatter,
}

impl std::fmt::Display for Coll {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Coll::Allreduce => "allreduce",
            Coll::Allgather => "allgather",
            Coll::Reducescatter => "reducescatter",
        })
    }
}

fn main() -> Result<()> {
    match Cli::parse().bench {
        Bench::Matmul(args) => bench_matmul(&args),
        Bench::Collectives(args) => bench_collectives(&args),
        Bench::Gpt(args) => gpt::run(&args),
        Bench::Elementwise(args) => elementwise::run(&args),
        Bench::Attention(args) => attention::run(&args),
        Bench::Serve(args) => serve::run(&args),
        Bench::ServeHttp(args) => serve_http::run(&args),
        Bench::Cuda(args) => cuda::run(&args),
        Bench::QuantGemv(args) => quant::run(&args),
        Bench::Pipeline(args) => pipeline::run(&args),
        Bench::TpOverlap(args) => tp_overlap::run(&args),
        Bench::ContextParallel(args) => context_parallel::run(&args),
        Bench::Offload(args) => offload::run(&args),
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
        let stat = std::fs::read_to_string("/proc/thread-self/schedstat").expect("--cpu-time needs Linux /proc/thread-self/schedstat");
        let ns = stat.split_whitespace().next().and_then(|f| f.parse().ok()).unwrap_or(0);
        Duration::from_nanos(ns)
    }
}

/// A product shape for `bench matmul`: `m×k·k×n`, operands possibly stored transposed.
#[derive(Clone, Copy)]
struct Shape {
    m: usize,
    k: usize,
    n: usize,
    trans_a: bool,
    trans_b: bool,
}

fn parse_shape(s: &str) -> Result<Shape, String> {
    let (dims, trans) = s.split_once(':').unwrap_or((s, "nn"));
    let (trans_a, trans_b) = match trans {
        "nn" => (false, false),
        "tn" => (true, false),
        "nt" => (false, true),
        "tt" => (true, true),
        _ => return Err(format!("shape {s:?}: the suffix after ':' must be nn, tn, nt or tt")),
    };
    let dims: Vec<usize> = dims.split('x').map(str::parse).collect::<Result<_, _>>().map_err(|e| format!("{e}"))?;
    match dims[..] {
        [m, k, n] => Ok(Shape { m, k, n, trans_a, trans_b }),
        _ => Err(format!("shape {s:?} is not MxKxN")),
    }
}

fn bench_matmul(args: &MatmulArgs) -> Result<()> {
    ensure!(args.reps > 0, "--reps must be positive");
    let mut lines = Vec::new();
    let sizes = if args.sizes.is_empty() && args.shapes.is_empty() { vec![1024, 2048] } else { args.sizes.clone() };
    let square = |s| Shape { m: s, k: s, n: s, trans_a: false, trans_b: false };
    let cases = sizes.into_iter().map(|s| (s.to_string(), square(s)));
    let cases = cases.chain(args.shapes.iter().map(|&sh| {
        let t = |on: bool| if on { 't' } else { 'n' };
        (format!("{}x{}x{}:{}{}", sh.m, sh.k, sh.n, t(sh.trans_a), t(sh.trans_b)), sh)
    }));
    for (name, Shape { m, k, n, trans_a, trans_b }) in cases {
        let g = Gemm::new(1, m, k, n).trans_a(trans_a).trans_b(trans_b);
        let a = fill(m * k, 1);
        let b = fill(k * n, 2);
        let mut c = vec![0f32; m * n];
        let half = |x: &[f32]| x.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<bf16>>();
        let (a16, b16) = if args.dtype == "bf16" { (half(&a), half(&b)) } else { (Vec::new(), Vec::new()) };
        let mut c16 = vec![bf16::ZERO; if args.dtype == "bf16" { m * n } else { 0 }];
        let mut run = || match args.dtype.as_str() {
            "bf16" => matmul_bf16(&g, black_box(&a16), black_box(&b16), black_box(&mut c16)),
            _ => matmul(&g, black_box(&a), black_box(&b), black_box(&mut c)),
        };
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
            "dtype": args.dtype,
            "gflops": (median * 10.0).round() / 10.0,
            "best_gflops": (rates[rates.len() - 1] * 10.0).round() / 10.0,
        }));
    }
    for l in lines {
        println!("{l}");
    }
    Ok(())
}

fn parse_bytes(s: &str) -> Result<usize, String> {
    let (num, mult) = match s.trim().to_ascii_uppercase() {
        t if t.ends_with('G') => (t[..t.len() - 1].to_string(), 1 << 30),
        t if t.ends_with('M') => (t[..t.len() - 1].to_string(), 1 << 20),
        t if t.ends_with('K') => (t[..t.len() - 1].to_string(), 1 << 10),
        t => (t, 1),
    };
    num.parse::<usize>().map(|n| n * mult).map_err(|e| format!("{s:?} is not a byte count: {e}"))
}

/// Bytes in human units for the progress table.
fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 30 => format!("{}G", b >> 30),
        b if b >= 1 << 20 => format!("{}M", b >> 20),
        b if b >= 1 << 10 => format!("{}K", b >> 10),
        b => format!("{b}"),
    }
}

/// Runs `run` repeatedly: calibrates how many calls last `min_time`, then
/// returns the fastest per-call time over `reps` timed repetitions.
fn time_per_call(min_time: f64, reps: usize, mut run: impl FnMut()) -> f64 {
    let t0 = Instant::now();
    run(); // warm-up: page faults, caches, thread start
    let once = t0.elapsed().as_secs_f64().max(1e-7);
    let iters = ((min_time / once).ceil() as usize).clamp(1, 100_000);
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..iters {
                run();
            }
            t.elapsed().as_secs_f64() / iters as f64
        })
        .fold(f64::INFINITY, f64::min)
}

/// On-CPU time of every thread of this process so far (the first field of
/// each `/proc/self/task/*/schedstat`, nanoseconds): with the work on a known
/// number of threads, it measures the work itself while other processes
/// share the cores, which wall time on a loaded machine does not.
fn process_cpu_time() -> Duration {
    let tasks = std::fs::read_dir("/proc/self/task").expect("CPU time needs Linux /proc/self/task");
    let ns: u64 = tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    Duration::from_nanos(ns)
}

/// Like [`time_per_call`], with the process's on-CPU time instead of wall
/// time when `cpu` is set (see [`process_cpu_time`]).
fn time_per_call_on(cpu: bool, min_time: f64, reps: usize, mut run: impl FnMut()) -> f64 {
    if !cpu {
        return time_per_call(min_time, reps, run);
    }
    let t0 = Instant::now();
    run();
    let once = t0.elapsed().as_secs_f64().max(1e-7);
    let iters = ((min_time / once).ceil() as usize).clamp(1, 100_000);
    (0..reps)
        .map(|_| {
            let t = process_cpu_time();
            for _ in 0..iters {
                run();
            }
            (process_cpu_time() - t).as_secs_f64() / iters as f64
        })
        .fold(f64::INFINITY, f64::min)
}

fn bench_collectives(args: &CollectivesArgs) -> Result<()> {
    match args.backend {
        Backend::Inproc | Backend::Shm | Backend::Tcp => collectives::run(args),
        Backend::Mpi => collectives_mpi::run(args),
    }
}
