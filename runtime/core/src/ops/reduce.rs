//! Reductions to a scalar: sum, squared norm, largest magnitude.

use super::{cuda_launch, float_kernel, run1, scale};
use crate::backend::cuda::args::{Arg, Grid};
use crate::backend::kernel::Out;
use crate::error::{Error, Result};
use crate::tensor::{Shape, Tensor};
use tessera_kernels::cpu::reduce as k;

float_kernel!(Sum {} |s, i, o| o[0][0] = k::sum(i[0]); cuda |s, c| { let n = c.input_len(0); cuda_launch::row_reduce(c, "row_sum", 1, n) });
float_kernel!(SumSquares {} |s, i, o| o[0][0] = k::sum_squares(i[0]); cuda |s, c| { let n = c.input_len(0); cuda_launch::row_reduce(c, "row_sum_squares", 1, n) });
float_kernel!(writes_all MaxAbs {} |s, i, o| o[0][0] = k::max_abs(i[0]); cuda |s, c| {
    let n = c.input_len(0);
    c.at_least(Arg::Output(0), 1)?;
    // SAFETY: the kernel reads input 0's `n` elements and writes one (checked).
    unsafe { c.launch("reduce", "max_abs", Grid::Rows { rows: 1, cols: n }, &[Arg::Input(0), Arg::Output(0), Arg::U64(n)]) }
});
float_kernel!(Broadcast {} |s, i, o| o[0].fill(i[0][0]); cuda |s, c| cuda_launch::broadcast(c, "elementwise", "broadcast"));

/// The sum of all elements, as a scalar tensor in the compute dtype.
/// Deterministic: the same input always gives the same bits, on any thread count.
pub fn sum(x: &Tensor) -> Result<Tensor> {
    run1("sum", &Sum {}, &[x], Shape::from(()), Out::Compute)
}

/// Backward of [`sum`]: the scalar upstream gradient broadcast to `shape`.
pub fn sum_backward(dy: &Tensor, shape: impl Into<Shape>) -> Result<Tensor> {
    if dy.elem_count() != 1 {
        return Err(Error::shape("sum_backward", format!("the upstream gradient of a sum is a scalar, got shape {}", dy.shape())));
    }
    run1("sum_backward", &Broadcast {}, &[dy], shape.into(), Out::Primary)
}

/// The squared L2 norm `sum(x²)`, as a scalar in the compute dtype (what
/// global gradient-norm clipping adds up over all parameters).
pub fn sum_squares(x: &Tensor) -> Result<Tensor> {
    run1("sum_squares", &SumSquares {}, &[x], Shape::from(()), Out::Compute)
}

/// Backward of [`sum_squares`]: `2 x dy` for the scalar upstream gradient `dy`.
pub fn sum_squares_backward(x: &Tensor, dy: f64) -> Result<Tensor> {
    scale(x, 2.0 * dy)
}

/// The largest absolute value; NaN if any element is NaN (overflow detection relies on it).
pub fn max_abs(x: &Tensor) -> Result<Tensor> {
    run1("max_abs", &MaxAbs {}, &[x], Shape::from(()), Out::Compute)
}
