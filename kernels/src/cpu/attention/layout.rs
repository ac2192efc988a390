//! Where the rows of `q`, `k`, `v` and `out` (and of their gradients) live.
//!
//! The kernels address every head vector (one row of `head_dim` contiguous
//! elements) through a [`Place`], so they read and write either separate
//! per-head tensors or the fused layout a `qkv` projection produces, without
//! copying between the two. Which layouts exist is fixed here, and each one
//! gives distinct (tensor, batch, head, position) rows disjoint elements: that
//! is what lets tasks write their rows of a shared output buffer.

use super::AttnDims;
use crate::cpu::mixed::Stored;

/// Row `t` of head `j` of group `g` in batch `b` starts at
/// `base + b·batch + g·group + j·head + t·row` (`g` is the kv head; for
/// query-layout tensors `j` is the query head within its group, for key and
/// value tensors it is always 0).
#[derive(Clone, Copy, Debug)]
pub(super) struct Place {
    base: usize,
    batch: usize,
    group: usize,
    head: usize,
    row: usize,
}

impl Place {
    /// Offset of position `t` of query head `h` (or kv head `h` when the
    /// tensor has kv heads: then `group_size` is 1).
    #[inline]
    pub(super) fn at(&self, group_size: usize, b: usize, h: usize, t: usize) -> usize {
        self.base + b * self.batch + (h / group_size) * self.group + (h % group_size) * self.head + t * self.row
    }

    /// Elements between consecutive positions of one head.
    #[inline]
    pub(super) fn row(&self) -> usize {
        self.row
    }
}

/// The places of the four tensors of one attention call (each gradient shares
/// its tensor's place).
#[derive(Clone, Copy, Debug)]
pub(super) struct Layout {
    /// Queries and `dq`.
    pub q: Place,
    /// Keys and `dk`.
    pub k: Place,
    /// Values and `dv`.
    pub v: Place,
    /// The output and its gradient `dout`.
    pub o: Place,
}

impl Layout {
    /// Separate contiguous tensors: `q`, `out` `[batch, q_heads, seq_q, hd]`,
    /// `k`, `v` `[batch, kv_heads, seq_kv, hd]`.
    pub(super) fn heads(d: &AttnDims) -> Layout {
        let hd = d.head_dim;
        let (r, tq, tk) = (d.group(), d.seq_q, d.seq_kv);
        let q = Place { base: 0, batch: d.q_heads * tq * hd, group: r * tq * hd, head: tq * hd, row: hd };
        let kv = Place { base: 0, batch: d.kv_heads * tk * hd, group: tk * hd, head: 0, row: hd };
        Layout { q, k: kv, v: kv, o: q }
    }

    /// One fused buffer `[batch, seq, kv_heads, group + 2, hd]` holding, per
    /// position and kv head, its `group` query heads, its key and its value;
    /// `out` is `[batch, seq, q_heads, hd]` (query heads in order). Self
    /// attention only: `seq_q == seq_kv`.
    pub(super) fn packed(d: &AttnDims) -> Layout {
        let hd = d.head_dim;
        let (r, t) = (d.group(), d.seq_q);
        let slots = d.kv_heads * (r + 2) * hd;
        let q = Place { base: 0, batch: t * slots, group: (r + 2) * hd, head: hd, row: slots };
        let k = Place { base: r * hd, head: 0, ..q };
        let v = Place { base: (r + 1) * hd, head: 0, ..q };
        let o = Place { base: 0, batch: t * d.q_heads * hd, group: r * hd, head: hd, row: d.q_heads * hd };
        Layout { q, k, v, o }
    }
}

/// An output buffer that several tasks write, each its own rows.
///
/// Rows of distinct (batch, head, position) never share elements in a
/// [`Layout`], but the address ranges of two tasks' rows interleave, so the
/// tasks cannot hold `&mut` slices of them; they write through this pointer.
#[derive(Clone, Copy)]
pub(super) struct SharedOut<T> {
    ptr: *mut T,
    len: usize,
}

// SAFETY: tasks write disjoint rows (see `write_stored`'s contract) and nothing
// reads the buffer while they run.
unsafe impl<T: Send> Send for SharedOut<T> {}
unsafe impl<T: Send> Sync for SharedOut<T> {}

impl<T: Copy> SharedOut<T> {
    /// Wraps `buf`, which must stay borrowed for as long as the copies live.
    pub(super) fn new(buf: &mut [T]) -> Self {
        SharedOut { ptr: buf.as_mut_ptr(), len: buf.len() }
    }

    /// Writes `src`, computed in `C`, to `offset..offset + src.len()`, each
    /// value rounded to the stored type (a plain copy when they agree).
    ///
    /// # Safety
    /// The buffer passed to [`new`](Self::new) must still be borrowed, and no
    /// other task may read or write this range while it runs.
    #[inline]
    pub(super) unsafe fn write_stored<C: Copy>(&self, offset: usize, src: &[C])
    where
        T: Stored<C>,
    {
        assert!(offset + src.len() <= self.len, "attention: output row out of bounds");
        // A slice of the row (no other task touches it) lets the loop vectorise.
        let dst = std::slice::from_raw_parts_mut(self.ptr.add(offset), src.len());
        for (d, &v) in dst.iter_mut().zip(src) {
            *d = T::store(v);
        }
    }
}
