//! Activation functions: GELU (tanh form), SiLU and SwiGLU.

use super::{cuda_launch, float_kernel, run, run1};
use crate::backend::cuda::args::{Arg, Grid};
use crate::backend::kernel::Out;
use crate::error::Result;
use crate::tensor::check_same_shape;
use crate::tensor::Tensor;
use tessera_kernels::cpu::activation as k;

float_kernel!(writes_all Gelu {} |s, i, o| k::gelu_forward(i[0], o[0]); cuda |s, c| cuda_launch::unary(c, "elementwise", "gelu");
    half |s, dtype, dtypes| true => |i, o| k::gelu_forward_mixed(i[0], o.remove(0)));
float_kernel!(writes_all GeluBack {} |s, i, o| k::gelu_backward(i[0], i[1], o[0]); cuda |s, c| cuda_launch::binary(c, "elementwise", "gelu_backward");
    half |s, dtype, dtypes| true => |i, o| k::gelu_backward_mixed(i[0], i[1], o.remove(0)));
float_kernel!(writes_all Silu {} |s, i, o| k::silu_forward(i[0], o[0]); cuda |s, c| cuda_launch::unary(c, "elementwise", "silu");
    half |s, dtype, dtypes| true => |i, o| k::silu_forward_mixed(i[0], o.remove(0)));
float_kernel!(writes_all SiluBack {} |s, i, o| k::silu_backward(i[0], i[1], o[0]); cuda |s, c| cuda_launch::binary(c, "elementwise", "silu_backward");
    half |s, dtype, dtypes| true => |i, o| k::silu_backward_mixed(i[0], i[1], o.remove(0)));
float_kernel!(writes_all SwiGlu {} |s, i, o| k::swiglu_forward(i[0], i[1], o[0]); cuda |s, c| cuda_launch::binary(c, "elementwise", "swiglu");
    half |s, dtype, dtypes| true => |i, o| k::swiglu_forward_mixed(i[0], i[1], o.remove(0)));
float_kernel!(writes_all SwiGluBack {} |s, i, o| {
    let (dgate, dup) = o.split_at_mut(1);
    k::swiglu_backward(i[0], i[1], i[2], dgate[0], dup[0])
}; cuda |s, c| {
    let n = c.output_len(0);
    let args = [Arg::Input(0), Arg::Input(1), Arg::Input(2), Arg::Output(0), Arg::Output(1), Arg::U64(n)];
    for a in [Arg::Input(0), Arg::Input(1), Arg::Input(2), Arg::Output(1)] {
        c.at_least(a, n)?;
    }
    // SAFETY: the kernel reads and writes `n` elements of each operand (checked).
    unsafe { c.launch("elementwise", "swiglu_backward", Grid::Items(n), &args) }
};
    half |s, dtype, dtypes| true => |i, o| {
        let mut o = o.into_iter();
        let (dgate, dup) = (o.next().expect("dgate"), o.next().expect("dup"));
        k::swiglu_backward_mixed(i[0], i[1], i[2], dgate, dup)
    });

/// GELU, tanh approximation: `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    run1("gelu", &Gelu {}, &[x], x.shape().clone(), Out::Primary)
}

/// Backward of [`gelu`]: the gradient of `x` from the input and the upstream gradient.
pub fn gelu_backward(x: &Tensor, dy: &Tensor) -> Result<Tensor> {
    check_same_shape("gelu_backward", "input and upstream gradient", x, dy)?;
    run1("gelu_backward", &GeluBack {}, &[x, dy], x.shape().clone(), Out::Primary)
}

/// SiLU (swish): `x * sigmoid(x)`.
pub fn silu(x: &Tensor) -> Result<Tensor> {
    run1("silu", &Silu {}, &[x], x.shape().clone(), Out::Primary)
}

/// Backward of [`silu`].
pub fn silu_backward(x: &Tensor, dy: &Tensor) -> Result<Tensor> {
    check_same_shape("silu_backward", "input and upstream gradient", x, dy)?;
    run1("silu_backward", &SiluBack {}, &[x, dy], x.shape().clone(), Out::Primary)
}

/// SwiGLU's gating: `silu(gate) * up` (same shapes), as in Llama's MLP.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    check_same_shape("swiglu", "gate and up", gate, up)?;
    run1("swiglu", &SwiGlu {}, &[gate, up], gate.shape().clone(), Out::Primary)
}

/// Backward of [`swiglu`]: `(dgate, dup)`.
pub fn swiglu_backward(gate: &Tensor, up: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
    check_same_shape("swiglu_backward", "gate and up", gate, up)?;
    check_same_shape("swiglu_backward", "gate and upstream gradient", gate, dy)?;
    let shape = gate.shape().clone();
    let mut v = run("swiglu_backward", &SwiGluBack {}, &[gate, up, dy], &[(shape.clone(), Out::Primary), (shape, Out::Primary)])?;
    let dup = v.pop().expect("two outputs");
    Ok((v.pop().expect("two outputs"), dup))
}
