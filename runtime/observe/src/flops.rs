//! Counting a transformer's training FLOPs, and the peak they are compared to.

use std::time::Instant;
use tessera_core::ops;
use tessera_core::Result;
use tessera_core::{DType, Device, Init, RngKey, Tensor};

/// Training FLOPs per token of a decoder-only transformer: `6·N` for the
/// matmuls of forward and backward over `params` weights (2 per multiply-add,
/// 3 passes), plus `12·L·T·d` for attention scores and their use (`QKᵀ` and
/// `PV`, forward and backward) over `layers` layers of width `dim` at
/// sequence length `seq`. This is the count of the PaLM paper's MFU
/// appendix; it ignores norms, activations and the softmax.
pub fn transformer_flops_per_token(params: usize, layers: usize, seq: usize, dim: usize) -> f64 {
    6.0 * params as f64 + 12.0 * (layers * seq * dim) as f64
}

/// The peak FLOP/s a model's utilisation is measured against.
///
/// On CPU ranks there is no datasheet figure that means anything for a
/// shared machine, so the peak is measured: the rate of Tessera's own f32
/// matmul on a square problem, over the whole thread pool, at the start of
/// the run. MFU on CPU therefore reads "share of what the matmul kernel
/// reaches on this machine now".
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PeakRate {
    /// FLOP/s.
    pub flops_per_s: f64,
}

impl PeakRate {
    /// Measures the f32 matmul rate at `n × n × n` on `device` (best of a few runs).
    pub fn measure_matmul(device: &Device, n: usize) -> Result<PeakRate> {
        Self::measure_matmul_shape(device, n, n, n)
    }

    /// Measures the f32 matmul rate of `[m, k] · [k, n]` on `device` (best of a few runs).
    pub fn measure_matmul_shape(device: &Device, m: usize, k: usize, n: usize) -> Result<PeakRate> {
        let init = Init::Uniform { lo: -1.0, hi: 1.0 };
        let a = Tensor::rand(init, RngKey::new(1, 0), [m, k], DType::F32, device)?;
        let b = Tensor::rand(init, RngKey::new(2, 0), [k, n], DType::F32, device)?;
        ops::matmul(&a, &b)?;
        // A GPU queues the product and returns: time it to completion.
        device.synchronize()?;
        let mut best = f64::MAX;
        for _ in 0..3 {
            let t = Instant::now();
            ops::matmul(&a, &b)?;
            device.synchronize()?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        Ok(PeakRate { flops_per_s: 2.0 * (m * k * n) as f64 / best.max(1e-9) })
    }
}
