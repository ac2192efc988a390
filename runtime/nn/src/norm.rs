//! LayerNorm and RMSNorm over the last dimension.

use super::param_value;
use crate::module::{Act, Activation, Cx, Describe, Module, Param, Plain, Replicated, Seq, Visitor};
use tessera_core::ops::{self, NormSaved};
use tessera_core::tensor::{Init, Tensor};
use tessera_core::{Error, Result};

/// What a normalisation keeps for its backward: its input and one or two
/// per-row statistics (input bytes plus 4 or 8 bytes per row in f32).
#[derive(Debug)]
pub struct NormState {
    x: Tensor,
    stats: NormSaved,
}

impl NormState {
    /// Bytes of activation memory held.
    pub fn bytes(&self) -> usize {
        super::bytes_of(&self.x) + self.stats.mean.as_ref().map_or(0, super::bytes_of) + super::bytes_of(&self.stats.rstd)
    }
}

fn check(op: &'static str, dim: usize, eps: f64) -> Result<()> {
    if dim == 0 {
        return Err(Error::invalid(op, "dim must be positive (the size of the normalised last dimension)"));
    }
    if !(eps.is_finite() && eps > 0.0) {
        return Err(Error::invalid(op, format!("eps must be a small positive number (e.g. 1e-5), got {eps}")));
    }
    Ok(())
}

/// A normalisation's costs over rows of `dim`: the input and `stats`
/// statistics per row kept (f32, or f64 in an f64 run), one pass each way.
fn describe_norm(d: &mut Describe, x: Activation, dim: usize, stats: usize, params: &[usize], op: &'static str) -> Result<Activation> {
    if x.width != dim {
        return Err(Error::shape(op, format!("an input of {} features per token for a norm over {dim}", x.width)));
    }
    d.save(&x);
    d.save_new(stats, x.tokens, d.stat_dtype());
    d.traffic(2.0 * x.bytes(), 3.0 * x.bytes());
    d.replicated_grads(params);
    Ok(d.output(dim, x.tokens))
}

fn ones() -> Init {
    Init::Normal { mean: 1.0, std: 0.0 }
}

fn zeros() -> Init {
    Init::Normal { mean: 0.0, std: 0.0 }
}

/// LayerNorm: `(x - mean) / sqrt(var + eps) · gain (+ bias)` over the last dimension.
///
/// Gain `[dim]` starts at one, the optional bias `[dim]` at zero.
/// `Replicated → Replicated`, any input rank.
///
/// ```
/// use tessera::module::{materialize, Act, Cx, Module};
/// use tessera::nn::LayerNorm;
/// use tessera::{DType, Device, Tensor};
///
/// let dev = Device::cpu();
/// let cx = &mut Cx::new(dev.clone());
/// let ln = LayerNorm::new(4, 1e-5, true)?;
/// materialize(&ln, cx)?;
/// let (y, _) = ln.forward(cx, Act::new(Tensor::zeros([2, 4], DType::F32, &dev)?))?;
/// assert_eq!(y.tensor().dims(), &[2, 4]);
/// # Ok::<(), tessera::Error>(())
/// ```
#[derive(Debug)]
pub struct LayerNorm {
    eps: f64,
    weight: Param,
    bias: Option<Param>,
}

impl LayerNorm {
    /// Normalises rows of `dim` with `eps` added to the variance; a bias when `bias` is true.
    pub fn new(dim: usize, eps: f64, bias: bool) -> Result<LayerNorm> {
        check("LayerNorm::new", dim, eps)?;
        Ok(LayerNorm { eps, weight: Param::new([dim], ones()), bias: bias.then(|| Param::new([dim], zeros())) })
    }

    /// The gain, `[dim]`.
    pub fn weight(&self) -> &Param {
        &self.weight
    }

    /// The bias, `[dim]`, if any.
    pub fn bias(&self) -> Option<&Param> {
        self.bias.as_ref()
    }
}

/// Per token: under sequence parallelism it normalises this rank's tokens.
impl Module<Plain> for LayerNorm {
    type In = Replicated;
    type Out = Replicated;
    type Saved = NormState;
    const SEQ_IN: Seq = Seq::Split;
    const SEQ_OUT: Seq = Seq::Split;

    fn forward(&self, cx: &mut Cx, x: Act<Replicated>) -> Result<(Act<Replicated>, NormState)> {
        let x = x.into_tensor();
        let g = cx.param(&self.weight)?;
        let b = self.bias.as_ref().map(|b| cx.param(b)).transpose()?;
        let (y, stats) = ops::layer_norm(&x, &g, b.as_ref(), self.eps)?;
        Ok((Act::new(y), NormState { x, stats }))
    }

    fn backward(&self, cx: &mut Cx, saved: NormState, dy: Act<Replicated>) -> Result<Act<Replicated>> {
        let g = param_value(cx, &self.weight)?;
        let (dx, dg, db) = ops::layer_norm_backward(&saved.x, &g, self.bias.is_some(), &saved.stats, dy.tensor())?;
        cx.grad(&self.weight, dg)?;
        if let (Some(b), Some(db)) = (&self.bias, db) {
            cx.grad(b, db)?;
        }
        Ok(Act::new(dx))
    }

    fn visit_params(&self, v: &mut Visitor<'_>) -> Result<()> {
        v.param("weight", &self.weight, None)?;
        if let Some(b) = &self.bias {
            v.param("bias", b, None)?;
        }
        Ok(())
    }

    fn describe(&self, d: &mut Describe, x: Activation) -> Result<Activation> {
        let dim = self.weight.global_shape().dims()[0];
        let params = [dim, dim];
        describe_norm(d, x, dim, 2, &params[..1 + usize::from(self.bias.is_some())], "LayerNorm")
    }
}

/// RMSNorm: `x / sqrt(mean(x²) + eps) · gain` over the last dimension.
///
/// Gain `[dim]` starts at one. `Replicated → Replicated`, any input rank.
///
/// ```
/// use tessera::module::{materialize, Act, Cx, Module};
/// use tessera::nn::RmsNorm;
/// use tessera::{DType, Device, Tensor};
///
/// let dev = Device::cpu();
/// let cx = &mut Cx::new(dev.clone());
/// let norm = RmsNorm::new(4, 1e-6)?;
/// materialize(&norm, cx)?;
/// let (y, _) = norm.forward(cx, Act::new(Tensor::full(2.0, [3, 4], DType::F32, &dev)?))?;
/// assert!((y.tensor().to_f64_vec()?[0] - 1.0).abs() < 1e-3);
/// # Ok::<(), tessera::Error>(())
/// ```
#[derive(Debug)]
pub struct RmsNorm {
    eps: f64,
    weight: Param,
}

impl RmsNorm {
    /// Normalises rows of `dim` with `eps` added to the mean square.
    pub fn new(dim: usize, eps: f64) -> Result<RmsNorm> {
        check("RmsNorm::new", dim, eps)?;
        Ok(RmsNorm { eps, weight: Param::new([dim], ones()) })
    }

    /// The gain, `[dim]`.
    pub fn weight(&self) -> &Param {
        &self.weight
    }
}

/// Per token: under sequence parallelism it normalises this rank's tokens.
impl Module<Plain> for RmsNorm {
    type In = Replicated;
    type Out = Replicated;
    type Saved = NormState;
    const SEQ_IN: Seq = Seq::Split;
    const SEQ_OUT: Seq = Seq::Split;

    fn forward(&self, cx: &mut Cx, x: Act<Replicated>) -> Result<(Act<Replicated>, NormState)> {
        let x = x.into_tensor();
        let g = cx.param(&self.weight)?;
        let (y, stats) = ops::rms_norm(&x, &g, self.eps)?;
        Ok((Act::new(y), NormState { x, stats }))
    }

    fn backward(&self, cx: &mut Cx, saved: NormState, dy: Act<Replicated>) -> Result<Act<Replicated>> {
        let g = param_value(cx, &self.weight)?;
        let (dx, dg) = ops::rms_norm_backward(&saved.x, &g, &saved.stats, dy.tensor())?;
        cx.grad(&self.weight, dg)?;
        Ok(Act::new(dx))
    }

    fn visit_params(&self, v: &mut Visitor<'_>) -> Result<()> {
        v.param("weight", &self.weight, None)
    }

    fn describe(&self, d: &mut Describe, x: Activation) -> Result<Activation> {
        let dim = self.weight.global_shape().dims()[0];
        describe_norm(d, x, dim, 1, &[dim], "RmsNorm")
    }
}
