//! Row gather and row scatter-add on `[rows, dim]` tensors, built on the
//! embedding lookup (a row gather) and its backward (a row scatter-add), so
//! they run wherever those ops run. The index lists are host data.

use tessera_core::ops;
use tessera_core::tensor::Tensor;
use tessera_core::{Error, Result};

fn index_tensor(idx: &[u32], like: &Tensor) -> Result<Tensor> {
    Tensor::from_vec(idx.to_vec(), [idx.len()], like.device())
}

fn check_rows(op: &'static str, rows: usize) -> Result<()> {
    if rows > u32::MAX as usize {
        return Err(Error::shape(op, format!("{rows} rows cannot be indexed with u32; split the batch")));
    }
    Ok(())
}

/// `out[i] = src[idx[i]]`: `[n, d]` → `[idx.len(), d]`.
pub(super) fn gather(src: &Tensor, idx: &[u32]) -> Result<Tensor> {
    let n = src.dims()[0];
    check_rows("gather_rows", n)?;
    ops::embedding(src, &index_tensor(idx, src)?)
}

/// `out[idx[i]] += src[i]` into zeros of `[rows, d]`.
pub(super) fn scatter_add(src: &Tensor, idx: &[u32], rows: usize) -> Result<Tensor> {
    check_rows("scatter_rows", rows)?;
    ops::embedding_backward(&index_tensor(idx, src)?, src, rows, 0, rows)
}
