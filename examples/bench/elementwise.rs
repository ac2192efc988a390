//! `bench elementwise`: nanoseconds per element of the f32 point-wise kernels
//! (GELU, SiLU, SwiGLU forward and backward, and a plain add for the memory
//! bound), on one thread and on the whole thread pool.
//!
//! The default size is one gpt-tiny MLP activation (`8·256 × 4·384`, 3.1M
//! elements). Output: one JSON line per kernel and thread count, e.g.
//! `{"bench":"elementwise","case":"gelu_fwd","threads":1,"elems":3145728,"ns_per_elem":0.41}`.

use anyhow::{ensure, Result};
use std::hint::black_box;
use tessera_kernels::cpu::{activation, elementwise};

/// Arguments of `bench elementwise`.
#[derive(clap::Args)]
pub struct Args {
    /// Elements per buffer.
    #[arg(long, default_value_t = 2048 * 1536)]
    elems: usize,
    /// Minimum wall time of one timed repetition, in seconds.
    #[arg(long, default_value_t = 0.2)]
    min_time: f64,
    /// Timed repetitions per case; the fastest is reported.
    #[arg(long, default_value_t = 5)]
    reps: usize,
}

/// Measures every kernel on one thread, then on the whole pool, and prints the JSON lines.
pub fn run(args: &Args) -> Result<()> {
    ensure!(args.reps > 0 && args.elems > 0, "--reps and --elems must be positive");
    let n = args.elems;
    // Inputs in [-4, 4): both tails of every activation are exercised.
    let x: Vec<f32> = super::fill(n, 1).iter().map(|v| 4.0 * v).collect();
    let u: Vec<f32> = super::fill(n, 2).iter().map(|v| 4.0 * v).collect();
    let dy = super::fill(n, 3);
    let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build()?;
    let mut lines = Vec::new();
    for threads in [1, rayon::current_num_threads()] {
        let mut case = |name: &str, kernel: &mut (dyn FnMut() + Send)| {
            let t = if threads == 1 {
                one.install(|| super::time_per_call(args.min_time, args.reps, &mut *kernel))
            } else {
                super::time_per_call(args.min_time, args.reps, &mut *kernel)
            };
            let ns = t * 1e9 / n as f64;
            eprintln!("{name:<12} {threads:>2} threads {ns:>7.3} ns/elem");
            lines.push(serde_json::json!({
                "bench": "elementwise",
                "case": name,
                "threads": threads,
                "elems": n,
                "ns_per_elem": (ns * 1000.0).round() / 1000.0,
            }));
        };
        case("add", &mut || elementwise::add(black_box(&x), &u, &mut a));
        case("gelu_fwd", &mut || activation::gelu_forward(black_box(&x), &mut a));
        case("gelu_bwd", &mut || activation::gelu_backward(black_box(&x), &dy, &mut a));
        case("silu_fwd", &mut || activation::silu_forward(black_box(&x), &mut a));
        case("silu_bwd", &mut || activation::silu_backward(black_box(&x), &dy, &mut a));
        case("swiglu_fwd", &mut || activation::swiglu_forward(black_box(&x), &u, &mut a));
        case("swiglu_bwd", &mut || activation::swiglu_backward(black_box(&x), &u, &dy, &mut a, &mut b));
        if rayon::current_num_threads() == 1 {
            break;
        }
    }
    for l in lines {
        println!("{l}");
    }
    Ok(())
}
