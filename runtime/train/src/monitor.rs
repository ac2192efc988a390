//! Watching loss and gradient norm for the events that call for a rollback.
//!
//! The rule is [`StabilityMonitor`]'s.

use std::collections::VecDeque;

/// Something wrong with a step.
#[derive(Clone, Debug, PartialEq)]
pub enum Anomaly {
    /// The loss or the gradient norm is infinite or NaN.
    NonFinite {
        /// The step.
        step: u64,
        /// The step's loss.
        loss: f64,
        /// The step's gradient norm.
        grad_norm: f64,
    },
    /// The loss jumped above `factor` times its recent median.
    LossSpike {
        /// The step.
        step: u64,
        /// The step's loss.
        loss: f64,
        /// The median loss of the recent healthy steps.
        average: f64,
    },
    /// The gradient norm jumped above `factor` times its recent median.
    GradNormSpike {
        /// The step.
        step: u64,
        /// The step's gradient norm.
        grad_norm: f64,
        /// The median gradient norm of the recent healthy steps.
        average: f64,
    },
}

/// What a [`StabilityMonitor`] has learnt: checkpointed with the run, so a
/// resumed run judges its next step exactly as the unstopped run would.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MonitorState {
    /// Healthy steps seen.
    pub healthy: u64,
    /// The last healthy steps' `(loss, gradient norm)`, oldest first.
    pub recent: Vec<(f64, f64)>,
}

/// Flags non-finite values and spikes against the median of the recent
/// healthy steps.
///
/// # The rule
///
/// A step is an anomaly when its loss or gradient norm is NaN or infinite,
/// or, once `warmup` healthy steps have been seen, when its loss (or its
/// gradient norm) is above `factor` × the **median of the last `window`
/// healthy steps' values**, a loss only if it is also at least `min_rise`
/// above that median ([`with_min_rise`](Self::with_min_rise); 0 unless
/// set, 0.1 nats in the trainer's defaults).
///
/// The baseline is a recent median, not a long moving average, for two
/// reasons learnt the hard way. While the loss falls, a moving average that
/// remembers a few dozen steps trails far above the current loss (with a
/// 0.95 average, a run that went from 2.8 to 0.14 in 60 steps still
/// averaged 0.67), so a jump to 5× the current loss passed as normal. And a
/// moderate spike that is let through (below the factor) moved the average
/// up, hiding the next one. The median of the last 20 healthy values
/// follows a falling loss within ten steps and ignores isolated outliers;
/// after a long flat stretch it is that stretch's level, so a 600× jump is
/// 600× the baseline.
///
/// The floor on the rise is for the end of a run: once the loss is a few
/// hundredths of a nat, batches differ by several times that (a bf16 run of
/// the bundled task went 0.006 → 0.027 → 0.084 between healthy steps), and a
/// relative rule alone rolls back over noise until the run gives up. A real
/// spike rises by far more than 0.1 nats.
///
/// Only healthy steps are learnt, and spikes are judged only after
/// `warmup` healthy steps (early training moves fast). The trainer decides
/// what to do: skip the step, or roll back to the last healthy checkpoint
/// and pass over the data since.
#[derive(Clone, Debug, PartialEq)]
pub struct StabilityMonitor {
    factor: f64,
    min_rise: f64,
    window: usize,
    warmup: u64,
    healthy: u64,
    recent: VecDeque<(f64, f64)>,
}

impl StabilityMonitor {
    /// Spikes are values above `factor` × the median of the last `window`
    /// healthy values (e.g. 3 and 20), judged after `warmup` healthy steps.
    pub fn new(factor: f64, window: usize, warmup: u64) -> tessera_core::Result<Self> {
        if !(factor > 1.0 && factor.is_finite() && window > 0) {
            return Err(tessera_core::Error::invalid(
                "StabilityMonitor",
                format!("need a spike factor > 1 and a window of at least 1 step; got {factor} and {window}"),
            ));
        }
        Ok(StabilityMonitor { factor, min_rise: 0.0, window, warmup, healthy: 0, recent: VecDeque::with_capacity(window) })
    }

    /// A loss spike must also be at least `min_rise` above the median (in
    /// the loss's units); 0 judges the factor alone.
    pub fn with_min_rise(mut self, min_rise: f64) -> tessera_core::Result<Self> {
        if !(min_rise.is_finite() && min_rise >= 0.0) {
            return Err(tessera_core::Error::invalid("StabilityMonitor", format!("the minimum rise of a loss spike must be finite and >= 0; got {min_rise}")));
        }
        self.min_rise = min_rise;
        Ok(self)
    }

    /// What it has learnt (for a checkpoint).
    pub fn state(&self) -> MonitorState {
        MonitorState { healthy: self.healthy, recent: self.recent.iter().copied().collect() }
    }

    /// Continues from a [`state`](Self::state) saved as JSON; the rule
    /// (factor, window, warm-up) stays this monitor's own (a shorter window
    /// keeps the newest values).
    pub fn restore(&mut self, saved: &serde_json::Value) -> tessera_core::Result<()> {
        let bad = |detail: String| tessera_core::Error::Checkpoint { path: "manifest.json".into(), detail };
        let s: MonitorState = serde_json::from_value(saved.clone())
            .map_err(|e| bad(format!("the stability monitor's state is unreadable ({e}); it is written by the trainer")))?;
        if s.recent.iter().any(|(l, n)| !(l.is_finite() && n.is_finite())) {
            return Err(bad("the stability monitor's recent values must be finite".into()));
        }
        self.healthy = s.healthy;
        let skip = s.recent.len().saturating_sub(self.window);
        self.recent = s.recent.into_iter().skip(skip).collect();
        Ok(())
    }

    /// The baseline of the loss and of the gradient norm: their medians
    /// over the recent healthy steps.
    pub fn baseline(&self) -> Option<(f64, f64)> {
        if self.recent.is_empty() {
            return None;
        }
        Some((median(self.recent.iter().map(|r| r.0)), median(self.recent.iter().map(|r| r.1))))
    }

    /// Judges one step; a healthy step joins the recent values.
    pub fn observe(&mut self, step: u64, loss: f64, grad_norm: f64) -> Option<Anomaly> {
        if !loss.is_finite() || !grad_norm.is_finite() {
            return Some(Anomaly::NonFinite { step, loss, grad_norm });
        }
        if let Some((loss_base, norm_base)) = self.baseline().filter(|_| self.healthy >= self.warmup) {
            if loss > self.factor * loss_base && loss - loss_base >= self.min_rise {
                return Some(Anomaly::LossSpike { step, loss, average: loss_base });
            }
            if grad_norm > self.factor * norm_base {
                return Some(Anomaly::GradNormSpike { step, grad_norm, average: norm_base });
            }
        }
        self.learn(loss, grad_norm);
        None
    }

    /// Counts a step as healthy: its values join the recent ones. Every
    /// step [`observe`](Self::observe) passes is learnt; a trainer that lets
    /// a flagged step through anyway (a gradient-norm spike that clipping
    /// bounds) calls this so the baseline follows a norm that rose for good.
    pub fn learn(&mut self, loss: f64, grad_norm: f64) {
        if !(loss.is_finite() && grad_norm.is_finite()) {
            return;
        }
        if self.recent.len() == self.window {
            self.recent.pop_front();
        }
        self.recent.push_back((loss, grad_norm));
        self.healthy += 1;
    }
}

/// The median of finite values (the mean of the middle two of an even count).
fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.collect();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_non_finite_values_and_spikes_after_warmup() {
        let mut m = StabilityMonitor::new(3.0, 4, 3).unwrap();
        assert!(matches!(m.observe(1, f64::NAN, 1.0), Some(Anomaly::NonFinite { step: 1, .. })));
        assert!(matches!(m.observe(1, 2.0, f64::INFINITY), Some(Anomaly::NonFinite { .. })));
        // During warm-up a big value is learnt, not flagged.
        assert_eq!(m.observe(1, 10.0, 1.0), None);
        assert_eq!(m.observe(2, 2.0, 1.0), None);
        assert_eq!(m.observe(3, 2.0, 1.0), None);
        // Median of 10, 2, 2: 2.
        assert!(matches!(m.observe(4, 6.5, 1.0), Some(Anomaly::LossSpike { step: 4, average, .. }) if average == 2.0));
        assert!(matches!(m.observe(5, 1.0, 4.0), Some(Anomaly::GradNormSpike { step: 5, .. })));
        assert_eq!(m.observe(6, 1.0, 1.0), None, "healthy steps pass");
        assert!(StabilityMonitor::new(1.0, 4, 0).is_err());
        assert!(StabilityMonitor::new(3.0, 0, 0).is_err());
    }

    /// Feeds `losses` as healthy steps (norm 1), asserting none is flagged.
    fn feed(m: &mut StabilityMonitor, losses: impl IntoIterator<Item = f64>) {
        for (i, l) in losses.into_iter().enumerate() {
            assert_eq!(m.observe(i as u64, l, 1.0), None, "step {i}: {l}");
        }
    }

    #[test]
    fn a_600x_jump_after_a_long_flat_stretch_is_caught_at_any_level() {
        for level in [2.5, 1e-2, 1e-7] {
            let mut m = StabilityMonitor::new(3.0, 20, 20).unwrap();
            // A descent from 2.8, then 10 000 flat steps with 1 % noise.
            feed(&mut m, (0..200).map(|i| 2.8 * (level / 2.8f64).powf(i as f64 / 199.0)));
            feed(&mut m, (0..10_000).map(|i| level * (1.0 + 0.01 * ((i * 7919 % 200) as f64 / 100.0 - 1.0))));
            assert!(matches!(m.observe(0, 600.0 * level, 1.0), Some(Anomaly::LossSpike { .. })), "at {level}");
        }
    }

    #[test]
    fn with_a_floor_a_600x_jump_from_a_practical_level_is_caught_and_tail_noise_is_not() {
        // The trainer's defaults: factor 3, at least 0.1 nats of rise.
        let fresh = || StabilityMonitor::new(3.0, 20, 20).unwrap().with_min_rise(0.1).unwrap();
        for level in [2.5, 1e-2, 4e-3] {
            let mut m = fresh();
            feed(&mut m, (0..200).map(|i| 2.8 * (level / 2.8f64).powf(i as f64 / 199.0)));
            feed(&mut m, (0..2_000).map(|i| level * (1.0 + 0.01 * ((i * 7919 % 200) as f64 / 100.0 - 1.0))));
            assert!(matches!(m.observe(0, 600.0 * level, 1.0), Some(Anomaly::LossSpike { .. })), "at {level}");
        }
        // The end of a run at a few thousandths of a nat: batches at 4 and
        // 5 times the median are noise, not spikes; a rise of 0.5 nats is.
        let mut m = fresh();
        feed(&mut m, (0..100).map(|i| 0.006 * (1.0 + 0.5 * ((i * 37 % 11) as f64 / 5.0 - 1.0))));
        for (i, l) in [0.027, 0.042, 0.084, 0.031].into_iter().enumerate() {
            assert_eq!(m.observe(100 + i as u64, l, 1.0), None, "{l}");
        }
        assert!(matches!(m.observe(200, 0.5, 1.0), Some(Anomaly::LossSpike { .. })));
        assert!(StabilityMonitor::new(3.0, 20, 20).unwrap().with_min_rise(-1.0).is_err());
    }

    #[test]
    fn a_jump_soon_after_a_fast_descent_is_caught() {
        // The case a long moving average missed: the loss fell from 2.8 to
        // 0.14 in 60 steps (a 0.95 moving average is still near 0.6); 0.8 is
        // 5.7× where the loss is now.
        let mut m = StabilityMonitor::new(3.0, 20, 5).unwrap();
        let descent: Vec<f64> = (0..60).map(|i| 2.8 * (0.14f64 / 2.8).powf(i as f64 / 59.0)).collect();
        let ema = descent.iter().skip(1).fold(descent[0], |a, &l| 0.95 * a + 0.05 * l);
        assert!(3.0 * ema > 0.8, "the moving average would miss it");
        feed(&mut m, descent);
        assert!(matches!(m.observe(61, 0.8, 1.0), Some(Anomaly::LossSpike { .. })));
    }

    #[test]
    fn noise_slow_drifts_and_an_isolated_outlier_let_through_do_not_move_the_baseline_much() {
        let mut m = StabilityMonitor::new(3.0, 20, 5).unwrap();
        // ±40 % noise and a slow upward drift of 1 % a step: nothing flagged.
        feed(&mut m, (0..300).map(|i| (1.0 + 0.4 * ((i * 37 % 11) as f64 / 5.0 - 1.0)) * 1.01f64.powi(i)));
        // An outlier below the factor does not lift the baseline: the next
        // spike is judged against the level, not the outlier.
        let mut m = StabilityMonitor::new(3.0, 20, 5).unwrap();
        feed(&mut m, [1.0; 30]);
        feed(&mut m, [2.9]);
        assert!(matches!(m.observe(32, 3.1, 1.0), Some(Anomaly::LossSpike { average, .. }) if average == 1.0));
    }

    #[test]
    fn its_state_restores_exactly() {
        let mut a = StabilityMonitor::new(3.0, 5, 2).unwrap();
        feed(&mut a, [3.0, 2.0, 1.5, 1.2, 1.1, 1.0, 0.9]);
        let saved = serde_json::to_value(a.state()).unwrap();
        let mut b = StabilityMonitor::new(3.0, 5, 2).unwrap();
        b.restore(&saved).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.observe(8, 2.8, 1.0), b.observe(8, 2.8, 1.0));
        // A shorter window keeps the newest values.
        let mut c = StabilityMonitor::new(3.0, 2, 2).unwrap();
        c.restore(&saved).unwrap();
        assert_eq!(c.state().recent, vec![(1.0, 1.0), (0.9, 1.0)]);
        assert!(c.restore(&serde_json::json!({ "healthy": 1, "recent": [[1.0]] })).is_err());
    }
}
