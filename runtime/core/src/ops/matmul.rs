//! Matrix products, batched, with transposed operands taken as views.

use super::{float_kernel, run1};
use crate::backend::cuda::args::{Arg, Grid};
use crate::backend::kernel::Out;
use crate::error::{Error, Result};
use crate::tensor::check_device;
use crate::tensor::DType;
use crate::tensor::{Shape, Tensor};
use tessera_kernels::cpu::matmul::{
    bf16_native, matmul as gemm, matmul_bf16 as gemm_bf16, matmul_bias as gemm_bias, matmul_bias_bf16 as gemm_bias_bf16, matmul_rows,
};
use tessera_kernels::desc::Gemm;

float_kernel!(writes_all MatMul { g: Gemm } |s, i, o| gemm(&s.g, i[0], i[1], o[0]); cuda |s, c| c.gemm(&s.g);
half |s, dtype, dtypes| native_bf16(dtype, dtypes) => |i, o| {
    let (a, b) = (i[0].as_bf16().expect("bf16"), i[1].as_bf16().expect("bf16"));
    gemm_bf16(&s.g, a, b, o[0].as_bf16().expect("bf16 output"))
});
float_kernel!(writes_all MatMulBias { g: Gemm } |s, i, o| gemm_bias(&s.g, i[0], i[1], i[2], o[0]); cuda |s, c| {
    // The product, rounded to the output dtype, then the bias added in
    // place: the same rounding as the CPU's fused pass.
    c.gemm(&s.g)?;
    let (n, cols) = (c.output_len(0), c.input_len(2));
    // SAFETY: the kernel updates output 0's `n` elements in place and reads the bias at
    // `i % cols`, below its length `cols`.
    unsafe { c.launch("elementwise", "add_bias", Grid::Items(n), &[Arg::Output(0), Arg::Input(2), Arg::Output(0), Arg::U64(n), Arg::U64(cols)]) }
};
    half |s, dtype, dtypes| native_bf16(dtype, dtypes) => |i, o| {
        let (a, b, bias) = (i[0].as_bf16().expect("bf16"), i[1].as_bf16().expect("bf16"), i[2].as_bf16().expect("bf16"));
        gemm_bias_bf16(&s.g, a, b, bias, o[0].as_bf16().expect("bf16 output"))
    });

/// Whether a product of operands of `dtypes` (primary `dtype`) runs on the
/// CPU's bf16 dot-product instruction: all bf16, on a CPU that has it. The
/// product then reads the bf16 operands directly, accumulates in f32 and
/// rounds once (its partial sums flush denormals to zero, see
/// [`tessera_kernels::cpu::matmul::matmul_bf16`]); otherwise the operands are
/// widened to f32 as for every other op.
fn native_bf16(dtype: DType, dtypes: &[DType]) -> bool {
    dtype == DType::BF16 && dtypes.iter().all(|&d| d == DType::BF16) && bf16_native()
}

/// A matrix operand: a contiguous tensor, and whether its last two dimensions
/// are stored transposed (so `x.t()` costs no copy).
fn operand(x: &Tensor) -> Result<(Tensor, bool)> {
    if x.is_contiguous() {
        return Ok((x.clone(), false));
    }
    let back = x.t()?;
    if back.is_contiguous() {
        return Ok((back, true));
    }
    Ok((x.contiguous()?, false))
}

/// `a · b` over the last two dimensions: `[..., m, k] · [..., k, n] -> [..., m, n]`.
///
/// Leading (batch) dimensions must be equal, or `b` may be a single `[k, n]`
/// matrix shared by every batch (a linear layer's weight). Operands that are
/// transposed views (`w.t()`) are read in place.
pub fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    product("matmul", a, b, None)
}

/// `a · b + bias`, with `bias` (one dimension, `n`) added to every row: a
/// linear layer's forward. Same shapes as [`matmul`]; the sum rounds as
/// [`matmul`] followed by [`add_bias`](super::add_bias) does, in one pass over
/// the output. Its backward is [`matmul_backward`] and
/// [`bias_grad`](super::bias_grad).
pub fn matmul_bias(a: &Tensor, b: &Tensor, bias: &Tensor) -> Result<Tensor> {
    product("matmul_bias", a, b, Some(bias))
}

fn product(op: &'static str, a: &Tensor, b: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    check_device(op, a, b)?;
    if a.rank() < 2 || b.rank() < 2 {
        return Err(Error::shape(op, format!("operands need at least two dimensions, got {} and {}", a.shape(), b.shape())));
    }
    let (ad, bd) = (a.dims(), b.dims());
    let (m, k) = (ad[ad.len() - 2], ad[ad.len() - 1]);
    let (k2, n) = (bd[bd.len() - 2], bd[bd.len() - 1]);
    if k != k2 {
        return Err(Error::shape(op, format!("inner dimensions differ: {} · {} ({k} vs {k2})", a.shape(), b.shape())));
    }
    let a_batch = &ad[..ad.len() - 2];
    let b_batch = &bd[..bd.len() - 2];
    if !b_batch.is_empty() && a_batch != b_batch {
        return Err(Error::shape(
            op,
            format!("batch dimensions differ: {} · {}; make them equal, or pass a single [k, n] right operand", a.shape(), b.shape()),
        ));
    }
    if let Some(bias) = bias {
        check_device(op, a, bias)?;
        if bias.dims() != [n] {
            return Err(Error::shape(op, format!("bias has shape {} but the product has {n} columns; the bias must be [{n}]", bias.shape())));
        }
    }
    let batch: usize = a_batch.iter().product();
    super::flops::add(2.0 * (batch * m * k * n) as f64);
    let mut out_dims = a_batch.to_vec();
    out_dims.extend([m, n]);
    let (a_op, trans_a) = operand(a)?;
    let (b_op, trans_b) = operand(b)?;
    let broadcast_b = b_batch.is_empty();
    let g = if broadcast_b && !trans_a {
        // All rows of a contiguous left operand form one tall matrix: one big GEMM.
        Gemm { trans_b, ..Gemm::new(1, batch * m, k, n) }
    } else {
        Gemm { trans_a, trans_b, batch_stride_b: if broadcast_b { 0 } else { k * n }, ..Gemm::new(batch, m, k, n) }
    };
    match bias {
        None => run1(op, &MatMul { g }, &[&a_op, &b_op], Shape::new(out_dims), Out::Primary),
        Some(bias) => run1(op, &MatMulBias { g }, &[&a_op, &b_op, bias], Shape::new(out_dims), Out::Primary),
    }
}

/// Backward of [`matmul`]: `(da, db) = (dc · bᵀ, aᵀ · dc)`, with `db` summed
/// over the batch when `b` was shared by every batch.
pub fn matmul_backward(a: &Tensor, b: &Tensor, dc: &Tensor) -> Result<(Tensor, Tensor)> {
    let da = matmul(dc, &b.t()?)?;
    let db = if b.rank() == 2 && a.rank() > 2 {
        let k = a.dims()[a.rank() - 1];
        let n = dc.dims()[dc.rank() - 1];
        let rows = a.elem_count() / k.max(1);
        matmul(&a.reshape([rows, k])?.t()?, &dc.reshape([rows, n])?)?
    } else {
        matmul(&a.t()?, dc)?
    };
    Ok((da, db))
}

float_kernel!(writes_all MatRows { m: usize, k: usize, n: usize } |s, i, o| matmul_rows(s.m, s.k, s.n, i[0], i[1], i.get(2).copied(), o[0]));

/// `x · wᵀ (+ bias)` for a linear layer's weight `w` `[n, k]` and `x`
/// `[..., k]`, computed so that every row of the result depends on its row
/// of `x` alone: the same bits whether the row is multiplied alone or among
/// any number of others (see [`tessera_kernels::cpu::matmul::matmul_rows`]).
/// Serving uses it so a request decodes the same tokens alone or in a
/// batch; with few rows it is also the faster product (it streams `w` once).
///
/// On the CPU in f32 and f64 (bf16 and f16 operands are widened to f32 and
/// the result rounded back). On a GPU it is the ordinary product, which
/// cuBLAS does not make batch-invariant.
pub fn matmul_rows_nt(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    const OP: &str = "matmul_rows_nt";
    check_device(OP, x, w)?;
    let (Some(&k), &[n, wk]) = (x.dims().last(), w.dims()) else {
        return Err(Error::shape(OP, format!("operands {} and {}; pass x [..., k] and a weight [n, k]", x.shape(), w.shape())));
    };
    if k != wk || x.rank() < 2 {
        return Err(Error::shape(OP, format!("x {} against a weight {}: x needs rank 2 or more and last dimension {wk}", x.shape(), w.shape())));
    }
    if let Some(b) = bias {
        check_device(OP, x, b)?;
        if b.dims() != [n] {
            return Err(Error::shape(OP, format!("bias has shape {} but the weight has {n} rows; the bias must be [{n}]", b.shape())));
        }
    }
    if matches!(x.device(), crate::Device::Cuda(_)) {
        let wt = w.t()?;
        return match bias {
            Some(b) => matmul_bias(x, &wt, b),
            None => matmul(x, &wt),
        };
    }
    let m = x.elem_count() / k.max(1);
    super::flops::add(2.0 * (m * k * n) as f64);
    let mut dims = x.dims().to_vec();
    *dims.last_mut().expect("rank 2 or more") = n;
    let mut inputs = vec![x, w];
    inputs.extend(bias);
    run1(OP, &MatRows { m, k, n }, &inputs, Shape::from(dims), Out::Primary)
}
