//! Top-k on the device: the values and their u32 indices in two new
//! storages, and the scatter of the gradient, launched straight from the
//! storages (the op has two outputs of different dtypes, which the float-op
//! path does not describe).

use super::args::Grid;
use super::call::suffix;
use super::launch::Value;
use super::storage::CudaStorage;
use crate::error::{Error, Result};
use crate::tensor::DType;
use std::ops::Range;

impl CudaStorage {
    /// The `k` best entries of each row of length `row` of the elements
    /// `range`: the values (this storage's dtype) and their indices (u32),
    /// `rows * k` each, in the CPU's order. The caller checks `1 <= k <= row`
    /// and `row <= u32::MAX`.
    pub(crate) fn topk(&self, range: Range<usize>, row: usize, k: usize) -> Result<(CudaStorage, CudaStorage)> {
        let sfx = suffix(self.dtype()).ok_or(Error::NotImplementedOnCuda { op: "topk" })?;
        let device = self.device();
        let rows = range.len() / row;
        let values = CudaStorage::uninit(device, self.dtype(), rows * k)?;
        let indices = CudaStorage::uninit(device, DType::U32, rows * k)?;
        let args = [
            Value::U64(self.device_ptr_at(range.start)),
            Value::U64(values.device_ptr_at(0)),
            Value::U64(indices.device_ptr_at(0)),
            Value::U64(rows as u64),
            Value::U64(row as u64),
            Value::U64(k as u64),
        ];
        // SAFETY: the input covers `rows * row` elements of `range` (the
        // caller's range, `rows` whole rows), the outputs were just made with
        // `rows * k` elements each, of the input's dtype and u32.
        unsafe { device.launch("topk", &format!("topk_{sfx}"), Grid::Rows { rows, cols: row }, &args)? };
        Ok((values, indices))
    }

    /// The gradient of [`topk`](Self::topk)'s input: `rows` rows of length
    /// `row`, zero except `dvalues[r, j]` (this storage's elements `range`,
    /// `rows * k`) added at column `indices[r, j]` (u32, the given elements
    /// of the indices' storage). The caller checks the shapes, and the
    /// indices against `row` (the kernel skips one out of range rather than
    /// write there).
    pub(crate) fn topk_backward(&self, range: Range<usize>, indices: (&CudaStorage, Range<usize>), rows: usize, row: usize, k: usize) -> Result<CudaStorage> {
        const OP: &str = "topk_backward";
        let sfx = suffix(self.dtype()).ok_or(Error::NotImplementedOnCuda { op: OP })?;
        let (indices, indices_range) = indices;
        if indices.dtype() != DType::U32 || indices_range.len() != rows * k || range.len() != rows * k {
            return Err(Error::shape(
                OP,
                format!("{rows} rows of {k} value gradients and u32 indices expected, got {} and {} of {}", range.len(), indices_range.len(), indices.dtype()),
            ));
        }
        let device = self.device();
        let dx = CudaStorage::zeros(device, self.dtype(), rows * row)?;
        let args = [
            Value::U64(indices.device_ptr_at(indices_range.start)),
            Value::U64(self.device_ptr_at(range.start)),
            Value::U64(dx.device_ptr_at(0)),
            Value::U64(rows as u64),
            Value::U64(row as u64),
            Value::U64(k as u64),
        ];
        // SAFETY: the index and gradient ranges hold `rows * k` elements
        // (checked above), `dx` was just made with `rows * row`, and the
        // kernel skips an index at or past `row` rather than write there.
        unsafe { device.launch("topk", &format!("topk_backward_{sfx}"), Grid::Items(rows * k), &args)? };
        Ok(dx)
    }
}
