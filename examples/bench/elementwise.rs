//! `bench elementwise`: nanoseconds per element of the f32 point-wise kernels
//! (GELU, SiLU, SwiGLU forward and backward, and a plain add for the memory
//! bound), on one thread and on the whole thread pool.
//!
//! The default size is one gpt-tiny MLP activation (`8·256 × 4·384`, 3.1M
//! elements). Output: one JSON line per kernel and thread count, e.g.
//! `{"bench":"elementwise","case":"gelu_fwd","threads":1,"elems":3145728,"ns_per_elem":0.41}`.
//!
//! With `--ops DTYPE` it times the runtime's ops on tensors of that dtype
//! instead (what a training step calls, allocation and any conversion
//! included), on the thread pool: point-wise ops, the row ops on rows of
//! gpt-tiny's width, and the conversions.

use anyhow::{ensure, Result};
use std::hint::black_box;
use tessera::ops;
use tessera::{DType, Device, Tensor};
use tessera_kernels::cpu::mixed::{self, Dst, Src};
use tessera_kernels::cpu::{activation, cast, elementwise};

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
    /// Time the ops on tensors of this dtype (`f32`, `bf16`, `f16`) instead
    /// of the f32 kernels on slices.
    #[arg(long, value_parser = ["f32", "bf16", "f16"])]
    ops: Option<String>,
    /// Row length for the row ops of `--ops` (gpt-tiny's width).
    #[arg(long, default_value_t = 384)]
    row: usize,
    /// Time with the process's on-CPU time (all threads) instead of wall
    /// time; the figure is then CPU nanoseconds per element, which other load
    /// on the machine disturbs much less.
    #[arg(long)]
    cpu_time: bool,
}

/// `--ops`: one JSON line per op, nanoseconds per element of the input.
fn run_ops(args: &Args, dtype: &str) -> Result<()> {
    let dtype = match dtype {
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        _ => DType::F32,
    };
    let dev = Device::cpu();
    let n = args.elems / args.row * args.row;
    ensure!(n > 0, "--elems must be at least --row");
    let shape = [n / args.row, args.row];
    let t = |seed: u32, scale: f32| -> Result<Tensor> {
        let v: Vec<f32> = super::fill(n, seed).iter().map(|x| scale * x).collect();
        Ok(Tensor::from_vec(v, shape, &dev)?.to_dtype(dtype)?)
    };
    let (x, u, dy) = (t(1, 4.0)?, t(2, 4.0)?, t(3, 1.0)?);
    let x32 = x.to_dtype(DType::F32)?;
    let gamma = Tensor::from_vec(super::fill(args.row, 4), [args.row], &dev)?.to_dtype(dtype)?;
    let beta = Tensor::from_vec(super::fill(args.row, 5), [args.row], &dev)?.to_dtype(dtype)?;
    let (_, saved) = ops::layer_norm(&x, &gamma, Some(&beta), 1e-5)?;
    let y = ops::softmax(&x)?;
    let mut lines = Vec::new();
    let mut case = |name: &str, op: &mut dyn FnMut() -> tessera::Result<()>| -> Result<()> {
        op()?;
        let secs = super::time_per_call_on(args.cpu_time, args.min_time, args.reps, || op().expect("op failed after a first success"));
        let ns = secs * 1e9 / n as f64;
        eprintln!("{name:<14} {dtype:>5} {ns:>7.3} ns/elem");
        let clock = if args.cpu_time { "cpu" } else { "wall" };
        lines.push(serde_json::json!({"bench": "elementwise_ops", "case": name, "dtype": dtype.to_string(), "elems": n, "clock": clock, "ns_per_elem": (ns * 1000.0).round() / 1000.0}));
        Ok(())
    };
    case("add", &mut || ops::add(black_box(&x), &u).map(drop))?;
    case("mul", &mut || ops::mul(black_box(&x), &u).map(drop))?;
    case("scale", &mut || ops::scale(black_box(&x), 0.5).map(drop))?;
    case("add_bias", &mut || ops::add_bias(black_box(&x), &beta).map(drop))?;
    case("gelu_fwd", &mut || ops::gelu(black_box(&x)).map(drop))?;
    case("gelu_bwd", &mut || ops::gelu_backward(black_box(&x), &dy).map(drop))?;
    case("silu_fwd", &mut || ops::silu(black_box(&x)).map(drop))?;
    case("silu_bwd", &mut || ops::silu_backward(black_box(&x), &dy).map(drop))?;
    case("softmax_fwd", &mut || ops::softmax(black_box(&x)).map(drop))?;
    case("softmax_bwd", &mut || ops::softmax_backward(black_box(&y), &dy).map(drop))?;
    case("layernorm_fwd", &mut || ops::layer_norm(black_box(&x), &gamma, Some(&beta), 1e-5).map(drop))?;
    case("layernorm_bwd", &mut || ops::layer_norm_backward(black_box(&x), &gamma, true, &saved, &dy).map(drop))?;
    case("rmsnorm_fwd", &mut || ops::rms_norm(black_box(&x), &gamma, 1e-5).map(drop))?;
    case("bias_grad", &mut || ops::bias_grad(black_box(&dy)).map(drop))?;
    case("cast_to_f32", &mut || black_box(&x).to_dtype(DType::F32).map(drop))?;
    case("cast_from_f32", &mut || black_box(&x32).to_dtype(dtype).map(drop))?;
    for l in lines {
        println!("{l}");
    }
    Ok(())
}

/// Measures every kernel on one thread, then on the whole pool, and prints the JSON lines.
pub fn run(args: &Args) -> Result<()> {
    ensure!(args.reps > 0 && args.elems > 0, "--reps and --elems must be positive");
    if let Some(dtype) = &args.ops {
        return run_ops(args, dtype);
    }
    let n = args.elems;
    // Inputs in [-4, 4): both tails of every activation are exercised.
    let x: Vec<f32> = super::fill(n, 1).iter().map(|v| 4.0 * v).collect();
    let u: Vec<f32> = super::fill(n, 2).iter().map(|v| 4.0 * v).collect();
    let dy = super::fill(n, 3);
    let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
    let half = |v: &[f32]| v.iter().map(|&x| tessera::bf16::from_f32(x)).collect::<Vec<_>>();
    let (xh, uh, mut ah) = (half(&x), half(&u), half(&x));
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build()?;
    let mut lines = Vec::new();
    for threads in [1, rayon::current_num_threads()] {
        let mut case = |name: &str, kernel: &mut (dyn FnMut() + Send)| {
            let t = if threads == 1 {
                one.install(|| super::time_per_call_on(args.cpu_time, args.min_time, args.reps, &mut *kernel))
            } else {
                super::time_per_call_on(args.cpu_time, args.min_time, args.reps, &mut *kernel)
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
        // bf16 storage: the conversions, and a memory-bound and a
        // compute-bound op computed in f32 a block at a time.
        case("bf16_to_f32", &mut || cast::bf16_to_f32(black_box(&xh), &mut a));
        case("f32_to_bf16", &mut || cast::f32_to_bf16(black_box(&x), &mut ah));
        case("add_bf16", &mut || mixed::map(&[Src::BF16(black_box(&xh)), Src::BF16(&uh)], Dst::BF16(&mut ah), |i, o| elementwise::add(i[0], i[1], o)));
        case("gelu_fwd_bf16", &mut || mixed::map(&[Src::BF16(black_box(&xh))], Dst::BF16(&mut ah), |i, o| activation::gelu_forward(i[0], o)));
        if rayon::current_num_threads() == 1 {
            break;
        }
    }
    for l in lines {
        println!("{l}");
    }
    Ok(())
}
