//! Rotary position embedding ("rotate half" convention, as HF Llama).

use super::QkvHeads;
use super::{float_kernel, run1};
use crate::backend::cuda::args::{Arg, Grid};
use crate::backend::cuda::CudaCall;
use crate::backend::kernel::Out;
use crate::error::{Error, Result};
use crate::tensor::check_same_shape;
use crate::tensor::Tensor;
use std::any::Any;
use std::sync::OnceLock;
use tessera_kernels::cpu::rope::{
    rope_backward as back, rope_forward as fwd, rope_packed_backward as back_packed, rope_packed_forward as fwd_packed, PackedHeads, RopeTable,
};
use tessera_kernels::Real;

/// Precomputed rotation angles for heads of `head_dim` at positions below `max_position`.
pub struct Rope {
    head_dim: usize,
    max_position: usize,
    theta: f64,
    f32: OnceLock<RopeTable<f32>>,
    f64: OnceLock<RopeTable<f64>>,
}

impl Rope {
    /// Angles `pos * theta^(-2i/head_dim)`; `theta` is 10000 in most models.
    pub fn new(head_dim: usize, max_position: usize, theta: f64) -> Result<Rope> {
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(Error::invalid("rope", format!("head_dim must be even and positive, got {head_dim}")));
        }
        if !(theta.is_finite() && theta > 1.0) {
            return Err(Error::invalid("rope", format!("theta must be a finite number above 1 (usually 10000), got {theta}")));
        }
        Ok(Rope { head_dim, max_position, theta, f32: OnceLock::new(), f64: OnceLock::new() })
    }

    /// The table in the compute type `T` (built on first use).
    fn table<T: Real>(&self) -> &RopeTable<T> {
        let (d, m, th) = (self.head_dim, self.max_position, self.theta);
        let any: &dyn Any = if std::any::TypeId::of::<T>() == std::any::TypeId::of::<f64>() {
            self.f64.get_or_init(|| RopeTable::new(m, d, th))
        } else {
            self.f32.get_or_init(|| RopeTable::new(m, d, th))
        };
        any.downcast_ref().expect("compute types are f32 and f64")
    }

    fn check(&self, op: &'static str, x: &Tensor, positions: &[u32]) -> Result<(usize, usize)> {
        let &[b, h, t, d] = x.dims() else {
            return Err(Error::shape(op, format!("expects [batch, heads, seq, head_dim], got {}", x.shape())));
        };
        self.check_heads(op, d, t, positions)?;
        Ok((b * h, t))
    }

    /// Checks the head size and the positions of a sequence of `t`.
    fn check_heads(&self, op: &'static str, d: usize, t: usize, positions: &[u32]) -> Result<()> {
        if d != self.head_dim {
            return Err(Error::shape(op, format!("head_dim is {d} but the table was built for {}", self.head_dim)));
        }
        if positions.len() != t {
            return Err(Error::shape(op, format!("{} positions given for a sequence of {t}", positions.len())));
        }
        if let Some(p) = positions.iter().position(|&p| p as usize >= self.max_position) {
            return Err(Error::IndexOutOfRange {
                op,
                index: positions[p] as u64,
                position: p,
                bound: self.max_position as u64,
                hint: "; build the Rope with a larger max_position",
            });
        }
        Ok(())
    }

    fn check_packed(&self, op: &'static str, x: &Tensor, heads: QkvHeads, positions: &[u32]) -> Result<(PackedHeads, usize)> {
        let (_, t) = heads.check(op, x)?;
        self.check_heads(op, heads.head_dim, t, positions)?;
        Ok((PackedHeads { kv_heads: heads.kv_heads, group: heads.q_heads / heads.kv_heads }, t))
    }
}

float_kernel!(writes_all RopeK<'a> { rope: &'a Rope, positions: &'a [u32], bh: usize, seq: usize, inverse: bool } |s, i, o| {
    let table = s.rope.table::<T>();
    if s.inverse {
        back(table, i[0], s.bh, s.seq, s.positions, o[0])
    } else {
        fwd(table, i[0], s.bh, s.seq, s.positions, o[0])
    }
}; cuda |s, c| rope_cuda(c, s.rope, s.positions, s.bh * s.seq, (1, 1, 1), s.inverse));

/// Rotates `x` (`[batch, heads, seq, head_dim]`) by the angles of `positions` (one per sequence index).
pub fn rope(x: &Tensor, rope: &Rope, positions: &[u32]) -> Result<Tensor> {
    let (bh, seq) = rope.check("rope", x, positions)?;
    run1("rope", &RopeK { rope, positions, bh, seq, inverse: false }, &[x], x.shape().clone(), Out::Primary)
}

/// Backward of [`rope`]: the inverse rotation applied to the upstream gradient.
pub fn rope_backward(dy: &Tensor, rope: &Rope, positions: &[u32]) -> Result<Tensor> {
    let (bh, seq) = rope.check("rope_backward", dy, positions)?;
    run1("rope_backward", &RopeK { rope, positions, bh, seq, inverse: true }, &[dy], dy.shape().clone(), Out::Primary).and_then(|dx| {
        check_same_shape("rope_backward", "gradient", &dx, dy)?;
        Ok(dx)
    })
}

float_kernel!(writes_all RopePackedK<'a> { rope: &'a Rope, positions: &'a [u32], heads: PackedHeads, seq: usize, inverse: bool } |s, i, o| {
    let table = s.rope.table::<T>();
    if s.inverse {
        back_packed(table, i[0], s.heads, s.seq, s.positions, o[0])
    } else {
        fwd_packed(table, i[0], s.heads, s.seq, s.positions, o[0])
    }
}; cuda |s, c| {
    let (kv, group) = (s.heads.kv_heads, s.heads.group);
    let rows = c.output_len(0) / s.rope.head_dim;
    rope_cuda(c, s.rope, s.positions, rows, (kv * (group + 2), group + 2, group + 1), s.inverse)
});

/// RoPE on a GPU (`rope.cu`): `rows` rows of `head_dim`, with
/// `(per_position, period, rotated)` saying which rows rotate at which
/// sequence index. The cos and sin of each sequence index's position are
/// computed here exactly as the CPU's f32 table and uploaded.
fn rope_cuda(
    c: &mut CudaCall,
    rope: &Rope,
    positions: &[u32],
    rows: usize,
    (per_position, period, rotated): (usize, usize, usize),
    inverse: bool,
) -> Result<()> {
    let (half, seq) = (rope.head_dim / 2, positions.len());
    let inv_freq: Vec<f64> = (0..half).map(|i| rope.theta.powf(-2.0 * i as f64 / rope.head_dim as f64)).collect();
    let angles = || positions.iter().flat_map(|&p| inv_freq.iter().map(move |f| p as f64 * f));
    let table: Vec<f32> = angles().map(|a| a.cos() as f32).chain(angles().map(|a| a.sin() as f32)).collect();
    let table = Arg::Scratch(c.upload_f32(&table)?);
    let sign = if inverse { -1.0 } else { 1.0 };
    let args = [
        Arg::Input(0),
        Arg::Output(0),
        table,
        Arg::U64(rows),
        Arg::U64(seq),
        Arg::U64(half),
        Arg::U64(per_position),
        Arg::U64(period),
        Arg::U64(rotated),
        Arg::F32(sign),
    ];
    c.at_least(Arg::Input(0), rows * rope.head_dim)?;
    c.at_least(Arg::Output(0), rows * rope.head_dim)?;
    // SAFETY: the kernel reads and writes `rows` rows of `head_dim` (checked) and, for the
    // row at sequence index `(r / per_position) % seq`, that index's `2 * half` table entries
    // (the table was built with `seq * half` cosines then as many sines).
    unsafe { c.launch("rope", "rope", Grid::Items(rows * half), &args) }
}

/// [`rope`] on the query and key heads of a fused projection
/// `[batch, seq, (q_heads + 2·kv_heads)·head_dim]` (see [`QkvHeads`]); the
/// value heads pass through unchanged.
pub fn rope_packed(qkv: &Tensor, rope: &Rope, positions: &[u32], heads: QkvHeads) -> Result<Tensor> {
    let (heads, seq) = rope.check_packed("rope_packed", qkv, heads, positions)?;
    run1("rope_packed", &RopePackedK { rope, positions, heads, seq, inverse: false }, &[qkv], qkv.shape().clone(), Out::Primary)
}

/// Backward of [`rope_packed`]: the inverse rotation of the query and key
/// heads of the upstream gradient, value heads unchanged.
pub fn rope_packed_backward(dy: &Tensor, rope: &Rope, positions: &[u32], heads: QkvHeads) -> Result<Tensor> {
    let (heads, seq) = rope.check_packed("rope_packed_backward", dy, heads, positions)?;
    run1("rope_packed_backward", &RopePackedK { rope, positions, heads, seq, inverse: true }, &[dy], dy.shape().clone(), Out::Primary)
}
