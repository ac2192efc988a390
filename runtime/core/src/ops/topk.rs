//! The k largest entries of each row (MoE routing, sampling).

use super::{float_kernel, run1, with_u32};
use crate::backend::kernel::Out;
use crate::backend::{CpuStorage, CudaStorage, Device, Storage};
use crate::error::{Error, Result};
use crate::tensor::{check_device, check_float};
use crate::tensor::{Shape, Tensor};
use std::cell::RefCell;
use std::ops::Range;
use tessera_kernels::cpu::topk as k;

float_kernel!(TopK<'a> { row: usize, k: usize, indices: RefCell<&'a mut [u32]> } |s, i, o| {
    k::topk(i[0], s.row, s.k, o[0], &mut s.indices.borrow_mut())
});
float_kernel!(TopKBack<'a> { indices: &'a [u32], row: usize, k: usize } |s, i, o| {
    k::topk_backward(s.indices, i[0], s.row, s.k, o[0])
});

/// The `k` largest values of each row (last dimension) in descending order,
/// ties broken by the lower index, and their `u32` indices: `([.., k], [.., k])`.
///
/// NaN ranks below every number. On a GPU both results stay on the device
/// and equal the CPU's bit for bit.
pub fn topk(x: &Tensor, k: usize) -> Result<(Tensor, Tensor)> {
    const OP: &str = "topk";
    check_float(OP, x)?;
    let row = x.shape().last_dim(OP)?;
    if k == 0 || k > row {
        return Err(Error::invalid(OP, format!("k must be in 1..={row} (the row length), got {k}")));
    }
    if row > u32::MAX as usize {
        return Err(Error::unsupported(OP, format!("rows of {row} elements exceed the u32 indices; split the rows")));
    }
    let out_shape = x.shape().with_last(k);
    let dev = match x.device() {
        Device::Cpu(dev) => dev,
        Device::Cuda(_) => {
            let (values, indices) = with_cuda(OP, x, |s, range| s.topk(range, row, k))?;
            let on_device = |s| Tensor::from_storage(Storage::Cuda(s), out_shape.clone(), x.device().clone());
            return Ok((on_device(values), on_device(indices)));
        }
    };
    let mut idx = dev.buffer_zeros::<u32>(out_shape.elem_count());
    let values = run1(OP, &TopK { row, k, indices: RefCell::new(&mut idx) }, &[x], out_shape.clone(), Out::Primary)?;
    Ok((values, Tensor::from_cpu(CpuStorage::U32(idx), out_shape, dev)))
}

/// Backward of [`topk`]: the upstream gradient of the values scattered back to
/// their positions in a zero tensor with rows of length `row`.
///
/// Every index is checked on the host first (a bad one is an error naming
/// it, not a fault), so indices on a GPU are copied back once for the check;
/// the kernel then reads them where they are, with no second upload.
pub fn topk_backward(indices: &Tensor, dvalues: &Tensor, row: usize) -> Result<Tensor> {
    const OP: &str = "topk_backward";
    if indices.shape() != dvalues.shape() {
        return Err(Error::shape(OP, format!("indices {} and value gradients {} must have the same shape", indices.shape(), dvalues.shape())));
    }
    let k = indices.shape().last_dim(OP)?;
    let shape: Shape = dvalues.shape().with_last(row);
    with_u32(OP, "indices", indices, |idx| {
        if let Some(position) = idx.iter().position(|&i| i as usize >= row) {
            return Err(Error::IndexOutOfRange { op: OP, index: idx[position] as u64, position, bound: row as u64, hint: "" });
        }
        if let Device::Cuda(_) = dvalues.device() {
            check_float(OP, dvalues)?;
            check_device(OP, dvalues, indices)?;
            let rows = shape.elem_count().checked_div(row).unwrap_or(0);
            let dx = with_cuda(OP, dvalues, |dv, range| with_cuda(OP, indices, |ix, ix_range| dv.topk_backward(range, (ix, ix_range), rows, row, k)))?;
            return Ok(Tensor::from_storage(Storage::Cuda(dx), shape, dvalues.device().clone()));
        }
        run1(OP, &TopKBack { indices: idx, row, k }, &[dvalues], shape, Out::Primary)
    })
}

/// Runs `f` on the device storage of `t` (made contiguous) and the range of
/// its elements.
fn with_cuda<R>(op: &'static str, t: &Tensor, f: impl FnOnce(&CudaStorage, Range<usize>) -> Result<R>) -> Result<R> {
    let t = t.contiguous()?;
    let range = t.layout().contiguous_range().expect("contiguous");
    let g = t.read();
    match &*g {
        Storage::Cuda(s) => f(s, range),
        Storage::Cpu(_) => Err(Error::DeviceMismatch { op, lhs: t.device().to_string(), rhs: "cpu".into() }),
    }
}
