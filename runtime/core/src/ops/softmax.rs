//! Softmax and log-softmax over the last dimension.

use super::cuda_launch::{rows_binary, rows_unary};
use super::{float_kernel, run1};
use crate::backend::kernel::Out;
use crate::error::Result;
use crate::tensor::check_same_shape;
use crate::tensor::Tensor;
use tessera_kernels::cpu::mixed::{self, Cut, Dst, Src};
use tessera_kernels::cpu::softmax as k;

float_kernel!(writes_all Softmax { row: usize } |s, i, o| k::softmax_forward(i[0], s.row, o[0]);
    cuda |s, c| rows_unary(c, "loss", "softmax", s.row);
    half |s, dtype, dtypes| true => |i, o| rows(i, o, s.row, k::softmax_forward));
float_kernel!(writes_all SoftmaxBack { row: usize } |s, i, o| k::softmax_backward(i[0], i[1], s.row, o[0]);
    cuda |s, c| rows_binary(c, "loss", "softmax_backward", s.row);
    half |s, dtype, dtypes| true => |i, o| rows2(i, o, s.row, k::softmax_backward));
float_kernel!(writes_all LogSoftmax { row: usize } |s, i, o| k::log_softmax_forward(i[0], s.row, o[0]);
    cuda |s, c| rows_unary(c, "loss", "log_softmax", s.row);
    half |s, dtype, dtypes| true => |i, o| rows(i, o, s.row, k::log_softmax_forward));
float_kernel!(writes_all LogSoftmaxBack { row: usize } |s, i, o| k::log_softmax_backward(i[0], i[1], s.row, o[0]);
    cuda |s, c| rows_binary(c, "loss", "log_softmax_backward", s.row);
    half |s, dtype, dtypes| true => |i, o| rows2(i, o, s.row, k::log_softmax_backward));

/// A row kernel `f(x, row, y)` on half-precision operands, a block of whole rows at a time.
fn rows(i: &[Src<'_>], mut o: Vec<Dst<'_>>, row: usize, f: fn(&[f32], usize, &mut [f32])) {
    let n = i[0].len().checked_div(row).unwrap_or(0);
    mixed::blocked(n, &[(i[0], Cut::Units(row))], vec![(o.remove(0), row)], |_, x, y| f(x[0], row, y[0]));
}

/// A row kernel `f(y, dy, row, dx)` on half-precision operands, a block of whole rows at a time.
fn rows2(i: &[Src<'_>], mut o: Vec<Dst<'_>>, row: usize, f: fn(&[f32], &[f32], usize, &mut [f32])) {
    let n = i[0].len().checked_div(row).unwrap_or(0);
    mixed::blocked(n, &[(i[0], Cut::Units(row)), (i[1], Cut::Units(row))], vec![(o.remove(0), row)], |_, x, y| f(x[0], x[1], row, y[0]));
}

/// Softmax over the last dimension.
pub fn softmax(x: &Tensor) -> Result<Tensor> {
    let row = x.shape().last_dim("softmax")?;
    run1("softmax", &Softmax { row }, &[x], x.shape().clone(), Out::Primary)
}

/// Backward of [`softmax`], from its output `y` and the upstream gradient.
pub fn softmax_backward(y: &Tensor, dy: &Tensor) -> Result<Tensor> {
    check_same_shape("softmax_backward", "output and upstream gradient", y, dy)?;
    let row = y.shape().last_dim("softmax_backward")?;
    run1("softmax_backward", &SoftmaxBack { row }, &[y, dy], y.shape().clone(), Out::Primary)
}

/// Log-softmax over the last dimension.
pub fn log_softmax(x: &Tensor) -> Result<Tensor> {
    let row = x.shape().last_dim("log_softmax")?;
    run1("log_softmax", &LogSoftmax { row }, &[x], x.shape().clone(), Out::Primary)
}

/// Backward of [`log_softmax`], from its output `y` and the upstream gradient.
pub fn log_softmax_backward(y: &Tensor, dy: &Tensor) -> Result<Tensor> {
    check_same_shape("log_softmax_backward", "output and upstream gradient", y, dy)?;
    let row = y.shape().last_dim("log_softmax_backward")?;
    run1("log_softmax_backward", &LogSoftmaxBack { row }, &[y, dy], y.shape().clone(), Out::Primary)
}
