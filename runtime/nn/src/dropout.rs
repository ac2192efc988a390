//! Dropout whose mask is drawn from the context's key and redrawn in the backward.

use crate::module::{Act, Activation, Cx, Describe, Module, Plain, Replicated, Seq, Visitor};
use tessera_core::ops;
use tessera_core::tensor::Tensor;
use tessera_core::RngKey;
use tessera_core::{Error, Result};

/// Zeroes each element with probability `p` during training and scales the
/// rest by `1/(1-p)`; the identity in evaluation (`!cx.training()`) or when
/// `p` is zero. `Replicated → Replicated`, no parameters.
///
/// The mask comes from [`Cx::dropout_key`] (seed, step and module path) and
/// is drawn at *global* positions: element `i` of row `r` of the step's
/// global batch (rows are dimension 0; [`Cx::batch_offset`] says where this
/// rank's rows start) gets the same draw on every parallel layout. So every
/// rank of a tensor-parallel group drops the same elements of a replicated
/// activation, a rank holding a slice of the sequence (sequence parallelism)
/// drops what a single rank drops there, data-parallel replicas and pipeline
/// microbatches drop what the whole batch would, and a recomputed forward
/// draws the same mask. The mask is never stored: the backward redraws it.
///
/// ```
/// use tessera::module::{Act, Cx, Module};
/// use tessera::nn::Dropout;
/// use tessera::{DType, Device, Tensor};
///
/// let dev = Device::cpu();
/// let cx = &mut Cx::new(dev.clone());
/// cx.set_training(false);
/// let drop = Dropout::new(0.1)?;
/// let x = Tensor::full(1.0, [8], DType::F32, &dev)?;
/// let (y, _) = drop.forward(cx, Act::new(x))?;
/// assert_eq!(y.tensor().to_f64_vec()?, vec![1.0; 8]);
/// # Ok::<(), tessera::Error>(())
/// ```
#[derive(Clone, Copy, Debug)]
pub struct Dropout {
    p: f64,
}

/// What a [`Dropout`] keeps for its backward: the key its mask was drawn
/// with and where this rank's elements lie in the global batch (40 bytes),
/// or `None` when the forward was the identity.
#[derive(Clone, Copy, Debug)]
pub struct DropoutSaved(Option<(RngKey, Site)>);

/// Where a rank's tensor lies among the global positions: row `b` (dim 0)
/// starts at global element `first + b · row_stride`, with its elements
/// contiguous from there.
#[derive(Clone, Copy, Debug)]
struct Site {
    first: u64,
    row_stride: u64,
}

impl Site {
    /// The site of `x` in this context: after `batch_offset` global rows,
    /// and at this rank's slice of the sequence under sequence parallelism.
    fn of(cx: &Cx, x: &Tensor) -> Site {
        let rows = x.dims().first().copied().unwrap_or(1).max(1) as u64;
        let per_row = x.elem_count() as u64 / rows;
        let (slices, slice) = if cx.sequence_split() && x.rank() >= 3 { (cx.tp().size() as u64, cx.tp().rank() as u64) } else { (1, 0) };
        let row_stride = per_row * slices;
        Site { first: cx.batch_offset() * row_stride + slice * per_row, row_stride }
    }

    /// Applies `f(tensor, start)` row by row at this site (one call when the
    /// rows are contiguous in the global positions).
    fn map(self, x: &Tensor, f: impl Fn(&Tensor, u64) -> Result<Tensor>) -> Result<Tensor> {
        let rows = x.dims().first().copied().unwrap_or(1).max(1);
        let per_row = (x.elem_count() / rows) as u64;
        if x.rank() == 0 || per_row == self.row_stride || rows == 1 {
            return f(x, self.first);
        }
        let parts: Vec<Tensor> = (0..rows).map(|b| f(&x.narrow(0, b, 1)?, self.first + b as u64 * self.row_stride)).collect::<Result<_>>()?;
        Tensor::concat_flat(&parts.iter().collect::<Vec<_>>())?.reshape(x.shape().clone())
    }
}

impl Dropout {
    /// Dropout with drop probability `p` in `[0, 1)`.
    pub fn new(p: f64) -> Result<Dropout> {
        if !(0.0..1.0).contains(&p) {
            return Err(Error::invalid("Dropout::new", format!("the drop probability must be in [0, 1) (e.g. 0.1), got {p}")));
        }
        Ok(Dropout { p })
    }

    /// The drop probability.
    pub fn p(&self) -> f64 {
        self.p
    }
}

/// Elementwise: under sequence parallelism it drops this rank's tokens' elements.
impl Module<Plain> for Dropout {
    type In = Replicated;
    type Out = Replicated;
    type Saved = DropoutSaved;
    const SEQ_IN: Seq = Seq::Split;
    const SEQ_OUT: Seq = Seq::Split;

    fn forward(&self, cx: &mut Cx, x: Act<Replicated>) -> Result<(Act<Replicated>, DropoutSaved)> {
        if !cx.training() || self.p == 0.0 {
            return Ok((x, DropoutSaved(None)));
        }
        let key = cx.dropout_key();
        let site = Site::of(cx, x.tensor());
        let y = site.map(x.tensor(), |t, start| ops::dropout(t, self.p, key, start))?;
        Ok((Act::new(y), DropoutSaved(Some((key, site)))))
    }

    fn backward(&self, _cx: &mut Cx, saved: DropoutSaved, dy: Act<Replicated>) -> Result<Act<Replicated>> {
        match saved.0 {
            None => Ok(dy),
            Some((key, site)) => Ok(Act::new(site.map(dy.tensor(), |t, start| ops::dropout_backward(t, self.p, key, start))?)),
        }
    }

    fn visit_params(&self, _v: &mut Visitor<'_>) -> Result<()> {
        Ok(())
    }

    /// Keeps only its key (the mask is redrawn); one pass each way. The
    /// description is of training, where a positive `p` applies.
    fn describe(&self, d: &mut Describe, x: Activation) -> Result<Activation> {
        if self.p == 0.0 {
            return Ok(x);
        }
        let y = d.output(x.width, x.tokens);
        d.traffic(2.0 * y.bytes(), 2.0 * y.bytes());
        Ok(y)
    }
}
