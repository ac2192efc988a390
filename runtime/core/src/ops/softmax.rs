//! Softmax and log-softmax over the last dimension.

use super::cuda_launch::{rows_binary, rows_unary};
use super::{float_kernel, run1};
use crate::backend::kernel::Out;
use crate::error::Result;
use crate::tensor::check_same_shape;
use crate::tensor::Tensor;
use tessera_kernels::cpu::softmax as k;

float_kernel!(writes_all Softmax { row: usize } |s, i, o| k::softmax_forward(i[0], s.row, o[0]);
    cuda |s, c| rows_unary(c, "loss", "softmax", s.row));
float_kernel!(writes_all SoftmaxBack { row: usize } |s, i, o| k::softmax_backward(i[0], i[1], s.row, o[0]);
    cuda |s, c| rows_binary(c, "loss", "softmax_backward", s.row));
float_kernel!(writes_all LogSoftmax { row: usize } |s, i, o| k::log_softmax_forward(i[0], s.row, o[0]);
    cuda |s, c| rows_unary(c, "loss", "log_softmax", s.row));
float_kernel!(writes_all LogSoftmaxBack { row: usize } |s, i, o| k::log_softmax_backward(i[0], i[1], s.row, o[0]);
    cuda |s, c| rows_binary(c, "loss", "log_softmax_backward", s.row));

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
