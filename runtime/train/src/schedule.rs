//! Learning-rate schedules.

use tessera_core::{Error, Result};

/// Linear warm-up to `peak` over `warmup` steps, then cosine decay to `min`
/// at step `total` (and `min` after it). Steps count from 1.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WarmupCosine {
    peak: f64,
    min: f64,
    warmup: u64,
    total: u64,
}

impl WarmupCosine {
    /// The schedule; `min ≤ peak`, `warmup ≤ total`, `total ≥ 1`.
    pub fn new(peak: f64, min: f64, warmup: u64, total: u64) -> Result<Self> {
        if !(peak.is_finite() && peak > 0.0 && min >= 0.0 && min <= peak) {
            return Err(Error::invalid("WarmupCosine", format!("need 0 <= min <= peak and peak > 0; got peak {peak}, min {min}")));
        }
        if total == 0 || warmup > total {
            return Err(Error::invalid("WarmupCosine", format!("need 1 <= total steps and warm-up <= total; got warm-up {warmup}, total {total}")));
        }
        Ok(WarmupCosine { peak, min, warmup, total })
    }

    /// The learning rate of step `step` (1-based).
    pub fn lr(&self, step: u64) -> f64 {
        if step <= self.warmup {
            return self.peak * step as f64 / self.warmup.max(1) as f64;
        }
        let span = (self.total - self.warmup).max(1) as f64;
        let progress = ((step - self.warmup) as f64 / span).min(1.0);
        self.min + (self.peak - self.min) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warms_up_linearly_then_decays_along_a_cosine() {
        let s = WarmupCosine::new(1e-3, 1e-4, 10, 110).unwrap();
        assert_eq!(s.lr(1), 1e-4);
        assert_eq!(s.lr(10), 1e-3);
        assert!((s.lr(60) - 5.5e-4).abs() < 1e-12, "half way down the cosine: {}", s.lr(60));
        assert!((s.lr(110) - 1e-4).abs() < 1e-15);
        assert_eq!(s.lr(500), 1e-4);
        assert!((2..=110).all(|t| t <= 10 || s.lr(t) <= s.lr(t - 1)), "non-increasing after warm-up");
        assert!(WarmupCosine::new(1e-3, 1e-2, 0, 10).is_err());
        assert!(WarmupCosine::new(1e-3, 0.0, 20, 10).is_err());
    }
}
