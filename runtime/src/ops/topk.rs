//! The k largest entries of each row (MoE routing, sampling).

use super::{check_float, float_kernel, run1, with_u32};
use crate::backend::cpu::Out;
use crate::backend::{CpuStorage, Device};
use crate::error::{Error, Result};
use crate::tensor::{Shape, Tensor};
use std::cell::RefCell;
use tessera_kernels::cpu::topk as k;

float_kernel!(TopK<'a> { row: usize, k: usize, indices: RefCell<&'a mut [u32]> } |s, i, o| {
    k::topk(i[0], s.row, s.k, o[0], &mut s.indices.borrow_mut())
});
float_kernel!(TopKBack<'a> { indices: &'a [u32], row: usize, k: usize } |s, i, o| {
    k::topk_backward(s.indices, i[0], s.row, s.k, o[0])
});

/// The `k` largest values of each row (last dimension) in descending order,
/// ties broken by the lower index, and their `u32` indices: `([.., k], [.., k])`.
pub fn topk(x: &Tensor, k: usize) -> Result<(Tensor, Tensor)> {
    const OP: &str = "topk";
    check_float(OP, x)?;
    let row = x.shape().last_dim(OP)?;
    if k == 0 || k > row {
        return Err(Error::invalid(OP, format!("k must be in 1..={row} (the row length), got {k}")));
    }
    let out_shape = x.shape().with_last(k);
    let dev = match x.device() {
        Device::Cpu(dev) => dev,
        Device::Cuda(d) => return d.unsupported(OP),
    };
    let mut idx = dev.buffer_zeros::<u32>(out_shape.elem_count());
    let values = run1(OP, &TopK { row, k, indices: RefCell::new(&mut idx) }, &[x], out_shape.clone(), Out::Primary)?;
    Ok((values, Tensor::from_cpu(CpuStorage::U32(idx), out_shape, dev)))
}

/// Backward of [`topk`]: the upstream gradient of the values scattered back to
/// their positions in a zero tensor with rows of length `row`.
pub fn topk_backward(indices: &Tensor, dvalues: &Tensor, row: usize) -> Result<Tensor> {
    const OP: &str = "topk_backward";
    if indices.shape() != dvalues.shape() {
        return Err(Error::shape(OP, format!("indices {} and value gradients {} must have the same shape", indices.shape(), dvalues.shape())));
    }
    let k = indices.shape().last_dim(OP)?;
    with_u32(OP, "indices", indices, |idx| {
        if let Some(position) = idx.iter().position(|&i| i as usize >= row) {
            return Err(Error::IndexOutOfRange { op: OP, index: idx[position] as u64, position, bound: row as u64, hint: "" });
        }
        let shape: Shape = dvalues.shape().with_last(row);
        run1(OP, &TopKBack { indices: idx, row, k }, &[dvalues], shape, Out::Primary)
    })
}
