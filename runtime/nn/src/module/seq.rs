//! Moving a `Replicated` value between its whole and sequence-split forms
//! (see [`Seq`]), and the gradient rule that goes with the split form.
//!
//! The gradient of a `Replicated` value is complete on every rank that holds
//! it, in the form the value has: the whole sequence's gradient for a whole
//! value, this rank's slice of it for a split one. The duals follow:
//!
//! | forward | backward |
//! |---|---|
//! | gather (split → whole): all-gather over dim 1 | take this rank's slice (the gradient is already complete) |
//! | slice (whole → split): keep this rank's part of dim 1 | all-gather the slices' gradients |

use super::{Act, Cx, Layout, Seq};
use tessera_core::tensor::Tensor;
use tessera_core::{Error, Result};

/// `x` (of layout `L`, in form `from`) in form `to`. Only a `Replicated`
/// value under sequence parallelism changes; anything else is returned as is.
pub fn seq_convert<L: Layout>(cx: &Cx, x: Act<L>, from: Seq, to: Seq) -> Result<Act<L>> {
    if !L::IS_REPLICATED || from == to || !cx.sequence_split() {
        return Ok(x);
    }
    let t = match to {
        Seq::Whole => gather(cx, x.tensor())?,
        Seq::Split => slice(cx, x.tensor())?,
    };
    Ok(Act::new(t))
}

/// Backward of [`seq_convert`] with the same forms: `g` is in form `to` and
/// its result in form `from`.
pub fn seq_convert_backward<L: Layout>(cx: &Cx, g: Act<L>, from: Seq, to: Seq) -> Result<Act<L>> {
    if !L::IS_REPLICATED || from == to || !cx.sequence_split() {
        return Ok(g);
    }
    let t = match to {
        Seq::Whole => slice(cx, g.tensor())?,
        Seq::Split => gather(cx, g.tensor())?,
    };
    Ok(Act::new(t))
}

fn check_rank(x: &Tensor) -> Result<()> {
    if x.rank() < 3 {
        return Err(Error::shape(
            "sequence parallelism",
            format!(
                "it splits dimension 1 of [batch, seq, hidden] activations, got {}; turn it off for models whose activations have no sequence dimension",
                x.shape()
            ),
        ));
    }
    Ok(())
}

/// The whole sequence from every rank's slice.
pub(crate) fn gather(cx: &Cx, x: &Tensor) -> Result<Tensor> {
    check_rank(x)?;
    cx.tp().all_gather(x, 1)
}

/// This rank's slice of a whole sequence.
pub(crate) fn slice(cx: &Cx, x: &Tensor) -> Result<Tensor> {
    check_rank(x)?;
    let (rank, tp) = (cx.tp().rank(), cx.tp().size());
    let seq = x.dims()[1];
    if !seq.is_multiple_of(tp) {
        return Err(Error::shape(
            "sequence parallelism",
            format!("a sequence of {seq} tokens cannot be split over a tensor-parallel group of {tp}; use a sequence length the degree divides"),
        ));
    }
    x.narrow(1, rank * (seq / tp), seq / tp)?.contiguous()
}
