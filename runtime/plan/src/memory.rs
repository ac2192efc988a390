//! The memory a rank's model states take: parameters, gradients and the
//! optimizer's states, by precision and ZeRO stage.
//!
//! With `Ψ` parameters on a rank (after tensor and pipeline parallelism
//! have split the model) and `N` data-parallel replicas, ZeRO partitions
//! over the replicas the optimizer's states (stage 1), then the gradients
//! too (stage 2), then the parameters too (stage 3). Mixed-precision Adam
//! (bf16 parameters and gradients, f32 master weights and moments) takes
//! 16 bytes per parameter unpartitioned, `4Ψ + 12Ψ/N` at stage 1,
//! `2Ψ + 14Ψ/N` at stage 2 and `16Ψ/N` at stage 3: the figures of the ZeRO
//! paper (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training
//! Trillion Parameter Models", SC 2020, section 3 and figure 1), which the
//! tests reproduce.

/// Bytes per parameter of each model state.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Precision {
    /// The parameters as the forward reads them.
    pub param: f64,
    /// Their gradients.
    pub grad: f64,
    /// An f32 master copy of the parameters (0 when they are f32 already).
    pub master: f64,
    /// The optimizer's states (AdamW: two f32 moments, 8).
    pub optimizer: f64,
}

impl Precision {
    /// Everything in f32 with AdamW: 4 + 4 + 8 bytes.
    pub const F32_ADAMW: Precision = Precision { param: 4.0, grad: 4.0, master: 0.0, optimizer: 8.0 };
    /// bf16 parameters and gradients, an f32 master copy and f32 AdamW
    /// moments: 2 + 2 + 4 + 8 bytes.
    pub const BF16_ADAMW: Precision = Precision { param: 2.0, grad: 2.0, master: 4.0, optimizer: 8.0 };
}

/// What ZeRO partitions over the data-parallel replicas.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum ZeroStage {
    /// Nothing: every replica holds every state.
    None,
    /// The optimizer's states (and the master copy).
    One,
    /// The gradients too.
    Two,
    /// The parameters too.
    Three,
}

impl ZeroStage {
    /// The stage a configuration's `zero.stage` number names (3 and above: 3).
    pub fn from_number(stage: u8) -> ZeroStage {
        match stage {
            0 => ZeroStage::None,
            1 => ZeroStage::One,
            2 => ZeroStage::Two,
            _ => ZeroStage::Three,
        }
    }

    /// The stage's number, as a configuration writes it.
    pub fn number(self) -> u8 {
        match self {
            ZeroStage::None => 0,
            ZeroStage::One => 1,
            ZeroStage::Two => 2,
            ZeroStage::Three => 3,
        }
    }
}

/// A rank's model states, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StateBytes {
    /// Parameters.
    pub params: f64,
    /// Gradients.
    pub grads: f64,
    /// Master copy and optimizer states.
    pub optimizer: f64,
}

impl StateBytes {
    /// All of them.
    pub fn total(&self) -> f64 {
        self.params + self.grads + self.optimizer
    }
}

/// The model states of a rank holding `params` parameters (its share after
/// tensor and pipeline parallelism), one of `replicas` data-parallel
/// replicas, at `zero` in `precision`.
pub fn model_states(params: f64, replicas: usize, zero: ZeroStage, precision: Precision) -> StateBytes {
    let n = replicas.max(1) as f64;
    let share = |partitioned: bool| if partitioned { params / n } else { params };
    StateBytes {
        params: share(zero >= ZeroStage::Three) * precision.param,
        grads: share(zero >= ZeroStage::Two) * precision.grad,
        optimizer: share(zero >= ZeroStage::One) * (precision.master + precision.optimizer),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_zero_papers_figures_for_a_7_5_billion_parameter_model_on_64_gpus() {
        // Figure 1 of the ZeRO paper: Ψ = 7.5 B, N_d = 64, K = 12.
        let gb = |s: StateBytes| s.total() / 1e9;
        let at = |zero| gb(model_states(7.5e9, 64, zero, Precision::BF16_ADAMW));
        assert!((at(ZeroStage::None) - 120.0).abs() < 0.01);
        assert!((at(ZeroStage::One) - 31.4).abs() < 0.05, "{}", at(ZeroStage::One));
        assert!((at(ZeroStage::Two) - 16.6).abs() < 0.05, "{}", at(ZeroStage::Two));
        assert!((at(ZeroStage::Three) - 1.88).abs() < 0.01, "{}", at(ZeroStage::Three));
    }

    #[test]
    fn the_closed_forms_hold_for_any_size_and_replica_count() {
        for (psi, n) in [(1e6, 1), (3.3e8, 2), (1.75e11, 1024)] {
            let p = Precision::BF16_ADAMW;
            let nf = n as f64;
            let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.max(1.0);
            assert!(close(model_states(psi, n, ZeroStage::None, p).total(), 16.0 * psi));
            assert!(close(model_states(psi, n, ZeroStage::One, p).total(), 4.0 * psi + 12.0 * psi / nf));
            assert!(close(model_states(psi, n, ZeroStage::Two, p).total(), 2.0 * psi + 14.0 * psi / nf));
            assert!(close(model_states(psi, n, ZeroStage::Three, p).total(), 16.0 * psi / nf));
            // f32 AdamW has no master copy: 16 bytes as well, split alike.
            assert!(close(model_states(psi, n, ZeroStage::One, Precision::F32_ADAMW).total(), 8.0 * psi + 8.0 * psi / nf));
        }
        // No replicas to partition over: every stage is the baseline.
        let one = |z| model_states(1e6, 1, z, Precision::F32_ADAMW).total();
        assert_eq!(one(ZeroStage::Three), one(ZeroStage::None));
    }
}
