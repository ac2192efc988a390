//! `bench attention`: GFLOP/s of the fused f32 attention forward and backward
//! on the whole thread pool.
//!
//! The default shape is one gpt-tiny layer (batch 8, 6 heads, 256 positions,
//! head dim 64, causal). The FLOP count is that of the unmasked products
//! (`4·T²·hd` per head forward, `8·T²·hd` backward: two and four
//! `T×T×hd` products), halved for causal masking, so the figure compares
//! directly with the matmul rate. Output: one JSON line per pass, e.g.
//! `{"bench":"attention","case":"fwd","b":8,"h":6,"t":256,"hd":64,"causal":true,"gflops":80.1}`.
//! `--packed` times the same computation read from and written to the fused
//! `qkv` layout an attention layer uses (cases `fwd-packed`, `bwd-packed`).
//! `--dtype bf16` times the bf16 entry points (bf16 operands, f32
//! statistics; the tile products on the CPU's bf16 dot-product instruction
//! where it has one), cases suffixed `-bf16`.

use anyhow::{ensure, Result};
use std::hint::black_box;
use tessera::bf16;
use tessera_kernels::cpu::attention::{
    attention_backward, attention_backward_bf16, attention_backward_packed, attention_backward_packed_bf16, attention_forward, attention_forward_bf16,
    attention_forward_packed, attention_forward_packed_bf16, AttnDims,
};

/// Arguments of `bench attention`.
#[derive(clap::Args)]
pub struct Args {
    /// Independent sequences.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Query (and key/value) heads.
    #[arg(long, default_value_t = 6)]
    heads: usize,
    /// Positions per sequence.
    #[arg(long, default_value_t = 256)]
    seq: usize,
    /// Features per head.
    #[arg(long, default_value_t = 64)]
    head_dim: usize,
    /// Attend to every position instead of only earlier ones.
    #[arg(long)]
    bidirectional: bool,
    /// Minimum wall time of one timed repetition, in seconds.
    #[arg(long, default_value_t = 0.2)]
    min_time: f64,
    /// Use the fused `[batch, seq, heads, 3, head_dim]` q/k/v layout of a
    /// self-attention layer instead of separate per-head tensors.
    #[arg(long)]
    packed: bool,
    /// Timed repetitions per pass; the fastest is reported.
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Element type of q, k, v and the gradients: `f32` or `bf16`.
    #[arg(long, default_value = "f32", value_parser = ["f32", "bf16"])]
    dtype: String,
}

/// Measures the forward, then the backward, and prints the JSON lines.
pub fn run(args: &Args) -> Result<()> {
    ensure!(args.reps > 0 && args.batch * args.heads * args.seq * args.head_dim > 0, "--reps, --batch, --heads, --seq and --head-dim must be positive");
    let causal = !args.bidirectional;
    let d = AttnDims {
        batch: args.batch,
        q_heads: args.heads,
        kv_heads: args.heads,
        seq_q: args.seq,
        seq_kv: args.seq,
        head_dim: args.head_dim,
        causal,
        scale: 1.0 / (args.head_dim as f64).sqrt(),
    };
    let (t_fwd, t_bwd) = match (args.packed, args.dtype == "bf16") {
        (true, false) => time_packed(args, &d),
        (false, false) => time_heads(args, &d),
        (true, true) => time_packed_bf16(args, &d),
        (false, true) => time_heads_bf16(args, &d),
    };
    let product = (d.batch * d.q_heads * d.seq_q * d.seq_kv * d.head_dim) as f64 * 2.0;
    let visible = if causal { 0.5 } else { 1.0 };
    let suffix = format!("{}{}", if args.packed { "-packed" } else { "" }, if args.dtype == "bf16" { "-bf16" } else { "" });
    for (case, t, products) in [("fwd", t_fwd, 2.0), ("bwd", t_bwd, 4.0)] {
        let case = format!("{case}{suffix}");
        let gflops = product * products * visible / t / 1e9;
        eprintln!("attention {case}: {:>8.3} ms  {gflops:>6.1} GFLOP/s", t * 1e3);
        println!(
            "{}",
            serde_json::json!({
                "bench": "attention",
                "case": case,
                "b": d.batch,
                "h": d.q_heads,
                "t": d.seq_q,
                "hd": d.head_dim,
                "causal": causal,
                "ms": (t * 1e6).round() / 1e3,
                "gflops": (gflops * 10.0).round() / 10.0,
            })
        );
    }
    Ok(())
}

/// Seconds per forward and per backward call on separate per-head tensors.
fn time_heads(args: &Args, d: &AttnDims) -> (f64, f64) {
    let (q, k, v) = (super::fill(d.q_len(), 1), super::fill(d.kv_len(), 2), super::fill(d.kv_len(), 3));
    let dout = super::fill(d.q_len(), 4);
    let mut out = vec![0f32; d.q_len()];
    let mut lse = vec![0f32; d.lse_len()];
    let (mut dq, mut dk, mut dv) = (vec![0f32; d.q_len()], vec![0f32; d.kv_len()], vec![0f32; d.kv_len()]);
    let t_fwd = super::time_per_call(args.min_time, args.reps, || attention_forward(d, black_box(&q), &k, &v, &mut out, &mut lse));
    let t_bwd = super::time_per_call(args.min_time, args.reps, || attention_backward(d, black_box(&q), &k, &v, &out, &lse, &dout, &mut dq, &mut dk, &mut dv));
    (t_fwd, t_bwd)
}

/// Seconds per forward and per backward call on the fused layout.
fn time_packed(args: &Args, d: &AttnDims) -> (f64, f64) {
    let qkv = super::fill(d.packed_len(), 1);
    let dout = super::fill(d.q_len(), 4);
    let mut out = vec![0f32; d.q_len()];
    let mut lse = vec![0f32; d.lse_len()];
    let mut dqkv = vec![0f32; d.packed_len()];
    let t_fwd = super::time_per_call(args.min_time, args.reps, || attention_forward_packed(d, black_box(&qkv), &mut out, &mut lse));
    let t_bwd = super::time_per_call(args.min_time, args.reps, || attention_backward_packed(d, black_box(&qkv), &out, &lse, &dout, &mut dqkv));
    (t_fwd, t_bwd)
}

fn halves(x: Vec<f32>) -> Vec<bf16> {
    x.into_iter().map(bf16::from_f32).collect()
}

/// [`time_heads`] on bf16 operands.
fn time_heads_bf16(args: &Args, d: &AttnDims) -> (f64, f64) {
    let (q, k, v) = (halves(super::fill(d.q_len(), 1)), halves(super::fill(d.kv_len(), 2)), halves(super::fill(d.kv_len(), 3)));
    let dout = halves(super::fill(d.q_len(), 4));
    let mut out = vec![bf16::ZERO; d.q_len()];
    let mut lse = vec![0f32; d.lse_len()];
    let (mut dq, mut dk, mut dv) = (vec![bf16::ZERO; d.q_len()], vec![bf16::ZERO; d.kv_len()], vec![bf16::ZERO; d.kv_len()]);
    let t_fwd = super::time_per_call(args.min_time, args.reps, || attention_forward_bf16(d, black_box(&q), &k, &v, &mut out, &mut lse));
    let t_bwd =
        super::time_per_call(args.min_time, args.reps, || attention_backward_bf16(d, black_box(&q), &k, &v, &out, &lse, &dout, &mut dq, &mut dk, &mut dv));
    (t_fwd, t_bwd)
}

/// [`time_packed`] on bf16 operands.
fn time_packed_bf16(args: &Args, d: &AttnDims) -> (f64, f64) {
    let qkv = halves(super::fill(d.packed_len(), 1));
    let dout = halves(super::fill(d.q_len(), 4));
    let mut out = vec![bf16::ZERO; d.q_len()];
    let mut lse = vec![0f32; d.lse_len()];
    let mut dqkv = vec![bf16::ZERO; d.packed_len()];
    let t_fwd = super::time_per_call(args.min_time, args.reps, || attention_forward_packed_bf16(d, black_box(&qkv), &mut out, &mut lse));
    let t_bwd = super::time_per_call(args.min_time, args.reps, || attention_backward_packed_bf16(d, black_box(&qkv), &out, &lse, &dout, &mut dqkv));
    (t_fwd, t_bwd)
}
