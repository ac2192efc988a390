//! Dropout whose mask is drawn from the context's key and redrawn in the backward.

use crate::module::{Act, Activation, Cx, Describe, Module, Plain, Replicated, Seq, TokenRun, Visitor};
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
/// or chunks of it (context parallelism) drops what a single rank drops there, data-parallel replicas and pipeline
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
/// with and where this rank's elements lie in the global batch, or `None`
/// when the forward was the identity.
#[derive(Clone, Debug)]
pub struct DropoutSaved(Option<(RngKey, Site)>);

/// Where a rank's tensor lies among the global positions: row `b` (dim 0)
/// starts at global element `(first_row + b) · row_stride`, and each run of
/// its tokens (dim 1 of a `[batch, seq, ..]` activation) at `global ·
/// width` from there, its elements contiguous.
#[derive(Clone, Debug)]
struct Site {
    first_row: u64,
    row_stride: u64,
    width: u64,
    runs: Vec<TokenRun>,
}

impl Site {
    /// The site of `x` in this context: after `batch_offset` global rows,
    /// at this rank's slice of the sequence under sequence parallelism and
    /// its chunks of it under context parallelism.
    fn of(cx: &Cx, x: &Tensor) -> Result<Site> {
        let rows = x.dims().first().copied().unwrap_or(1).max(1);
        let per_row = x.elem_count() / rows;
        let first_row = cx.batch_offset();
        if x.rank() < 3 {
            let runs = vec![TokenRun { local: 0, global: 0, len: per_row }];
            return Ok(Site { first_row, row_stride: per_row as u64, width: 1, runs });
        }
        let seq = x.dims()[1];
        let width = per_row.checked_div(seq).unwrap_or(0) as u64;
        let runs = cx.token_runs(seq, true)?;
        Ok(Site { first_row, row_stride: cx.global_seq_len(seq, true) as u64 * width, width, runs })
    }

    /// Applies `f(tensor, start)` to each row's runs at this site (one call
    /// when the tensor is one contiguous stretch of the global positions).
    fn map(&self, x: &Tensor, f: impl Fn(&Tensor, u64) -> Result<Tensor>) -> Result<Tensor> {
        let rows = x.dims().first().copied().unwrap_or(1).max(1);
        let per_row = (x.elem_count() / rows) as u64;
        let whole = match self.runs.as_slice() {
            [run] => (rows == 1 || self.row_stride == per_row).then_some(run.global as u64 * self.width),
            _ => None,
        };
        if let Some(offset) = whole.or((x.rank() == 0).then_some(0)) {
            return f(x, self.first_row * self.row_stride + offset);
        }
        let mut parts = Vec::with_capacity(rows * self.runs.len());
        for b in 0..rows {
            let row = x.narrow(0, b, 1)?;
            for run in &self.runs {
                let piece = if x.rank() >= 3 { row.narrow(1, run.local, run.len)? } else { row.clone() };
                parts.push(f(&piece, (self.first_row + b as u64) * self.row_stride + run.global as u64 * self.width)?);
            }
        }
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
        let site = Site::of(cx, x.tensor())?;
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
