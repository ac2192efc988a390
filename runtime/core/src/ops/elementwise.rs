//! Elementwise arithmetic and bias addition.

use super::{cuda_launch, float_kernel, run1};
use crate::backend::cuda::args::{Arg, Grid};
use crate::backend::kernel::Out;
use crate::backend::Storage;
use crate::error::{Error, Result};
use crate::tensor::{check_device, check_same_shape};
use crate::tensor::{DType, Tensor};
use tessera_kernels::cpu::elementwise as k;
use tessera_kernels::cpu::mixed::{self, Cut};
use tessera_kernels::Real;

float_kernel!(writes_all Add {} |s, i, o| k::add(i[0], i[1], o[0]); cuda |s, c| cuda_launch::binary(c, "elementwise", "add");
    half |s, dtype, dtypes| true => |i, o| k::add_mixed(i[0], i[1], o.remove(0)));
float_kernel!(writes_all Sub {} |s, i, o| k::sub(i[0], i[1], o[0]); cuda |s, c| cuda_launch::binary(c, "elementwise", "sub");
    half |s, dtype, dtypes| true => |i, o| k::sub_mixed(i[0], i[1], o.remove(0)));
float_kernel!(writes_all Mul {} |s, i, o| k::mul(i[0], i[1], o[0]); cuda |s, c| cuda_launch::binary(c, "elementwise", "mul");
    half |s, dtype, dtypes| true => |i, o| k::mul_mixed(i[0], i[1], o.remove(0)));
float_kernel!(writes_all Scale { by: f64 } |s, i, o| k::scale(i[0], T::lit(s.by), o[0]); cuda |s, c| {
    let n = c.output_len(0);
    c.at_least(Arg::Input(0), n)?;
    // SAFETY: the kernel reads and writes `n` elements: output 0's length, which input 0 has (checked).
    unsafe { c.launch("elementwise", "scale", Grid::Items(n), &[Arg::Input(0), Arg::F32(s.by as f32), Arg::Output(0), Arg::U64(n)]) }
};
    half |s, dtype, dtypes| true => |i, o| k::scale_mixed(i[0], s.by as f32, o.remove(0)));
float_kernel!(writes_all AddBias {} |s, i, o| k::add_bias(i[0], i[1], o[0]); cuda |s, c| {
    let (n, cols) = (c.output_len(0), c.input_len(1));
    c.at_least(Arg::Input(0), n)?;
    // SAFETY: the kernel reads and writes `n` elements (output 0's length, which input 0 has,
    // checked) and the bias at `i % cols`, below its length `cols`.
    unsafe { c.launch("elementwise", "add_bias", Grid::Items(n), &[Arg::Input(0), Arg::Input(1), Arg::Output(0), Arg::U64(n), Arg::U64(cols)]) }
};
    half |s, dtype, dtypes| true => |i, o| {
        let cols = i[1].len();
        // An empty bias goes with an empty input: nothing to compute.
        if let Some(rows) = i[0].len().checked_div(cols) {
            mixed::blocked(rows, &[(i[0], Cut::Units(cols)), (i[1], Cut::Whole)], vec![(o.remove(0), cols)], |_, x, y| k::add_bias(x[0], x[1], y[0]));
        }
    });
float_kernel!(BiasGrad {} |s, i, o| k::bias_grad(i[0], o[0]); cuda |s, c| {
    let cols = c.output_len(0);
    let rows = c.input_len(0).checked_div(cols).unwrap_or(0);
    // SAFETY: the kernel reads `rows * cols` elements, at most input 0's length, and writes
    // `cols`, output 0's length.
    unsafe { c.launch("reduce", "col_sum", Grid::Items(cols), &[Arg::Input(0), Arg::Output(0), Arg::U64(rows), Arg::U64(cols)]) }
};
    // The sums read the bf16 gradient directly, in the f32 kernel's order.
    half |s, dtype, dtypes| dtypes[0] == DType::BF16 => |i, o| {
        let mut db = vec![0f32; o[0].len()];
        k::bias_grad_bf16(i[0].as_bf16().expect("bf16"), &mut db);
        o[0].store(&db);
    });

fn binary<K: super::FloatKernel>(op: &'static str, kernel: &K, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    check_same_shape(op, "operands", a, b)?;
    run1(op, kernel, &[a, b], a.shape().clone(), Out::Primary)
}

/// `a + b` (same shapes). Backward: both operands receive the upstream gradient.
pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    binary("add", &Add {}, a, b)
}

/// `a - b` (same shapes). Backward: `da = dy`, `db = -dy`.
pub fn sub(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    binary("sub", &Sub {}, a, b)
}

/// `a * b` elementwise (same shapes).
pub fn mul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    binary("mul", &Mul {}, a, b)
}

/// Backward of [`mul`]: `(da, db) = (dy * b, dy * a)`.
pub fn mul_backward(a: &Tensor, b: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
    check_same_shape("mul_backward", "upstream gradient and operand", dy, a)?;
    Ok((mul(dy, b)?, mul(dy, a)?))
}

/// `x * by`. Its backward is `scale(dy, by)`.
pub fn scale(x: &Tensor, by: f64) -> Result<Tensor> {
    run1("scale", &Scale { by }, &[x], x.shape().clone(), Out::Primary)
}

/// `x + bias`, with `bias` (one dimension, the size of `x`'s last) added to every row.
pub fn add_bias(x: &Tensor, bias: &Tensor) -> Result<Tensor> {
    let last = x.shape().last_dim("add_bias")?;
    if bias.dims() != [last] {
        return Err(Error::shape(
            "add_bias",
            format!("bias has shape {} but rows of x {} have length {last}; the bias must be [{last}]", bias.shape(), x.shape()),
        ));
    }
    run1("add_bias", &AddBias {}, &[x, bias], x.shape().clone(), Out::Primary)
}

/// Backward of [`add_bias`] for the bias: the upstream gradient summed over rows.
/// (The gradient of `x` is the upstream gradient itself.)
pub fn bias_grad(dy: &Tensor) -> Result<Tensor> {
    let last = dy.shape().last_dim("bias_grad")?;
    run1("bias_grad", &BiasGrad {}, &[dy], [last].into(), Out::Primary)
}

/// `acc += x` in place: gradient accumulation for values used more than once.
/// `acc` must be contiguous, `f32` or `f64`, and not share storage with `x`.
pub fn accumulate(acc: &Tensor, x: &Tensor) -> Result<()> {
    axpy(acc, 1.0, x)
}

/// `y += alpha * x` in place (see [`accumulate`] for the requirements on `y`).
pub fn axpy(y: &Tensor, alpha: f64, x: &Tensor) -> Result<()> {
    const OP: &str = "axpy";
    check_same_shape(OP, "accumulator and increment", y, x)?;
    check_device(OP, y, x)?;
    if y.shares_storage(x) {
        return Err(Error::Aliased { op: OP, a: "accumulator", b: "increment" });
    }
    let Some(range) = y.layout().contiguous_range() else {
        return Err(Error::placement(OP, "the accumulator must be contiguous; accumulate into a fresh `contiguous()` tensor"));
    };
    let x = x.to_dtype(y.dtype()).map_err(|_| Error::unsupported(OP, "increment cannot be converted to the accumulator's dtype"))?;
    let xr = x.layout().contiguous_range().expect("fresh tensor");
    let xg = x.read();
    let mut yg = y.write();
    let not_full = |other| Error::DType { op: OP, expected: "f32 or f64 accumulator".into(), got: other, hint: "; accumulate gradients in full precision" };
    match (&mut *yg, &*xg) {
        (Storage::Cpu(ys), Storage::Cpu(xs)) => match y.dtype() {
            DType::F32 => inplace::<f32>(ys.as_mut_slice().expect("f32"), xs.as_slice().expect("f32"), range, xr, alpha),
            DType::F64 => inplace::<f64>(ys.as_mut_slice().expect("f64"), xs.as_slice().expect("f64"), range, xr, alpha),
            other => return Err(not_full(other)),
        },
        (Storage::Cuda(ys), Storage::Cuda(xs)) => match y.dtype() {
            DType::F32 => ys.axpy(range.start, alpha, xs, xr.start, range.len())?,
            DType::F64 => return Err(Error::NotImplementedOnCuda { op: "axpy on f64" }),
            other => return Err(not_full(other)),
        },
        _ => unreachable!("the operands' devices were checked to be the same"),
    }
    Ok(())
}

fn inplace<T: Real>(y: &mut [T], x: &[T], yr: std::ops::Range<usize>, xr: std::ops::Range<usize>, alpha: f64) {
    if alpha == 1.0 {
        k::add_assign(&mut y[yr], &x[xr]);
    } else {
        k::axpy(T::lit(alpha), &x[xr], &mut y[yr]);
    }
}
