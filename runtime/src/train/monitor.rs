//! Watching loss and gradient norm for the events that call for a rollback.

/// Something wrong with a step.
#[derive(Clone, Debug, PartialEq)]
pub enum Anomaly {
    /// The loss or the gradient norm is infinite or NaN.
    NonFinite { step: u64, loss: f64, grad_norm: f64 },
    /// The loss jumped above `factor` times its recent average.
    LossSpike { step: u64, loss: f64, average: f64 },
    /// The gradient norm jumped above `factor` times its recent average.
    GradNormSpike { step: u64, grad_norm: f64, average: f64 },
}

/// What a [`StabilityMonitor`] has learnt: checkpointed with the run, so a
/// resumed run judges its next step exactly as the unstopped run would.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MonitorState {
    /// Healthy steps seen.
    pub healthy: u64,
    /// The moving average of the loss.
    pub loss_avg: f64,
    /// The moving average of the gradient norm.
    pub norm_avg: f64,
}

/// Flags non-finite values and spikes against exponential moving averages
/// of the loss and the gradient norm.
///
/// The averages only learn from healthy steps, and spikes are judged only
/// after `warmup` healthy steps (early training moves fast). The trainer
/// decides what to do: skip the step, or roll back to the last healthy
/// checkpoint and skip the data shard that caused it.
#[derive(Clone, Debug, PartialEq)]
pub struct StabilityMonitor {
    factor: f64,
    decay: f64,
    warmup: u64,
    healthy: u64,
    loss_avg: f64,
    norm_avg: f64,
}

impl StabilityMonitor {
    /// Spikes are values above `factor` × the average (e.g. 3); `decay` is
    /// the moving average's weight on the past (e.g. 0.98).
    pub fn new(factor: f64, decay: f64, warmup: u64) -> crate::Result<Self> {
        if !(factor > 1.0 && factor.is_finite() && (0.0..1.0).contains(&decay)) {
            return Err(crate::Error::invalid("StabilityMonitor", format!("need a spike factor > 1 and 0 <= decay < 1; got {factor} and {decay}")));
        }
        Ok(StabilityMonitor { factor, decay, warmup, healthy: 0, loss_avg: 0.0, norm_avg: 0.0 })
    }

    /// What it has learnt (for a checkpoint).
    pub fn state(&self) -> MonitorState {
        MonitorState { healthy: self.healthy, loss_avg: self.loss_avg, norm_avg: self.norm_avg }
    }

    /// Continues from a [`state`](Self::state) saved as JSON; the rule
    /// (factor, decay, warm-up) stays this monitor's own.
    pub fn restore(&mut self, saved: &serde_json::Value) -> crate::Result<()> {
        let s: MonitorState = serde_json::from_value(saved.clone()).map_err(|e| crate::Error::Checkpoint { path: "manifest.json".into(), detail: format!("the stability monitor's state is unreadable ({e}); it is written by the trainer") })?;
        if !(s.loss_avg.is_finite() && s.norm_avg.is_finite()) {
            return Err(crate::Error::Checkpoint { path: "manifest.json".into(), detail: format!("the stability monitor's averages must be finite, got {} and {}", s.loss_avg, s.norm_avg) });
        }
        (self.healthy, self.loss_avg, self.norm_avg) = (s.healthy, s.loss_avg, s.norm_avg);
        Ok(())
    }

    /// Judges one step; a healthy step updates the averages.
    pub fn observe(&mut self, step: u64, loss: f64, grad_norm: f64) -> Option<Anomaly> {
        if !loss.is_finite() || !grad_norm.is_finite() {
            return Some(Anomaly::NonFinite { step, loss, grad_norm });
        }
        if self.healthy >= self.warmup && self.healthy > 0 {
            if loss > self.factor * self.loss_avg {
                return Some(Anomaly::LossSpike { step, loss, average: self.loss_avg });
            }
            if grad_norm > self.factor * self.norm_avg {
                return Some(Anomaly::GradNormSpike { step, grad_norm, average: self.norm_avg });
            }
        }
        self.learn(loss, grad_norm);
        None
    }

    /// Counts a step as healthy: its values join the moving averages. Every
    /// step [`observe`](Self::observe) passes is learnt; a trainer that lets
    /// a flagged step through anyway (a gradient-norm spike that clipping
    /// bounds) calls this so the averages follow a norm that rose for good.
    pub fn learn(&mut self, loss: f64, grad_norm: f64) {
        if !(loss.is_finite() && grad_norm.is_finite()) {
            return;
        }
        if self.healthy == 0 {
            (self.loss_avg, self.norm_avg) = (loss, grad_norm);
        } else {
            self.loss_avg = self.decay * self.loss_avg + (1.0 - self.decay) * loss;
            self.norm_avg = self.decay * self.norm_avg + (1.0 - self.decay) * grad_norm;
        }
        self.healthy += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_non_finite_values_and_spikes_after_warmup() {
        let mut m = StabilityMonitor::new(3.0, 0.9, 3).unwrap();
        assert!(matches!(m.observe(1, f64::NAN, 1.0), Some(Anomaly::NonFinite { step: 1, .. })));
        assert!(matches!(m.observe(1, 2.0, f64::INFINITY), Some(Anomaly::NonFinite { .. })));
        // During warm-up a big value is learnt, not flagged.
        assert_eq!(m.observe(1, 10.0, 1.0), None);
        assert_eq!(m.observe(2, 2.0, 1.0), None);
        assert_eq!(m.observe(3, 2.0, 1.0), None);
        let avg = 0.9 * (0.9 * 10.0 + 0.1 * 2.0) + 0.1 * 2.0;
        assert!(matches!(m.observe(4, 3.5 * avg, 1.0), Some(Anomaly::LossSpike { step: 4, .. })));
        assert!(matches!(m.observe(5, 1.0, 4.0), Some(Anomaly::GradNormSpike { step: 5, .. })));
        assert_eq!(m.observe(6, 1.0, 1.0), None, "healthy steps pass");
        assert!(StabilityMonitor::new(1.0, 0.9, 0).is_err());
    }
}
