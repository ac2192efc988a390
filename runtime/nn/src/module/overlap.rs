//! Tensor-parallel communication that overlaps the products around it,
//! under sequence parallelism.
//!
//! With sequence parallelism a column-parallel product needs the whole
//! sequence (an all-gather of the ranks' slices first) and the sum of a
//! row-parallel product's partial outputs is reduce-scattered back to the
//! slices. Done whole, each collective waits for the product before it or
//! holds up the one after it. Overlapped ([`Cx::with_tp_overlap`]):
//!
//! - **gather, then multiply** ([`gather_map`]): the other ranks' slices
//!   are all-gathered in the background while the product of this rank's
//!   own slice, which needs nothing from them, runs; then theirs;
//! - **multiply, then reduce-scatter** ([`map_reduce_scatter`]): cut into
//!   `c` pieces along the tokens, the product of each piece is
//!   reduce-scattered while the next piece's runs;
//! - **multiply, then sum this rank's slice** ([`map_scatter_sum`], for a
//!   row-parallel layer's output, which its caller needs right away): the
//!   product of each other rank's slice is sent to that rank while the next
//!   runs, this rank's own last; then the others' parts of this rank's
//!   slice, long arrived, are summed with its own. Cut into pieces, the
//!   last piece's reduce-scatter would wait in the open for both ranks'
//!   threads to meet; a message that was sent needs no meeting.
//!
//! A reduce-scatter piece is the same rows of every rank's slice: piece `i`
//! of a slice of `s/tp` tokens is tokens `[a, b)` of each slice, so that its
//! reduce-scatter (over dimension 1) sums exactly those rows, each piece's
//! result its part of this rank's slice. The products see the rows in that
//! strided order, which is harmless (every token is multiplied on its own).
//! The collectives and the sums of sent slices move the same values and sum
//! them in the same order as whole ones; only the products may round
//! differently, as a kernel may block a product of fewer rows differently
//! (the results agree to the dtype's rounding, and a run is as reproducible
//! as without overlap).
//!
//! A row-parallel layer's forward cannot reduce its own output (its layout
//! is a `PartialSum`, reduced by the `all_reduce` its caller writes), so it
//! sends the other slices' parts and leaves what is left to do on the
//! context ([`Cx::start_reduction`]) beside the partial value it returns;
//! `all_reduce` takes them when it is handed that same value
//! ([`Cx::take_reduction`]) and falls back to the whole collective for any
//! other.

use super::Cx;
use std::ops::Range;
use std::sync::Arc;
use tessera_core::tensor::{DType, Tensor};
use tessera_core::Result;
use tessera_dist::{Communicator, Pending};

/// `len` tokens cut into at most `chunks` near-equal, non-empty, consecutive pieces.
pub(crate) fn pieces(len: usize, chunks: usize) -> Vec<Range<usize>> {
    let n = chunks.clamp(1, len.max(1));
    (0..n).map(|i| i * len / n..(i + 1) * len / n).filter(|r| !r.is_empty()).collect()
}

/// The rows `piece` of each of the `tp` slices of the whole-sequence `x`
/// (dimension 1), slice after slice: `[batch, tp·piece.len(), ..]`.
fn rows_of_every_slice(x: &Tensor, tp: usize, piece: &Range<usize>) -> Result<Tensor> {
    let slice = x.dims()[1] / tp;
    let parts: Vec<Tensor> = (0..tp).map(|r| x.narrow(1, r * slice + piece.start, piece.len())).collect::<Result<_>>()?;
    Tensor::concat(&parts.iter().collect::<Vec<_>>(), 1)
}

/// `f` of the whole sequence gathered from this rank's slice `x`, the
/// gather running while `f` of this rank's own slice does: the other
/// slices are all-gathered in the background, `f` runs on the slice this
/// rank already holds, then on each other rank's slice once they are in.
/// `f` must treat each token (dimension 1) on its own. Also returns, with
/// `keep`, the gathered sequence (for a product that needs it whole
/// afterwards).
///
/// Only the wait for the other slices, if they are not in by the time the
/// own slice's product ends, is left in the open: on a group of `tp`
/// ranks, that product is `1/tp` of the work, against the transfer of
/// `(tp − 1)/tp` of the sequence.
pub(crate) fn gather_map(cx: &Cx, x: &Tensor, keep: bool, mut f: impl FnMut(&Tensor) -> Result<Tensor>) -> Result<(Tensor, Option<Tensor>)> {
    let (rank, tp, len) = (cx.tp().rank(), cx.tp().size(), x.dims()[1]);
    let travelling = cx.tp().all_gather_async(x, 1)?;
    let own = f(x)?;
    let gathered = travelling.wait()?;
    let mut outs = Vec::with_capacity(tp);
    for r in 0..tp {
        outs.push(if r == rank { own.clone() } else { f(&gathered.narrow(1, r * len, len)?.contiguous()?)? });
    }
    Ok((Tensor::concat(&outs.iter().collect::<Vec<_>>(), 1)?, keep.then_some(gathered)))
}

/// The reduce-scatter over the group of `f` of the whole-sequence `x`, cut
/// into `chunks` pieces: each piece's sum starts while the next piece's `f`
/// runs. `f` must treat each token (dimension 1) on its own.
pub(crate) fn map_reduce_scatter(cx: &Cx, x: &Tensor, chunks: usize, mut f: impl FnMut(&Tensor) -> Result<Tensor>) -> Result<ReduceScatter> {
    let tp = cx.tp().size();
    let pieces = pieces(x.dims()[1] / tp, chunks);
    if pieces.len() < 2 {
        // Nothing to cut: the whole product, then the whole collective.
        let y = f(x)?;
        return Ok(ReduceScatter { travelling: vec![cx.tp().reduce_scatter_sum_async(&y, 1)?] });
    }
    let mut travelling = Vec::with_capacity(pieces.len());
    for p in &pieces {
        let y = f(&rows_of_every_slice(x, tp, p)?)?;
        travelling.push(cx.tp().reduce_scatter_sum_async(&y, 1)?);
    }
    Ok(ReduceScatter { travelling })
}

/// This rank's slice of the sum over the group of `f` of the
/// whole-sequence `x` (what a reduce-scatter of `f(x)` over dimension 1
/// gives, bit for bit), by point-to-point messages: `f` of each other
/// rank's slice, in the order `rank + 1, rank + 2, ...`, sent to that rank
/// in the background while the next runs, then `f` of this rank's own
/// slice; [`ScatterSum::wait`] receives the others' parts of this slice
/// and sums them. `f` must treat each token (dimension 1) on its own.
pub(crate) fn map_scatter_sum(cx: &Cx, x: &Tensor, mut f: impl FnMut(&Tensor) -> Result<Tensor>) -> Result<ScatterSum> {
    let (rank, tp) = (cx.tp().rank(), cx.tp().size());
    let len = x.dims()[1] / tp;
    let slice = |q: usize| x.narrow(1, q * len, len).and_then(|t| t.contiguous());
    let mut parts: Vec<Option<Tensor>> = vec![None; tp];
    let mut sent = Vec::with_capacity(tp - 1);
    for q in (1..tp).map(|i| (rank + i) % tp) {
        let y = f(&slice(q)?)?;
        sent.push(cx.tp().send_async(&y, q)?);
        parts[q] = Some(y);
    }
    parts[rank] = Some(f(&slice(rank)?)?);
    let parts = parts.into_iter().map(|p| p.expect("every slice computed")).collect();
    Ok(ScatterSum { parts, sent, rank, group: Some(cx.groups().tp.clone()) })
}

/// A sum over the group of this rank's slice whose other parts were sent
/// ([`map_scatter_sum`]).
///
/// The others' parts wait as messages until [`wait`](Self::wait) receives
/// them. A sum that nothing takes (its value reduced some other way)
/// receives them when it is dropped, which every rank does at the same
/// point of the same program: a message left behind would be taken by the
/// next sum's receive instead of its own.
pub(crate) struct ScatterSum {
    /// `f` of every rank's slice, in rank order (this rank's summand).
    parts: Vec<Tensor>,
    sent: Vec<Pending<()>>,
    rank: usize,
    /// The group the parts travel in, until they are received.
    group: Option<Arc<dyn Communicator>>,
}

impl ScatterSum {
    /// This rank's summand for the whole sequence, in order.
    pub(crate) fn summand(&self) -> Result<Tensor> {
        Tensor::concat(&self.parts.iter().collect::<Vec<_>>(), 1)
    }

    /// Receives the other ranks' parts of this rank's slice and sums them
    /// with its own, in rank order, in f32 (f64 for f64) rounded once, as
    /// the communicators' reductions do.
    pub(crate) fn wait(mut self) -> Result<Tensor> {
        let group = self.group.take().expect("received once");
        let own = &self.parts[self.rank];
        let dtype = own.dtype();
        let full = if dtype == DType::F64 { DType::F64 } else { DType::F32 };
        let mut sum: Option<Tensor> = None;
        for q in 0..self.parts.len() {
            let part = if q == self.rank { own.clone() } else { group.recv(q)? };
            match &sum {
                None => sum = Some(part.to_dtype(full)?),
                Some(acc) => tessera_core::ops::accumulate(acc, &part)?,
            }
        }
        for s in std::mem::take(&mut self.sent) {
            s.wait()?;
        }
        let sum = sum.expect("a group has a rank");
        if dtype == full {
            Ok(sum)
        } else {
            sum.to_dtype(dtype)
        }
    }
}

impl Drop for ScatterSum {
    fn drop(&mut self) {
        if let Some(group) = self.group.take() {
            // Nothing took this sum: its messages are received and dropped
            // (a failed peer makes these return at once).
            for q in (0..self.parts.len()).filter(|&q| q != self.rank) {
                let _ = group.recv(q);
            }
        }
    }
}

/// A reduce-scatter started piece by piece ([`map_reduce_scatter`]).
pub(crate) struct ReduceScatter {
    travelling: Vec<Pending>,
}

impl ReduceScatter {
    /// Waits for every piece: this rank's slice of the sum.
    pub(crate) fn wait(self) -> Result<Tensor> {
        let parts: Vec<Tensor> = self.travelling.into_iter().map(Pending::wait).collect::<Result<_>>()?;
        Tensor::concat(&parts.iter().collect::<Vec<_>>(), 1)
    }
}

/// A reduction left running by a row-parallel forward for the `all_reduce`
/// that its caller applies to `value`.
pub(crate) struct InFlight {
    /// The partial value the layer returned (kept, so that its storage is
    /// never reused for another tensor while this waits to be matched).
    pub(crate) value: Tensor,
    pub(crate) sum: ScatterSum,
}

impl InFlight {
    /// Whether `t` is the value this reduction sums.
    pub(crate) fn sums(&self, t: &Tensor) -> bool {
        t.shares_storage(&self.value) && t.layout() == self.value.layout()
    }
}

#[cfg(test)]
mod tests {
    use super::pieces;

    #[test]
    fn pieces_cover_the_slice_in_order() {
        for len in 0..40 {
            for chunks in 0..12 {
                let p = pieces(len, chunks);
                assert!(p.len() <= chunks.max(1));
                assert_eq!(p.iter().map(|r| r.len()).sum::<usize>(), len);
                assert!(p.windows(2).all(|w| w[0].end == w[1].start && !w[1].is_empty()));
                if len >= chunks && chunks > 0 {
                    assert_eq!(p.len(), chunks, "{len} {chunks}");
                    let (lo, hi) = (p.iter().map(|r| r.len()).min().unwrap(), p.iter().map(|r| r.len()).max().unwrap());
                    assert!(hi - lo <= 1);
                }
            }
        }
    }
}
