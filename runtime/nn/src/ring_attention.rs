//! Ring attention: causal attention over a sequence split across the
//! context-parallel group (Liu et al., 2023, "Ring Attention with Blockwise
//! Transformers"), with the load-balanced split of [`ContextSplit`].
//!
//! Each rank holds the queries, keys and values of its two chunks. The key/
//! value blocks travel around the ring: at step `s` a rank holds rank
//! `r − s`'s block, forwards it to rank `r + 1` *before* computing with it
//! (sends are buffered, so the transfer overlaps the computation), folds the
//! block's partial attention into its running output with
//! [`ops::attention_merge`], and receives the next block. With the zigzag
//! split every step but the first is one full (unmasked) block of the same
//! size on every rank:
//!
//! * step 0, its own block: causal attention over its two chunks in order
//!   (the early chunk precedes the late one in the sequence);
//! * a block from a rank `j < r`: only its early chunk is visible, to all of
//!   this rank's queries;
//! * a block from a rank `j > r`: both chunks are visible, to this rank's
//!   late chunk only.
//!
//! The backward makes the same journey: the key/value blocks go around
//! again, each accompanied by the gradients of its keys and values, which
//! every rank adds its part to before passing them on; after `cp` steps
//! each block's gradients arrive back at the rank that owns it. The
//! partial backwards read the final output and log-sum-exp, which is what
//! makes each block's gradient exact. Running outputs, log-sum-exps and
//! gradients are kept in f32 (f64 for f64 inputs), so a half-precision run
//! rounds once, as the single-rank kernel does.

use crate::module::ContextSplit;
use tessera_core::ops::{self, AttnOpts, QkvHeads};
use tessera_core::tensor::{DType, Tensor};
use tessera_core::{Error, Result};
use tessera_dist::Communicator;

/// What ring attention keeps for its backward: the rotated queries, keys
/// and values in heads layout, the output and the log-sum-exp.
pub(crate) struct RingSaved {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    /// The output as returned (`[batch, seq, hq·d]`): the one copy of it the
    /// next layer keeps too; the backward takes its per-head view.
    packed: Tensor,
    lse: Tensor,
}

impl RingSaved {
    /// Bytes of activation memory held.
    pub(crate) fn bytes(&self) -> usize {
        [&self.q, &self.k, &self.v, &self.packed, &self.lse].into_iter().map(crate::bytes_of).sum()
    }
}

/// Attention over every key: a partial's rows are attended in full.
const FULL: AttnOpts = AttnOpts { causal: false, scale: None };

/// The dtype the running sums are kept in.
fn wide(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// The neighbours of this rank in the ring: `(next, previous)`.
fn neighbours(cp: &dyn Communicator) -> (usize, usize) {
    let (r, n) = (cp.rank(), cp.size());
    ((r + 1) % n, (r + n - 1) % n)
}

/// The packed `[batch, seq, (hq + 2·hkv)·d]` projection as queries
/// `[batch, hq, seq, d]` and keys and values `[batch, hkv, seq, d]`.
fn unpack(qkv: &Tensor, h: QkvHeads) -> Result<(Tensor, Tensor, Tensor)> {
    let &[b, t, _] = qkv.dims() else {
        return Err(Error::shape("ring attention", format!("a packed projection of shape {}; pass [batch, seq, features]", qkv.shape())));
    };
    let (g, r, d) = (h.kv_heads, h.q_heads / h.kv_heads, h.head_dim);
    let x = qkv.reshape([b, t, g, r + 2, d])?;
    let heads = |from: usize, n: usize, count: usize| -> Result<Tensor> { x.narrow(3, from, n)?.reshape([b, t, count, d])?.transpose(1, 2)?.contiguous() };
    Ok((heads(0, r, h.q_heads)?, heads(r, 1, g)?, heads(r + 1, 1, g)?))
}

/// The inverse of [`unpack`]: the gradients in the packed layout.
fn pack(dq: &Tensor, dk: &Tensor, dv: &Tensor, h: QkvHeads) -> Result<Tensor> {
    let &[b, _, t, d] = dq.dims() else { unreachable!("queries are [batch, heads, seq, head_dim]") };
    let (g, r) = (h.kv_heads, h.q_heads / h.kv_heads);
    let part = |x: &Tensor, n: usize| x.transpose(1, 2)?.reshape([b, t, g, n, d]);
    let parts = [part(dq, r)?, part(dk, 1)?, part(dv, 1)?];
    Tensor::concat(&parts.iter().collect::<Vec<_>>(), 3)?.reshape([b, t, (h.q_heads + 2 * g) * d])
}

/// `x`'s early and late chunk (`c` positions each along dim 2), contiguous.
fn halves(x: &Tensor, c: usize) -> Result<[Tensor; 2]> {
    Ok([x.narrow(2, 0, c)?.contiguous()?, x.narrow(2, c, c)?.contiguous()?])
}

/// Causal attention of this rank's packed, rotated projection `qkv` (its
/// two chunks of every sequence) over the whole sequence, its keys and
/// values passed around the ring `cp`. Returns the output in the packed
/// output layout `[batch, seq, hq·d]` and what the backward needs.
pub(crate) fn forward(cp: &dyn Communicator, h: QkvHeads, qkv: &Tensor) -> Result<(Tensor, RingSaved)> {
    let split = ContextSplit::new(cp.rank(), cp.size())?;
    let (q, k, v) = unpack(qkv, h)?;
    let &[b, hq, t, d] = q.dims() else { unreachable!("unpacked queries are 4-d") };
    let c = split.chunk(t)?;
    let (r, n) = (split.rank(), split.size());
    let (next, prev) = neighbours(cp);
    let wide = wide(q.dtype());
    // The running output and log-sum-exp of the early and the late chunk.
    let mut acc: Option<[(Tensor, Tensor); 2]> = None;
    let mut block = (k.clone(), v.clone());
    for s in 0..n {
        if s + 1 < n {
            cp.send(&block.0, next)?;
            cp.send(&block.1, next)?;
        }
        let j = (r + n - s) % n;
        if let Some(acc) = acc.as_mut() {
            if j < r {
                let (o, l) = ops::attention(&q, &block.0.narrow(2, 0, c)?, &block.1.narrow(2, 0, c)?, FULL)?;
                let (o, l) = (halves(&o.to_dtype(wide)?, c)?, halves(&l, c)?);
                for (i, (o, l)) in o.iter().zip(&l).enumerate() {
                    acc[i] = ops::attention_merge(&acc[i].0, &acc[i].1, o, l)?;
                }
            } else {
                let (o, l) = ops::attention(&q.narrow(2, c, c)?, &block.0, &block.1, FULL)?;
                acc[1] = ops::attention_merge(&acc[1].0, &acc[1].1, &o.to_dtype(wide)?, &l)?;
            }
        } else {
            let (o, l) = ops::attention(&q, &block.0, &block.1, AttnOpts::causal())?;
            let ([oa, ob], [la, lb]) = (halves(&o.to_dtype(wide)?, c)?, halves(&l, c)?);
            acc = Some([(oa, la), (ob, lb)]);
        }
        if s + 1 < n {
            block = (cp.recv(prev)?, cp.recv(prev)?);
        }
    }
    let [(oa, la), (ob, lb)] = acc.expect("the ring has at least one step");
    let out = Tensor::concat(&[&oa, &ob], 2)?.to_dtype(q.dtype())?;
    let lse = Tensor::concat(&[&la, &lb], 2)?;
    let packed = out.transpose(1, 2)?.reshape([b, t, hq * d])?;
    drop(out);
    Ok((packed.clone(), RingSaved { q, k, v, packed, lse }))
}

/// The backward of [`forward`]: the gradient of the packed, rotated
/// projection from the gradient `dy` of the packed output.
pub(crate) fn backward(cp: &dyn Communicator, h: QkvHeads, saved: RingSaved, dy: &Tensor) -> Result<Tensor> {
    let RingSaved { q, k, v, packed, lse } = saved;
    let split = ContextSplit::new(cp.rank(), cp.size())?;
    let &[b, hq, t, d] = q.dims() else { unreachable!("saved queries are 4-d") };
    let out = packed.reshape([b, t, hq, d])?.transpose(1, 2)?.contiguous()?;
    drop(packed);
    if dy.dims() != [b, t, hq * d] {
        return Err(Error::shape("ring attention backward", format!("upstream gradient {} for an output of [{b}, {t}, {}]", dy.shape(), hq * d)));
    }
    let c = split.chunk(t)?;
    let (r, n) = (split.rank(), split.size());
    let (next, prev) = neighbours(cp);
    let wide = wide(q.dtype());
    let dout = dy.reshape([b, t, hq, d])?.transpose(1, 2)?.contiguous()?;
    let late = |x: &Tensor| x.narrow(2, c, c);
    let zeros = |x: &Tensor| Tensor::zeros(late(x)?.shape().clone(), wide, x.device());
    // This rank's query gradient, by chunk.
    let dq = [zeros(&q)?, zeros(&q)?];
    let mut block = (k, v);
    for s in 0..n {
        if s + 1 < n {
            cp.send(&block.0, next)?;
            cp.send(&block.1, next)?;
        }
        let j = (r + n - s) % n;
        // This rank's part of the block's key and value gradients, by chunk
        // (`None`: no part in that chunk).
        let (dk, dv): ([Option<Tensor>; 2], [Option<Tensor>; 2]) = if s == 0 || j > r {
            let (dq_p, dk, dv) = if s == 0 {
                ops::attention_backward(&q, &block.0, &block.1, &out, &lse, &dout, AttnOpts::causal())?
            } else {
                ops::attention_backward(&late(&q)?, &block.0, &block.1, &late(&out)?, &late(&lse)?, &late(&dout)?, FULL)?
            };
            if s == 0 {
                let [a, l] = halves(&dq_p, c)?;
                ops::accumulate(&dq[0], &a)?;
                ops::accumulate(&dq[1], &l)?;
            } else {
                ops::accumulate(&dq[1], &dq_p)?;
            }
            let ([ka, kl], [va, vl]) = (halves(&dk, c)?, halves(&dv, c)?);
            ([Some(ka), Some(kl)], [Some(va), Some(vl)])
        } else {
            let (dq_p, dk, dv) = ops::attention_backward(&q, &block.0.narrow(2, 0, c)?, &block.1.narrow(2, 0, c)?, &out, &lse, &dout, FULL)?;
            let [a, l] = halves(&dq_p, c)?;
            ops::accumulate(&dq[0], &a)?;
            ops::accumulate(&dq[1], &l)?;
            ([Some(dk), None], [Some(dv), None])
        };
        // The block's gradients so far come from the previous rank (none
        // at the first step: the block is this rank's own); add this
        // rank's part and pass them on, towards the block's owner.
        let grads: Vec<Tensor> = if s == 0 {
            dk.into_iter().chain(dv).map(|g| g.expect("the own block has every part").to_dtype(wide)).collect::<Result<_>>()?
        } else {
            let grads: Vec<Tensor> = (0..4).map(|_| cp.recv(prev)).collect::<Result<_>>()?;
            for (acc, part) in grads.iter().zip(dk.iter().chain(&dv)) {
                if let Some(part) = part {
                    ops::accumulate(acc, part)?;
                }
            }
            grads
        };
        for g in &grads {
            cp.send(g, next)?;
        }
        if s + 1 < n {
            block = (cp.recv(prev)?, cp.recv(prev)?);
        }
    }
    // This rank's own block's gradients, back from their trip around the ring.
    let own: Vec<Tensor> = (0..4).map(|_| cp.recv(prev)).collect::<Result<_>>()?;
    let dtype = q.dtype();
    let join = |a: &Tensor, l: &Tensor| Tensor::concat(&[a, l], 2)?.to_dtype(dtype);
    pack(&join(&dq[0], &dq[1])?, &join(&own[0], &own[1])?, &join(&own[2], &own[3])?, h)
}
