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
//!   reduce-scattered while the next piece's runs.
//!
//! A reduce-scatter piece is the same rows of every rank's slice: piece `i`
//! of a slice of `s/tp` tokens is tokens `[a, b)` of each slice, so that its
//! reduce-scatter (over dimension 1) sums exactly those rows. The products
//! see the rows in that strided order, which is harmless (every token is
//! multiplied on its own) and undone when the pieces are assembled. The
//! collectives move the same values and sum them in the same order as
//! whole ones; only the products may round differently, as a kernel may
//! block a product of fewer rows differently (the results agree to the
//! dtype's rounding, and a run is as reproducible as without overlap).
//!
//! A row-parallel layer's forward cannot reduce its own output (its layout
//! is a `PartialSum`, reduced by the `all_reduce` its caller writes), so it
//! starts the reduce-scatter of each piece and leaves the handles on the
//! context ([`Cx::start_reduction`]) beside the partial value it returns;
//! `all_reduce` takes them when it is handed that same value
//! ([`Cx::take_reduction`]) and falls back to the whole collective for any
//! other.

use super::Cx;
use std::ops::Range;
use tessera_core::tensor::Tensor;
use tessera_core::Result;
use tessera_dist::Pending;

/// `len` tokens cut into at most `chunks` near-equal, non-empty, consecutive pieces.
pub(crate) fn pieces(len: usize, chunks: usize) -> Vec<Range<usize>> {
    let n = chunks.clamp(1, len.max(1));
    (0..n).map(|i| i * len / n..(i + 1) * len / n).filter(|r| !r.is_empty()).collect()
}

/// `len` tokens cut into at most `chunks` consecutive, non-empty pieces,
/// each half as long as the one before.
pub(crate) fn shrinking_pieces(len: usize, chunks: usize) -> Vec<Range<usize>> {
    let n = chunks.clamp(1, len.max(1)).min(20) as u32;
    let total = (1usize << n) - 1;
    let end = |i: u32| len * (total - ((1usize << (n - i)) - 1)) / total;
    (0..n).map(|i| end(i)..end(i + 1)).filter(|r| !r.is_empty()).collect()
}

/// The rows `piece` of each of the `tp` slices of the whole-sequence `x`
/// (dimension 1), slice after slice: `[batch, tp·piece.len(), ..]`.
fn rows_of_every_slice(x: &Tensor, tp: usize, piece: &Range<usize>) -> Result<Tensor> {
    let slice = x.dims()[1] / tp;
    let parts: Vec<Tensor> = (0..tp).map(|r| x.narrow(1, r * slice + piece.start, piece.len())).collect::<Result<_>>()?;
    Tensor::concat(&parts.iter().collect::<Vec<_>>(), 1)
}

/// The whole sequence back in order from each piece's rows of every slice
/// (the inverse of [`rows_of_every_slice`] over all pieces).
fn assemble(outs: &[Tensor], pieces: &[Range<usize>], tp: usize) -> Result<Tensor> {
    let mut parts = Vec::with_capacity(tp * pieces.len());
    for r in 0..tp {
        for (out, piece) in outs.iter().zip(pieces) {
            parts.push(out.narrow(1, r * piece.len(), piece.len())?);
        }
    }
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
///
/// With `last_blocking` (for a caller that needs the sum next, with nothing
/// to do meanwhile) the calling thread reduces the last piece itself, after
/// the others, sparing it the hand-off to the communication thread and back.
pub(crate) fn map_reduce_scatter(
    cx: &Cx,
    x: &Tensor,
    chunks: usize,
    last_blocking: bool,
    mut f: impl FnMut(&Tensor) -> Result<Tensor>,
) -> Result<ReduceScatter> {
    let tp = cx.tp().size();
    let mut pieces = if last_blocking { shrinking_pieces(x.dims()[1] / tp, chunks) } else { pieces(x.dims()[1] / tp, chunks) };
    if pieces.len() < 2 {
        // Nothing to cut: the whole product, then the whole collective.
        pieces = std::iter::once(0..x.dims()[1] / tp).collect();
        let y = f(x)?;
        let travelling = vec![cx.tp().reduce_scatter_sum_async(&y, 1)?];
        return Ok(ReduceScatter { travelling, outs: vec![y], pieces, tp });
    }
    let mut outs = Vec::with_capacity(pieces.len());
    let mut travelling = Vec::with_capacity(pieces.len());
    for (i, p) in pieces.iter().enumerate() {
        let y = f(&rows_of_every_slice(x, tp, p)?)?;
        travelling.push(if last_blocking && i + 1 == pieces.len() {
            Pending::ready("reduce_scatter_sum", cx.tp().reduce_scatter_sum(&y, 1))
        } else {
            cx.tp().reduce_scatter_sum_async(&y, 1)?
        });
        outs.push(y);
    }
    Ok(ReduceScatter { travelling, outs, pieces, tp })
}

/// A reduce-scatter started piece by piece ([`map_reduce_scatter`]).
pub(crate) struct ReduceScatter {
    travelling: Vec<Pending>,
    /// Each piece's summand on this rank, in the strided order.
    outs: Vec<Tensor>,
    pieces: Vec<Range<usize>>,
    tp: usize,
}

impl ReduceScatter {
    /// This rank's summand for the whole sequence, in order (what the
    /// whole collective would have been handed).
    pub(crate) fn summand(&self) -> Result<Tensor> {
        assemble(&self.outs, &self.pieces, self.tp)
    }

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
    pub(crate) sum: ReduceScatter,
}

impl InFlight {
    /// Whether `t` is the value this reduction sums.
    pub(crate) fn sums(&self, t: &Tensor) -> bool {
        t.shares_storage(&self.value) && t.layout() == self.value.layout()
    }
}

#[cfg(test)]
mod tests {
    use super::{pieces, shrinking_pieces};

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

    #[test]
    fn shrinking_pieces_cover_the_slice_each_half_the_one_before() {
        for len in 0..300 {
            for chunks in 0..12 {
                let p = shrinking_pieces(len, chunks);
                assert!(p.len() <= chunks.max(1));
                assert_eq!(p.iter().map(|r| r.len()).sum::<usize>(), len, "{len} {chunks}");
                assert!(p.first().is_none_or(|r| r.start == 0));
                assert!(p.windows(2).all(|w| w[0].end == w[1].start && !w[1].is_empty()));
                if len > 0 && chunks > 0 {
                    assert!(!p.is_empty());
                }
                // Each piece about half the one before (to the rounding of its ends).
                assert!(p.windows(2).all(|w| 2 * w[1].len() <= w[0].len() + 2), "{len} {chunks}: {p:?}");
                let n = chunks.clamp(1, 20) as u32;
                if len >= (1 << n) {
                    assert_eq!(p.len(), n as usize, "{len} {chunks}");
                    assert!(p.last().unwrap().len() <= len.div_ceil((1 << n) - 1) + 1, "{len} {chunks}: {p:?}");
                }
            }
        }
    }
}
