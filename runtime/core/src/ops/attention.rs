//! Fused causal self-attention with grouped-query heads.

use super::{float_kernel, run, run1};
use crate::backend::cuda::args::{Arg, Grid};
use crate::backend::cuda::CudaCall;
use crate::backend::kernel::Out;
use crate::error::{Error, Result};
use crate::tensor::check_same_shape;
use crate::tensor::{DType, Shape, Tensor};
use half::bf16;
use tessera_kernels::cpu::attention::{
    attention_backward as back, attention_backward_bf16 as back_bf16, attention_backward_packed as back_packed,
    attention_backward_packed_bf16 as back_packed_bf16, attention_forward as fwd, attention_forward_bf16 as fwd_bf16, attention_forward_packed as fwd_packed,
    attention_forward_packed_bf16 as fwd_packed_bf16, attention_merge as merge, AttnDims,
};
use tessera_kernels::cpu::mixed::Src;
use tessera_kernels::cuda::attention::{self as gpu, AttnLayout, AttnParams, BackwardLaunches, Launch};
use tessera_kernels::cuda::attention_tc as tc;

// On bf16 operands (with the f32 log-sum-exp) the kernels read and write
// bf16 directly: with the CPU's bf16 dot products their tile products use
// them (probabilities and score gradients rounded to bf16 before they
// multiply, every sum in f32), otherwise the f32 kernels give the bits of
// widening first.
float_kernel!(writes_all AttnFwd { d: AttnDims } |s, i, o| {
    let (out, lse) = o.split_at_mut(1);
    fwd(&s.d, i[0], i[1], i[2], out[0], lse[0])
}; cuda |s, c| forward_cuda(c, &s.d, AttnLayout::Heads);
    half |s, dtype, dtypes| bf16_with_stats(dtype, dtypes, &[]) => |i, o| {
        let (q, k, v) = (bf16_in(i[0]), bf16_in(i[1]), bf16_in(i[2]));
        let (out, lse) = o.split_at_mut(1);
        fwd_bf16(&s.d, q, k, v, out[0].as_bf16().expect("bf16 output"), lse[0].as_f32().expect("f32 lse"))
    });
float_kernel!(writes_all AttnBack { d: AttnDims } |s, i, o| {
    let (dq, rest) = o.split_at_mut(1);
    let (dk, dv) = rest.split_at_mut(1);
    back(&s.d, i[0], i[1], i[2], i[3], i[4], i[5], dq[0], dk[0], dv[0])
}; cuda |s, c| backward_cuda(c, &s.d, AttnLayout::Heads);
    half |s, dtype, dtypes| bf16_with_stats(dtype, dtypes, &[4]) => |i, o| {
        let lse = i[4].as_f32().expect("f32 lse");
        let (dq, rest) = o.split_at_mut(1);
        let (dk, dv) = rest.split_at_mut(1);
        let (dq, dk, dv) = (dq[0].as_bf16().expect("bf16"), dk[0].as_bf16().expect("bf16"), dv[0].as_bf16().expect("bf16"));
        back_bf16(&s.d, bf16_in(i[0]), bf16_in(i[1]), bf16_in(i[2]), bf16_in(i[3]), lse, bf16_in(i[5]), dq, dk, dv)
    });

float_kernel!(writes_all AttnFwdPacked { d: AttnDims } |s, i, o| {
    let (out, lse) = o.split_at_mut(1);
    fwd_packed(&s.d, i[0], out[0], lse[0])
}; cuda |s, c| forward_cuda(c, &s.d, AttnLayout::Packed);
    half |s, dtype, dtypes| bf16_with_stats(dtype, dtypes, &[]) => |i, o| {
        let (out, lse) = o.split_at_mut(1);
        fwd_packed_bf16(&s.d, bf16_in(i[0]), out[0].as_bf16().expect("bf16 output"), lse[0].as_f32().expect("f32 lse"))
    });
float_kernel!(writes_all AttnBackPacked { d: AttnDims } |s, i, o| back_packed(&s.d, i[0], i[1], i[2], i[3], o[0]);
cuda |s, c| backward_cuda(c, &s.d, AttnLayout::Packed);
half |s, dtype, dtypes| bf16_with_stats(dtype, dtypes, &[2]) => |i, o| {
    let lse = i[2].as_f32().expect("f32 lse");
    back_packed_bf16(&s.d, bf16_in(i[0]), bf16_in(i[1]), lse, bf16_in(i[3]), o[0].as_bf16().expect("bf16 output"))
});

float_kernel!(writes_all AttnMerge { head_dim: usize } |s, i, o| {
    let (out, lse) = o.split_at_mut(1);
    out[0].copy_from_slice(i[0]);
    lse[0].copy_from_slice(i[1]);
    merge(s.head_dim, out[0], lse[0], i[2], i[3])
}; cuda |s, c| {
    let rows = c.output_len(1);
    for (a, n) in [(Arg::Input(0), rows * s.head_dim), (Arg::Stats(1), rows), (Arg::Input(2), rows * s.head_dim), (Arg::Stats(3), rows)] {
        c.at_least(a, n)?;
    }
    // SAFETY: the outputs have `rows · head_dim` and `rows` elements (their shapes), and every
    // input at least as many as the output it is merged into (checked).
    unsafe {
        c.launch(
            "attention_merge",
            "attention_merge",
            Grid::Items(rows * s.head_dim),
            &[Arg::Input(0), Arg::Stats(1), Arg::Input(2), Arg::Stats(3), Arg::Output(0), Arg::Output(1), Arg::U64(rows), Arg::U64(s.head_dim)],
        )
    }
});

/// Whether an attention op runs on bf16 storage directly: every input is
/// bf16 except those at `stats`, the f32 log-sum-exp the forward saved.
fn bf16_with_stats(dtype: DType, dtypes: &[DType], stats: &[usize]) -> bool {
    dtype == DType::BF16 && dtypes.iter().enumerate().all(|(k, &d)| d == if stats.contains(&k) { DType::F32 } else { DType::BF16 })
}

/// A bf16 input (the caller's condition checked the dtype).
fn bf16_in<'a>(x: Src<'a>) -> &'a [bf16] {
    x.as_bf16().expect("a bf16 input")
}

/// The grid of one attention launch, which fixes its own block and shared memory.
fn grid(l: &Launch) -> Grid {
    Grid::Fixed { blocks: l.grid, threads: l.block, shared_bytes: l.shared_bytes }
}

/// Sizes the CUDA kernels do not support (a `head_dim` above 128) are an
/// error naming the limit; the CPU runs them.
fn unsupported(op: &'static str, e: gpu::AttnLaunchError) -> Error {
    let e = e.to_string();
    Error::unsupported(op, format!("{}; the CPU backend runs any size", e.trim_start_matches("attention: ")))
}

/// The forward launch for this call: bf16 and f16 with `head_dim` up to 128
/// on a GPU of compute capability 8.0 or newer run the tensor-core kernels of
/// `kernels/cuda/attention_tc.cu` ([`tc::serves`]), everything else the
/// CUDA-core kernels of `kernels/cuda/attention.cu`. Both take the same
/// arguments and compute the same outputs.
fn forward_launch(c: &CudaCall, d: &AttnDims, layout: AttnLayout) -> Result<(AttnParams, Launch)> {
    let launch = if tc::serves(c.dtype_suffix(), d.head_dim, c.sm()) { tc::forward(d, layout) } else { gpu::forward(d, layout) };
    launch.map_err(|e| unsupported("attention", e))
}

/// The backward's launches, chosen as [`forward_launch`] chooses.
fn backward_launches(c: &CudaCall, d: &AttnDims, layout: AttnLayout) -> Result<(AttnParams, BackwardLaunches)> {
    let launches = if tc::serves(c.dtype_suffix(), d.head_dim, c.sm()) { tc::backward(d, layout) } else { gpu::backward(d, layout) };
    launches.map_err(|e| unsupported("attention_backward", e))
}

/// The forward on a GPU. Heads: inputs `q, k, v`; packed: input `qkv`, read
/// as all three through the layout's places. Outputs: `out` and the f32 `lse`.
fn forward_cuda(c: &mut CudaCall, d: &AttnDims, layout: AttnLayout) -> Result<()> {
    let (p, l) = forward_launch(c, d, layout)?;
    let (k, v) = match layout {
        AttnLayout::Heads => (Arg::Input(1), Arg::Input(2)),
        AttnLayout::Packed => (Arg::Input(0), Arg::Input(0)),
    };
    let (q_len, kv_len) = match layout {
        AttnLayout::Heads => (d.q_len(), d.kv_len()),
        AttnLayout::Packed => (d.packed_len(), d.packed_len()),
    };
    for (a, n) in [(Arg::Input(0), q_len), (k, kv_len), (v, kv_len), (Arg::Output(0), d.q_len()), (Arg::Output(1), d.lse_len())] {
        c.at_least(a, n)?;
    }
    // SAFETY: the places in `p` address the queries, keys, values and output of the dims `d`
    // in this layout (`gpu::params`), whose lengths the operands have (checked), and `lse`
    // has one f32 per query row (checked).
    unsafe { c.launch(l.source, l.op, grid(&l), &[Arg::Input(0), k, v, Arg::Output(0), Arg::Output(1), Arg::Attn(p)]) }
}

/// The backward on a GPU: `delta` into an f32 scratch buffer, then `dk` and
/// `dv`, then `dq`, in stream order. Heads: inputs `q, k, v, out, lse, dout`,
/// outputs `dq, dk, dv`; packed: inputs `qkv, out, lse, dout`, one output
/// shaped like `qkv` that the places split into `dq`, `dk` and `dv`.
fn backward_cuda(c: &mut CudaCall, d: &AttnDims, layout: AttnLayout) -> Result<()> {
    let (p, l) = backward_launches(c, d, layout)?;
    let (q, k, v, out, lse, dout, dq, dk, dv) = match layout {
        AttnLayout::Heads => (0, 1, 2, 3, 4, 5, 0, 1, 2),
        AttnLayout::Packed => (0, 0, 0, 1, 2, 3, 0, 0, 0),
    };
    let delta = Arg::Scratch(c.scratch_f32(d.batch * d.q_heads * d.seq_q)?);
    let (q, k, v, out, lse, dout) = (Arg::Input(q), Arg::Input(k), Arg::Input(v), Arg::Input(out), Arg::Stats(lse), Arg::Input(dout));
    let p = Arg::Attn(p);
    let (q_len, kv_len) = match layout {
        AttnLayout::Heads => (d.q_len(), d.kv_len()),
        AttnLayout::Packed => (d.packed_len(), d.packed_len()),
    };
    let lens = [(q, q_len), (k, kv_len), (v, kv_len), (out, d.q_len()), (dout, d.q_len()), (lse, d.lse_len()), (delta, d.lse_len())];
    for (a, n) in lens.into_iter().chain([(Arg::Output(dq), q_len), (Arg::Output(dk), kv_len), (Arg::Output(dv), kv_len)]) {
        c.at_least(a, n)?;
    }
    // SAFETY: the places in `p` address the tensors of the dims `d` in this layout
    // (`gpu::params`), whose lengths every operand and gradient has (checked); `lse` and
    // `delta` have one f32 per query row (checked).
    unsafe {
        c.launch(l.delta.source, l.delta.op, grid(&l.delta), &[out, dout, delta, p])?;
        c.launch(l.dkv.source, l.dkv.op, grid(&l.dkv), &[q, k, v, dout, lse, delta, Arg::Output(dk), Arg::Output(dv), p])?;
        c.launch(l.dq.source, l.dq.op, grid(&l.dq), &[q, k, v, dout, lse, delta, Arg::Output(dq), p])
    }
}

/// How queries attend: causally or not, and the factor on `q·k`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnOpts {
    /// Whether each query attends only to keys up to its own position.
    pub causal: bool,
    /// `None` means `1/sqrt(head_dim)`.
    pub scale: Option<f64>,
}

impl AttnOpts {
    /// Causal attention with the usual `1/sqrt(head_dim)` scale.
    pub fn causal() -> Self {
        AttnOpts { causal: true, scale: None }
    }
}

fn dims(op: &'static str, q: &Tensor, k: &Tensor, v: &Tensor, opts: AttnOpts) -> Result<AttnDims> {
    let (&[b, hq, tq, d], &[bk, hkv, tkv, dk]) = (q.dims(), k.dims()) else {
        return Err(Error::shape(op, format!("q and k must be [batch, heads, seq, head_dim], got {} and {}", q.shape(), k.shape())));
    };
    check_same_shape(op, "k and v", k, v)?;
    if b != bk || d != dk {
        return Err(Error::shape(op, format!("q {} and k {} disagree on batch or head_dim", q.shape(), k.shape())));
    }
    if hkv == 0 || hq % hkv != 0 {
        return Err(Error::shape(op, format!("{hq} query heads cannot be grouped over {hkv} key/value heads; query heads must be a multiple of kv heads")));
    }
    if opts.causal && tq > tkv {
        return Err(Error::shape(op, format!("causal attention with {tq} queries over {tkv} keys: queries must not outnumber keys")));
    }
    let scale = opts.scale.unwrap_or(1.0 / (d.max(1) as f64).sqrt());
    Ok(AttnDims { batch: b, q_heads: hq, kv_heads: hkv, seq_q: tq, seq_kv: tkv, head_dim: d, causal: opts.causal, scale })
}

/// Counts an attention pass of `dims`: `per_pair` FLOPs per head dimension,
/// visible (query, key) pair and query head.
fn count(d: &AttnDims, per_pair: f64) {
    let pairs = super::flops::attention_pairs(d.seq_q, d.seq_kv, d.causal);
    super::flops::add(per_pair * (d.batch * d.q_heads * d.head_dim) as f64 * pairs);
}

/// `softmax(q kᵀ · scale + mask) v` per head, without materialising the
/// score matrix. `q` is `[batch, q_heads, seq_q, head_dim]`, `k` and `v` are
/// `[batch, kv_heads, seq_kv, head_dim]` (query head `h` reads kv head
/// `h / (q_heads / kv_heads)`). Returns the output (shaped like `q`) and the
/// per-query log-sum-exp `[batch, q_heads, seq_q]` that the backward needs.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, opts: AttnOpts) -> Result<(Tensor, Tensor)> {
    const OP: &str = "attention";
    let d = dims(OP, q, k, v, opts)?;
    count(&d, 4.0);
    let lse = Shape::new(vec![d.batch, d.q_heads, d.seq_q]);
    let mut r = run(OP, &AttnFwd { d }, &[q, k, v], &[(q.shape().clone(), Out::Primary), (lse, Out::Compute)])?;
    let lse = r.pop().expect("two outputs");
    Ok((r.pop().expect("two outputs"), lse))
}

/// Backward of [`attention`]: `(dq, dk, dv)` from the inputs, the forward's
/// output and log-sum-exp, and the upstream gradient.
pub fn attention_backward(q: &Tensor, k: &Tensor, v: &Tensor, out: &Tensor, lse: &Tensor, dout: &Tensor, opts: AttnOpts) -> Result<(Tensor, Tensor, Tensor)> {
    const OP: &str = "attention_backward";
    let d = dims(OP, q, k, v, opts)?;
    count(&d, 10.0);
    check_same_shape(OP, "q and the output", q, out)?;
    check_same_shape(OP, "output and its gradient", out, dout)?;
    if lse.dims() != [d.batch, d.q_heads, d.seq_q] {
        return Err(Error::shape(OP, format!("lse must be [{}, {}, {}], got {}", d.batch, d.q_heads, d.seq_q, lse.shape())));
    }
    let mut r = run(
        OP,
        &AttnBack { d },
        &[q, k, v, out, lse, dout],
        &[(q.shape().clone(), Out::Primary), (k.shape().clone(), Out::Primary), (v.shape().clone(), Out::Primary)],
    )?;
    let dv = r.pop().expect("three outputs");
    let dk = r.pop().expect("three outputs");
    Ok((r.pop().expect("three outputs"), dk, dv))
}

/// Folds a partial attention into another of the same queries over a
/// disjoint set of keys: with `l = log(e^{lse} + e^{lse_b})`, returns
/// `(e^{lse − l}·out + e^{lse_b − l}·out_b, l)`, which is attention over
/// both key sets together. Ring attention ([context
/// parallelism](https://arxiv.org/abs/2310.01889)) folds in one key/value
/// block at a time this way.
///
/// `out` and `out_b` are `[.., head_dim]` of one dtype, `lse` and `lse_b`
/// their log-sum-exps (`out`'s dimensions but the last), as [`attention`]
/// returns them. The result has `out`'s dtype: keep the running `out` in
/// f32 when the partials are half precision, so that rounding happens once.
/// A row whose `lse_b` is `−∞` (it saw no key) is left as it was.
pub fn attention_merge(out: &Tensor, lse: &Tensor, out_b: &Tensor, lse_b: &Tensor) -> Result<(Tensor, Tensor)> {
    const OP: &str = "attention_merge";
    let Some((&head_dim, rows)) = out.dims().split_last() else {
        return Err(Error::shape(OP, "the output must have at least one dimension (head_dim)"));
    };
    if lse.dims() != rows || lse_b.dims() != rows {
        return Err(Error::shape(
            OP,
            format!("log-sum-exps {} and {} for an output {}; each must be the output's shape without head_dim", lse.shape(), lse_b.shape(), out.shape()),
        ));
    }
    check_same_shape(OP, "the two outputs", out, out_b)?;
    if out.dtype() != out_b.dtype() {
        return Err(Error::DType {
            op: OP,
            expected: out.dtype().to_string(),
            got: out_b.dtype(),
            hint: "; convert the partial output to the running one's dtype first",
        });
    }
    let mut r = run(OP, &AttnMerge { head_dim }, &[out, lse, out_b, lse_b], &[(out.shape().clone(), Out::Primary), (lse.shape().clone(), Out::Compute)])?;
    let l = r.pop().expect("two outputs");
    Ok((r.pop().expect("two outputs"), l))
}

/// The heads of a fused self-attention projection: a tensor
/// `[batch, seq, (q_heads + 2·kv_heads)·head_dim]` that holds, for each
/// position and each key/value head `g`, the `q_heads / kv_heads` query heads
/// of its group, then key head `g`, then value head `g` (each `head_dim`
/// values). A column-parallel split of such a projection hands every rank
/// whole groups, which is why attention layers pack it this way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QkvHeads {
    /// Query heads.
    pub q_heads: usize,
    /// Key/value heads, each shared by `q_heads / kv_heads` query heads.
    pub kv_heads: usize,
    /// Values per head.
    pub head_dim: usize,
}

impl QkvHeads {
    /// Elements per position: `(q_heads + 2·kv_heads)·head_dim`.
    pub fn width(&self) -> usize {
        (self.q_heads + 2 * self.kv_heads) * self.head_dim
    }

    /// Checks `x` against these heads; returns `(batch, seq)`.
    pub(crate) fn check(&self, op: &'static str, x: &Tensor) -> Result<(usize, usize)> {
        let QkvHeads { q_heads, kv_heads, head_dim } = *self;
        if q_heads == 0 || kv_heads == 0 || head_dim == 0 || !q_heads.is_multiple_of(kv_heads) {
            return Err(Error::invalid(
                op,
                format!("{q_heads} query heads, {kv_heads} key/value heads of {head_dim}: all must be positive and kv_heads must divide q_heads"),
            ));
        }
        match x.dims() {
            &[b, t, w] if w == self.width() => Ok((b, t)),
            _ => Err(Error::shape(
                op,
                format!(
                    "packed q/k/v of shape {} for {q_heads} query and {kv_heads} key/value heads of {head_dim}; pass [batch, seq, {}] packed per key/value group as [q.. | k | v]",
                    x.shape(),
                    self.width()
                ),
            )),
        }
    }

    fn dims(&self, op: &'static str, x: &Tensor, opts: AttnOpts) -> Result<AttnDims> {
        let (b, t) = self.check(op, x)?;
        let scale = opts.scale.unwrap_or(1.0 / (self.head_dim as f64).sqrt());
        Ok(AttnDims { batch: b, q_heads: self.q_heads, kv_heads: self.kv_heads, seq_q: t, seq_kv: t, head_dim: self.head_dim, causal: opts.causal, scale })
    }
}

/// Self-attention straight from a fused projection `qkv` (see [`QkvHeads`]),
/// without splitting it into per-head tensors: returns the output
/// `[batch, seq, q_heads·head_dim]` (query heads in order, ready for the
/// output projection) and the log-sum-exp `[batch, q_heads, seq]`. Computes
/// exactly what [`attention`] computes on the split heads.
pub fn attention_packed(qkv: &Tensor, heads: QkvHeads, opts: AttnOpts) -> Result<(Tensor, Tensor)> {
    const OP: &str = "attention_packed";
    let d = heads.dims(OP, qkv, opts)?;
    count(&d, 4.0);
    let out = Shape::new(vec![d.batch, d.seq_q, d.q_heads * d.head_dim]);
    let lse = Shape::new(vec![d.batch, d.q_heads, d.seq_q]);
    let mut r = run(OP, &AttnFwdPacked { d }, &[qkv], &[(out, Out::Primary), (lse, Out::Compute)])?;
    let lse = r.pop().expect("two outputs");
    Ok((r.pop().expect("two outputs"), lse))
}

/// Backward of [`attention_packed`]: the gradient of `qkv`, in its layout,
/// from the forward's output and log-sum-exp and the upstream gradient `dout`
/// (shaped like the output).
pub fn attention_packed_backward(qkv: &Tensor, out: &Tensor, lse: &Tensor, dout: &Tensor, heads: QkvHeads, opts: AttnOpts) -> Result<Tensor> {
    const OP: &str = "attention_packed_backward";
    let d = heads.dims(OP, qkv, opts)?;
    count(&d, 10.0);
    let want = [d.batch, d.seq_q, d.q_heads * d.head_dim];
    if out.dims() != want {
        return Err(Error::shape(OP, format!("the output must be {:?}, got {}", want, out.shape())));
    }
    check_same_shape(OP, "output and its gradient", out, dout)?;
    if lse.dims() != [d.batch, d.q_heads, d.seq_q] {
        return Err(Error::shape(OP, format!("lse must be [{}, {}, {}], got {}", d.batch, d.q_heads, d.seq_q, lse.shape())));
    }
    run1(OP, &AttnBackPacked { d }, &[qkv, out, lse, dout], qkv.shape().clone(), Out::Primary)
}
