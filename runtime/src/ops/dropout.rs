//! Dropout whose mask is recomputed from a counter-based RNG, never stored.

use super::{check_same_shape, float_kernel, run1};
use crate::backend::cpu::Out;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use tessera_kernels::cpu::dropout as k;
use tessera_kernels::rng::RngKey;

float_kernel!(DropFwd { key: RngKey, start: u64, p: f64 } |s, i, o| k::dropout_forward(s.key, s.start, s.p, i[0], o[0]));
float_kernel!(DropBack { key: RngKey, start: u64, p: f64 } |s, i, o| k::dropout_backward(s.key, s.start, s.p, i[0], o[0]));

fn check_p(op: &'static str, p: f64) -> Result<()> {
    if (0.0..1.0).contains(&p) {
        Ok(())
    } else {
        Err(Error::invalid(op, format!("the drop probability must be in [0, 1), got {p}")))
    }
}

/// Zeroes each element with probability `p` and scales the rest by `1/(1-p)`.
///
/// Element `i` is dropped according to `key` at index `start + i` only, so the
/// same `(key, start)` reproduces the mask exactly: in the backward, after
/// recompute, and on a rank holding a slice of the tensor (pass its offset).
pub fn dropout(x: &Tensor, p: f64, key: RngKey, start: u64) -> Result<Tensor> {
    check_p("dropout", p)?;
    run1("dropout", &DropFwd { key, start, p }, &[x], x.shape().clone(), Out::Primary)
}

/// Backward of [`dropout`] with the same `p`, `key` and `start`.
pub fn dropout_backward(dy: &Tensor, p: f64, key: RngKey, start: u64) -> Result<Tensor> {
    check_p("dropout_backward", p)?;
    run1("dropout_backward", &DropBack { key, start, p }, &[dy], dy.shape().clone(), Out::Primary).and_then(|dx| {
        check_same_shape("dropout_backward", "gradient", &dx, dy)?;
        Ok(dx)
    })
}
