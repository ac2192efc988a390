//! Dropout whose mask is drawn from the context's key and redrawn in the backward.

use crate::error::{Error, Result};
use crate::module::{Act, Cx, Module, Plain, Replicated, Visitor};
use crate::ops;
use crate::RngKey;

/// Zeroes each element with probability `p` during training and scales the
/// rest by `1/(1-p)`; the identity in evaluation (`!cx.training()`) or when
/// `p` is zero. `Replicated → Replicated`, no parameters.
///
/// The mask comes from [`Cx::dropout_key`] (seed, step and module path), so
/// every rank of a tensor-parallel group drops the same elements of a
/// replicated activation, and a recomputed forward draws the same mask. The
/// mask is never stored: the backward redraws it from the key.
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
/// with and the global index of its first element (24 bytes), or `None` when the
/// forward was the identity.
#[derive(Clone, Copy, Debug)]
pub struct DropoutSaved(Option<(RngKey, u64)>);

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

impl Module<Plain> for Dropout {
    type In = Replicated;
    type Out = Replicated;
    type Saved = DropoutSaved;

    fn forward(&self, cx: &mut Cx, x: Act<Replicated>) -> Result<(Act<Replicated>, DropoutSaved)> {
        if !cx.training() || self.p == 0.0 {
            return Ok((x, DropoutSaved(None)));
        }
        let key = cx.dropout_key();
        // Under sequence parallelism this rank holds one slice of the tokens:
        // draw the mask at its global positions, as one rank would.
        let start = if cx.sequence_split() { (cx.tp().rank() * x.tensor().elem_count()) as u64 } else { 0 };
        Ok((Act::new(ops::dropout(x.tensor(), self.p, key, start)?), DropoutSaved(Some((key, start)))))
    }

    fn backward(&self, _cx: &mut Cx, saved: DropoutSaved, dy: Act<Replicated>) -> Result<Act<Replicated>> {
        match saved.0 {
            None => Ok(dy),
            Some((key, start)) => Ok(Act::new(ops::dropout_backward(dy.tensor(), self.p, key, start)?)),
        }
    }

    fn visit_params(&self, _v: &mut Visitor<'_>) -> Result<()> {
        Ok(())
    }
}
