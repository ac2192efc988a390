//! Updates in place on the device: gradient accumulation.

use super::args::Grid;
use super::launch::Value;
use super::storage::CudaStorage;
use crate::error::{Error, Result};
use crate::tensor::DType;

impl CudaStorage {
    /// `y[y_at..y_at + n] += alpha * x[x_at..x_at + n]`, with `y` this f32
    /// storage and `x` an f32 storage that does not overlap it; both ranges
    /// must lie within their storages (every caller takes them from tensors'
    /// layouts of `n` elements).
    pub(crate) fn axpy(&self, y_at: usize, alpha: f64, x: &CudaStorage, x_at: usize, n: usize) -> Result<()> {
        if self.dtype() != DType::F32 || x.dtype() != DType::F32 {
            return Err(Error::NotImplementedOnCuda { op: "axpy (f32 accumulators only)" });
        }
        let values = [Value::U64(x.device_ptr_at(x_at)), Value::F32(alpha as f32), Value::U64(self.device_ptr_at(y_at)), Value::U64(n as u64)];
        // SAFETY: both storages are f32 on this device (checked above); the
        // caller guarantees `x_at + n` and `y_at + n` are within them.
        unsafe { self.device().launch("elementwise", "axpy_f32", Grid::Items(n), &values) }
    }
}
