//! Fused causal self-attention with grouped-query heads.

use super::{check_same_shape, float_kernel, run};
use crate::backend::cpu::Out;
use crate::error::{Error, Result};
use crate::tensor::{Shape, Tensor};
use tessera_kernels::cpu::attention::{attention_backward as back, attention_forward as fwd, AttnDims};

float_kernel!(AttnFwd { d: AttnDims } |s, i, o| {
    let (out, lse) = o.split_at_mut(1);
    fwd(&s.d, i[0], i[1], i[2], out[0], lse[0])
});
float_kernel!(AttnBack { d: AttnDims } |s, i, o| {
    let (dq, rest) = o.split_at_mut(1);
    let (dk, dv) = rest.split_at_mut(1);
    back(&s.d, i[0], i[1], i[2], i[3], i[4], i[5], dq[0], dk[0], dv[0])
});

/// How queries attend: causally or not, and the factor on `q·k`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnOpts {
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

/// `softmax(q kᵀ · scale + mask) v` per head, without materialising the
/// score matrix. `q` is `[batch, q_heads, seq_q, head_dim]`, `k` and `v` are
/// `[batch, kv_heads, seq_kv, head_dim]` (query head `h` reads kv head
/// `h / (q_heads / kv_heads)`). Returns the output (shaped like `q`) and the
/// per-query log-sum-exp `[batch, q_heads, seq_q]` that the backward needs.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, opts: AttnOpts) -> Result<(Tensor, Tensor)> {
    const OP: &str = "attention";
    let d = dims(OP, q, k, v, opts)?;
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
