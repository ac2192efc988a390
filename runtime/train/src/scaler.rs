//! Dynamic loss scaling for fp16 training.

use tessera_core::ops;
use tessera_core::tensor::Tensor;
use tessera_core::{Error, Result};
use tessera_nn::module::{self, Cx, Module, Param};

/// Scales the loss so fp16 gradients do not underflow, and adapts the scale:
/// an overflow (an infinite or NaN gradient on any rank) skips the step and
/// backs the scale off; `growth_interval` good steps in a row grow it.
///
/// Defaults are PyTorch's `GradScaler`: initial scale 2¹⁶, growth ×2 every
/// 2000 good steps, backoff ×0.5. With `hysteresis = n`, the scale only
/// backs off after `n` overflows without a good step between them (the
/// step is skipped at each).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LossScaler {
    scale: f64,
    growth_factor: f64,
    backoff_factor: f64,
    growth_interval: u64,
    hysteresis: u32,
    good_steps: u64,
    overflows_left: u32,
}

impl Default for LossScaler {
    fn default() -> Self {
        LossScaler { scale: 65536.0, growth_factor: 2.0, backoff_factor: 0.5, growth_interval: 2000, hysteresis: 1, good_steps: 0, overflows_left: 1 }
    }
}

impl LossScaler {
    /// A scaler with PyTorch's defaults.
    pub fn new() -> Self {
        Self::default()
    }

    /// Starts from `scale` instead of 2¹⁶.
    pub fn with_initial_scale(mut self, scale: f64) -> Result<Self> {
        if !(scale.is_finite() && scale > 0.0) {
            return Err(Error::invalid("LossScaler", format!("the initial scale must be a positive number, got {scale}")));
        }
        self.scale = scale;
        Ok(self)
    }

    /// Grows by `factor` after `interval` good steps; backs off by `backoff` on overflow.
    pub fn with_schedule(mut self, factor: f64, backoff: f64, interval: u64) -> Result<Self> {
        if !(factor > 1.0 && factor.is_finite() && backoff > 0.0 && backoff < 1.0 && interval > 0) {
            return Err(Error::invalid(
                "LossScaler",
                format!("need growth factor > 1, 0 < backoff < 1 and a positive interval; got {factor}, {backoff}, {interval}"),
            ));
        }
        (self.growth_factor, self.backoff_factor, self.growth_interval) = (factor, backoff, interval);
        Ok(self)
    }

    /// Backs off only after `n` overflows in a row (Megatron's hysteresis).
    pub fn with_hysteresis(mut self, n: u32) -> Result<Self> {
        if n == 0 {
            return Err(Error::invalid("LossScaler", "hysteresis counts overflows: it must be at least 1"));
        }
        (self.hysteresis, self.overflows_left) = (n, n);
        Ok(self)
    }

    /// The factor to multiply the loss (its upstream gradient) by this step.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Divides every gradient by the scale and checks them on every rank.
    ///
    /// Returns `true` when the step may be applied, `false` when some rank
    /// found an infinite or NaN gradient: then every rank must skip the
    /// optimizer step (the gradients are left as they are; drop them). All
    /// ranks must call it together; it reduces a flag over the
    /// tensor-, pipeline-, data- and expert-parallel groups.
    pub fn unscale_and_check<M: Module>(&self, model: &M, cx: &Cx) -> Result<bool> {
        let params: Vec<Param> = module::distinct_params(model)?.into_iter().map(|n| n.param).collect();
        let mut bad = false;
        for p in &params {
            if let Some(g) = p.grad() {
                let m = ops::max_abs(&g)?.to_scalar()?;
                bad |= !m.is_finite();
            }
        }
        let mut flag = Tensor::from_vec(vec![if bad { 1.0f64 } else { 0.0 }], [1], cx.device())?;
        for group in [&cx.groups().tp, &cx.groups().pp, &cx.groups().dp, &cx.groups().ep] {
            flag = group.all_reduce_sum(&flag)?;
        }
        if flag.to_scalar()? > 0.0 {
            return Ok(false);
        }
        for p in &params {
            if let Some(g) = p.grad() {
                p.set_grad(ops::scale(&g, 1.0 / self.scale)?)?;
            }
        }
        Ok(true)
    }

    /// Adapts the scale after a step: `applied` is what
    /// [`unscale_and_check`](Self::unscale_and_check) returned.
    pub fn update(&mut self, applied: bool) {
        if applied {
            self.overflows_left = self.hysteresis;
            self.good_steps += 1;
            if self.good_steps >= self.growth_interval {
                self.scale *= self.growth_factor;
                self.good_steps = 0;
            }
        } else {
            self.good_steps = 0;
            self.overflows_left = self.overflows_left.saturating_sub(1);
            if self.overflows_left == 0 {
                self.scale *= self.backoff_factor;
                self.overflows_left = self.hysteresis;
            }
        }
    }
}
