//! Dropout whose mask is recomputed from a counter-based RNG, never stored.

use super::{float_kernel, run1};
use crate::backend::cuda::args::{Arg, Grid};
use crate::backend::cuda::CudaCall;
use crate::backend::kernel::Out;
use crate::error::{Error, Result};
use crate::tensor::check_same_shape;
use crate::tensor::Tensor;
use tessera_kernels::cpu::dropout as k;
use tessera_kernels::rng::RngKey;

float_kernel!(writes_all DropFwd { key: RngKey, start: u64, p: f64 } |s, i, o| k::dropout_forward(s.key, s.start, s.p, i[0], o[0]);
    cuda |s, c| dropout_cuda(c, s.key, s.start, s.p));
float_kernel!(writes_all DropBack { key: RngKey, start: u64, p: f64 } |s, i, o| k::dropout_backward(s.key, s.start, s.p, i[0], o[0]);
    cuda |s, c| dropout_cuda(c, s.key, s.start, s.p));

/// Dropout (or its backward, the same map) on a GPU: `dropout.cu` draws the
/// CPU's mask, so both devices drop the same elements for a key and offset.
fn dropout_cuda(c: &mut CudaCall, key: RngKey, start: u64, p: f64) -> Result<()> {
    let n = c.output_len(0);
    // The CPU's rule: keep when the top 24 bits reach ceil(p · 2^24), scale in the compute type.
    let threshold = (p * (1u32 << 24) as f64).ceil() as u32;
    let scale = (1.0 / (1.0 - p)) as f32;
    let args = [
        Arg::Input(0),
        Arg::Output(0),
        Arg::U64(n),
        Arg::U64(start as usize),
        Arg::U64(key.seed as usize),
        Arg::U64(key.stream as usize),
        Arg::U32(threshold),
        Arg::F32(scale),
    ];
    c.at_least(Arg::Input(0), n)?;
    // SAFETY: the kernel reads and writes `n` elements: output 0's length, which input 0 has (checked).
    unsafe { c.launch("dropout", "dropout", Grid::Items(n), &args) }
}

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
