//! LayerNorm and RMSNorm over the last dimension.

use super::{float_kernel, rows, run};
use crate::backend::cuda::args::{Arg, Grid};
use crate::backend::cuda::CudaCall;
use crate::backend::kernel::Out;
use crate::error::{Error, Result};
use crate::tensor::check_same_shape;
use crate::tensor::DType;
use crate::tensor::{Shape, Tensor};
use tessera_kernels::cpu::mixed::{self, Cut};
use tessera_kernels::cpu::norm as k;

float_kernel!(LayerNormFwd { eps: f64, row: usize, has_beta: bool } |s, i, o| {
    let (y, rest) = o.split_at_mut(1);
    let (mean, rstd) = rest.split_at_mut(1);
    k::layernorm_forward(i[0], i[1], s.has_beta.then(|| i[2]), s.eps, s.row, y[0], mean[0], rstd[0])
}; cuda |s, c| {
    let (rows, cols) = (c.output_len(1), s.row);
    let beta = if s.has_beta { Arg::Input(2) } else { Arg::Null };
    let args = [Arg::Input(0), Arg::Input(1), beta, Arg::Output(0), Arg::Output(1), Arg::Output(2), Arg::U64(rows), Arg::U64(cols), Arg::F32(s.eps as f32)];
    for (a, n) in [(Arg::Input(0), rows * cols), (Arg::Input(1), cols), (beta, cols), (Arg::Output(0), rows * cols), (Arg::Output(2), rows)] {
        c.at_least(a, n)?;
    }
    // SAFETY: the kernel reads `rows * cols` inputs and `cols` parameters, and writes
    // `rows * cols` outputs and `rows` statistics each (all checked; `rows` is output 1's length).
    unsafe { c.launch("norm", "layernorm", Grid::Rows { rows, cols }, &args) }
};
    half |s, dtype, dtypes| true => |i, o| {
        let rows = i[0].len() / s.row;
        let mut ins = vec![(i[0], Cut::Units(s.row)), (i[1], Cut::Whole)];
        if s.has_beta {
            ins.push((i[2], Cut::Whole));
        }
        let widths = [s.row, 1, 1];
        mixed::blocked(rows, &ins, o.into_iter().zip(widths).collect(), |_, x, y| {
            let (out, rest) = y.split_at_mut(1);
            let (mean, rstd) = rest.split_at_mut(1);
            k::layernorm_forward(x[0], x[1], s.has_beta.then(|| x[2]), s.eps, s.row, out[0], mean[0], rstd[0])
        })
    });
float_kernel!(LayerNormBack { row: usize, has_beta: bool } |s, i, o| {
    let (dx, rest) = o.split_at_mut(1);
    let (dgamma, dbeta) = rest.split_at_mut(1);
    let dbeta = if s.has_beta { Some(&mut *dbeta[0]) } else { None };
    k::layernorm_backward(i[0], i[1], i[2], i[3], i[4], s.row, dx[0], dgamma[0], dbeta)
}; cuda |s, c| {
    // Inputs: x, gamma, mean, rstd, dy.
    let dbeta = if s.has_beta { Arg::Output(2) } else { Arg::Null };
    norm_backward_cuda(c, s.row, Arg::Stats(2), Arg::Stats(3), Arg::Input(4), dbeta)
};
    // The statistics are f32 (saved by the forward in the compute dtype).
    half |s, dtype, dtypes| dtypes[2] == DType::F32 && dtypes[3] == DType::F32 => |i, o| {
        let (gamma, mean, rstd) = (i[1].to_f32(), i[2].to_f32(), i[3].to_f32());
        let mut o = o.into_iter();
        let dx = o.next().expect("dx");
        let mut dgamma = vec![0f32; s.row];
        let mut dbeta = vec![0f32; if s.has_beta { s.row } else { 0 }];
        k::layernorm_backward_mixed(i[0], &gamma, &mean, &rstd, i[4], s.row, dx, &mut dgamma, s.has_beta.then_some(&mut dbeta[..]));
        o.next().expect("dgamma").store(&dgamma);
        if let Some(mut db) = o.next() {
            db.store(&dbeta);
        }
    });
float_kernel!(RmsNormFwd { eps: f64, row: usize } |s, i, o| {
    let (y, rstd) = o.split_at_mut(1);
    k::rmsnorm_forward(i[0], i[1], s.eps, s.row, y[0], rstd[0])
}; cuda |s, c| {
    let (rows, cols) = (c.output_len(1), s.row);
    let args = [Arg::Input(0), Arg::Input(1), Arg::Output(0), Arg::Output(1), Arg::U64(rows), Arg::U64(cols), Arg::F32(s.eps as f32)];
    for (a, n) in [(Arg::Input(0), rows * cols), (Arg::Input(1), cols), (Arg::Output(0), rows * cols)] {
        c.at_least(a, n)?;
    }
    // SAFETY: the kernel reads `rows * cols` inputs and `cols` parameters, and writes
    // `rows * cols` outputs and `rows` statistics (all checked; `rows` is output 1's length).
    unsafe { c.launch("norm", "rmsnorm", Grid::Rows { rows, cols }, &args) }
};
    half |s, dtype, dtypes| true => |i, o| {
        let rows = i[0].len() / s.row;
        mixed::blocked(rows, &[(i[0], Cut::Units(s.row)), (i[1], Cut::Whole)], o.into_iter().zip([s.row, 1]).collect(), |_, x, y| {
            let (out, rstd) = y.split_at_mut(1);
            k::rmsnorm_forward(x[0], x[1], s.eps, s.row, out[0], rstd[0])
        })
    });
float_kernel!(RmsNormBack { row: usize } |s, i, o| {
    let (dx, dgamma) = o.split_at_mut(1);
    k::rmsnorm_backward(i[0], i[1], i[2], i[3], s.row, dx[0], dgamma[0])
}; cuda |s, c| {
    // Inputs: x, gamma, rstd, dy; no mean.
    norm_backward_cuda(c, s.row, Arg::Null, Arg::Stats(2), Arg::Input(3), Arg::Null)
};
    half |s, dtype, dtypes| dtypes[2] == DType::F32 => |i, o| {
        let (gamma, rstd) = (i[1].to_f32(), i[2].to_f32());
        let mut o = o.into_iter();
        let dx = o.next().expect("dx");
        let mut dgamma = vec![0f32; s.row];
        k::rmsnorm_backward_mixed(i[0], &gamma, &rstd, i[3], s.row, dx, &mut dgamma);
        o.next().expect("dgamma").store(&dgamma);
    });

/// Both norms' backward on a GPU: `dx` per row (output 0), then `dgamma`
/// (output 1) and `dbeta` (`Arg::Null` when there is none) per column.
/// Inputs 0 and 1 are `x` and `gamma`; a null `mean` means RMSNorm.
fn norm_backward_cuda(c: &mut CudaCall, cols: usize, mean: Arg, rstd: Arg, dy: Arg, dbeta: Arg) -> Result<()> {
    let rows = c.input_len(0).checked_div(cols).unwrap_or(0);
    let (x, gamma, dims) = (Arg::Input(0), Arg::Input(1), [Arg::U64(rows), Arg::U64(cols)]);
    for (a, n) in [(gamma, cols), (mean, rows), (rstd, rows), (dy, rows * cols), (Arg::Output(0), rows * cols), (Arg::Output(1), cols), (dbeta, cols)] {
        c.at_least(a, n)?;
    }
    // SAFETY: the kernels read `rows * cols` of `x` (input 0's length rounded down to whole
    // rows) and `dy`, `rows` statistics and `cols` parameters, and write `rows * cols` of `dx`
    // and `cols` of each parameter gradient (all checked).
    unsafe {
        c.launch("norm", "norm_backward", Grid::Rows { rows, cols }, &[x, gamma, mean, rstd, dy, Arg::Output(0), dims[0], dims[1]])?;
        c.launch("norm", "norm_param_grad", Grid::Items(cols), &[x, mean, rstd, dy, Arg::Output(1), dbeta, dims[0], dims[1]])
    }
}

/// What a normalisation keeps for its backward: per-row statistics in the
/// compute dtype (the input itself is kept by the caller).
#[derive(Clone, Debug)]
pub struct NormSaved {
    /// Per-row mean (LayerNorm only).
    pub mean: Option<Tensor>,
    /// Per-row reciprocal standard deviation (or RMS).
    pub rstd: Tensor,
}

fn check_params(op: &'static str, x: &Tensor, gamma: &Tensor, beta: Option<&Tensor>) -> Result<usize> {
    let row = x.shape().last_dim(op)?;
    if gamma.dims() != [row] {
        return Err(Error::shape(op, format!("gain has shape {} but rows of x {} have length {row}; it must be [{row}]", gamma.shape(), x.shape())));
    }
    if let Some(b) = beta {
        check_same_shape(op, "gain and bias", gamma, b)?;
    }
    if !(1..=1 << 24).contains(&row) {
        return Err(Error::shape(op, format!("rows of length {row} cannot be normalised")));
    }
    Ok(row)
}

fn check_eps(op: &'static str, eps: f64) -> Result<()> {
    if eps.is_finite() && eps > 0.0 {
        Ok(())
    } else {
        Err(Error::invalid(op, format!("eps must be a small positive number (e.g. 1e-5), got {eps}")))
    }
}

/// LayerNorm: `(x - mean) / sqrt(var + eps) * gamma + beta` over the last dimension.
pub fn layer_norm(x: &Tensor, gamma: &Tensor, beta: Option<&Tensor>, eps: f64) -> Result<(Tensor, NormSaved)> {
    const OP: &str = "layer_norm";
    let row = check_params(OP, x, gamma, beta)?;
    check_eps(OP, eps)?;
    let stats = Shape::new(vec![rows(x)]);
    let mut inputs = vec![x, gamma];
    inputs.extend(beta);
    let kernel = LayerNormFwd { eps, row, has_beta: beta.is_some() };
    let mut v = run(OP, &kernel, &inputs, &[(x.shape().clone(), Out::Primary), (stats.clone(), Out::Compute), (stats, Out::Compute)])?;
    let rstd = v.pop().expect("3 outputs");
    let mean = v.pop().expect("3 outputs");
    Ok((v.pop().expect("3 outputs"), NormSaved { mean: Some(mean), rstd }))
}

/// Backward of [`layer_norm`]: `(dx, dgamma, dbeta)`; `dbeta` is `Some` when the forward had a bias.
pub fn layer_norm_backward(x: &Tensor, gamma: &Tensor, has_beta: bool, saved: &NormSaved, dy: &Tensor) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    const OP: &str = "layer_norm_backward";
    let row = check_params(OP, x, gamma, None)?;
    check_same_shape(OP, "input and upstream gradient", x, dy)?;
    let mean = saved.mean.as_ref().ok_or_else(|| Error::state_mismatch(OP, "the saved statistics come from rms_norm, not layer_norm"))?;
    let kernel = LayerNormBack { row, has_beta };
    let mut outs = vec![(x.shape().clone(), Out::Primary), (gamma.shape().clone(), Out::Primary)];
    if has_beta {
        outs.push((gamma.shape().clone(), Out::Primary));
    }
    let mut v = run(OP, &kernel, &[x, gamma, mean, &saved.rstd, dy], &outs)?;
    let dbeta = if has_beta { v.pop() } else { None };
    let dgamma = v.pop().expect("dgamma");
    Ok((v.pop().expect("dx"), dgamma, dbeta))
}

/// RMSNorm: `x / sqrt(mean(x²) + eps) * gamma` over the last dimension.
pub fn rms_norm(x: &Tensor, gamma: &Tensor, eps: f64) -> Result<(Tensor, NormSaved)> {
    const OP: &str = "rms_norm";
    let row = check_params(OP, x, gamma, None)?;
    check_eps(OP, eps)?;
    let stats = Shape::new(vec![rows(x)]);
    let mut v = run(OP, &RmsNormFwd { eps, row }, &[x, gamma], &[(x.shape().clone(), Out::Primary), (stats, Out::Compute)])?;
    let rstd = v.pop().expect("2 outputs");
    Ok((v.pop().expect("2 outputs"), NormSaved { mean: None, rstd }))
}

/// Backward of [`rms_norm`]: `(dx, dgamma)`.
pub fn rms_norm_backward(x: &Tensor, gamma: &Tensor, saved: &NormSaved, dy: &Tensor) -> Result<(Tensor, Tensor)> {
    const OP: &str = "rms_norm_backward";
    let row = check_params(OP, x, gamma, None)?;
    check_same_shape(OP, "input and upstream gradient", x, dy)?;
    let mut v = run(OP, &RmsNormBack { row }, &[x, gamma, &saved.rstd, dy], &[(x.shape().clone(), Out::Primary), (gamma.shape().clone(), Out::Primary)])?;
    let dgamma = v.pop().expect("dgamma");
    Ok((v.pop().expect("dx"), dgamma))
}
