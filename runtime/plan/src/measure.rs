//! Measuring this machine's device: matrix-product rates by shape and
//! dtype, and memory bandwidth, as a profile records them.
//!
//! Each figure is the best of several timed runs after a warm-up (a peak
//! is what a profile states; the noise of a shared machine only ever makes
//! a run slower), and each run waits for the device to finish its work.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tessera_core::{ops, DType, Device, Error, Result, Tensor};

/// A measured matrix-product rate: `[m, k] × [k, n]` in `dtype`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MatmulRate {
    /// Rows of the product.
    pub m: usize,
    /// Columns of the product.
    pub n: usize,
    /// The inner dimension.
    pub k: usize,
    /// The operands' dtype (`f32`, `bf16`, `f16`).
    pub dtype: String,
    /// Flop/s (`2·m·n·k` per product).
    pub flops: f64,
}

/// How long each figure is measured for, at least (and at least three runs).
#[derive(Clone, Copy, Debug)]
pub struct Budget {
    /// Time spent timing one figure.
    pub per_figure: Duration,
}

impl Default for Budget {
    fn default() -> Self {
        Budget { per_figure: Duration::from_millis(300) }
    }
}

/// The best time of one run of `work`, run after one warm-up until `budget`
/// has passed (and at least three times).
fn best_time(device: &Device, budget: Budget, mut work: impl FnMut() -> Result<()>) -> Result<f64> {
    work()?;
    device.synchronize()?;
    let start = Instant::now();
    let (mut best, mut runs) = (f64::INFINITY, 0);
    while runs < 3 || start.elapsed() < budget.per_figure {
        let t = Instant::now();
        work()?;
        device.synchronize()?;
        best = best.min(t.elapsed().as_secs_f64());
        runs += 1;
    }
    Ok(best)
}

/// The rate of `[m, k] × [k, n]` products in `dtype` on `device`.
pub fn matmul_rate(device: &Device, dtype: DType, m: usize, n: usize, k: usize, budget: Budget) -> Result<MatmulRate> {
    if m == 0 || n == 0 || k == 0 {
        return Err(Error::invalid("measure::matmul_rate", format!("a {m}×{k} by {k}×{n} product does no work; give sizes above 0")));
    }
    let a = Tensor::full(0.5, [m, k], dtype, device)?;
    let b = Tensor::full(0.25, [k, n], dtype, device)?;
    let seconds = best_time(device, budget, || ops::matmul(&a, &b).map(drop))?;
    Ok(MatmulRate { m, n, k, dtype: dtype.to_string(), flops: 2.0 * (m * n * k) as f64 / seconds })
}

/// Bytes/s of an element-wise sum of two f32 tensors of `bytes` each (two
/// read, one written): the bandwidth the optimizer's and the norms' passes
/// over memory see.
pub fn memory_bandwidth(device: &Device, bytes: usize, budget: Budget) -> Result<f64> {
    let elements = bytes / 4;
    if elements == 0 {
        return Err(Error::invalid("measure::memory_bandwidth", format!("{bytes} bytes hold no f32; give at least 4")));
    }
    let a = Tensor::full(1.0, [elements], DType::F32, device)?;
    let b = Tensor::full(2.0, [elements], DType::F32, device)?;
    let seconds = best_time(device, budget, || ops::add(&a, &b).map(drop))?;
    Ok(3.0 * (elements * 4) as f64 / seconds)
}

#[cfg(test)]
mod tests {
    use super::*;

    const QUICK: Budget = Budget { per_figure: Duration::from_millis(20) };

    #[test]
    fn rates_are_positive_and_a_product_too_small_to_use_the_machine_is_slower() {
        let dev = Device::cpu();
        let small = matmul_rate(&dev, DType::F32, 8, 8, 8, QUICK).unwrap();
        let large = matmul_rate(&dev, DType::F32, 256, 256, 256, QUICK).unwrap();
        assert!(small.flops > 0.0 && large.flops.is_finite());
        // A 256³ product keeps the cores' vector units busy; an 8³ one is
        // call overhead. Orders of magnitude apart on any machine.
        assert!(large.flops > 4.0 * small.flops, "{small:?} vs {large:?}");
        assert_eq!((large.m, large.n, large.k, large.dtype.as_str()), (256, 256, 256, "f32"));
        let bw = memory_bandwidth(&dev, 16 << 20, QUICK).unwrap();
        assert!(bw > 1e8 && bw < 1e13, "{bw} bytes/s is not a memory bandwidth");
    }

    #[test]
    fn empty_work_is_refused() {
        let dev = Device::cpu();
        assert!(matmul_rate(&dev, DType::F32, 0, 8, 8, QUICK).unwrap_err().to_string().contains("no work"));
        assert!(memory_bandwidth(&dev, 3, QUICK).is_err());
    }
}
