//! Moving elements on the device: dtype conversion and the gather that
//! makes a strided view contiguous.

use super::args::Grid;
use super::device::CudaDevice;
use super::launch::Value;
use super::storage::CudaStorage;
use crate::error::{Error, Result};
use crate::tensor::{DType, Layout};
use std::ops::Range;

impl CudaStorage {
    /// The elements `range` converted to `dtype`, in a new storage.
    ///
    /// Any dtype converts to any other with the CPU backend's rules, bit for
    /// bit (`kernels/cuda/convert.cu`); a dtype copies to itself.
    pub(crate) fn to_dtype(&self, range: Range<usize>, dtype: DType) -> Result<CudaStorage> {
        let device = self.device();
        let n = range.len();
        if self.dtype() == dtype {
            // A copy moves bits: the strided copy of a contiguous layout.
            let layout = Layout::contiguous_at([n].into(), range.start);
            return self.gather(&layout);
        }
        let out = CudaStorage::uninit(device, dtype, n)?;
        if n > 0 {
            let values = [Value::U64(self.device_ptr_at(range.start)), Value::U64(out.device_ptr_at(0)), Value::U64(n as u64)];
            // `convert.cu` names its casts by the dtypes' names.
            let kernel = format!("cast_{}_to_{}", self.dtype().name(), dtype.name());
            // SAFETY: the source holds the `n` elements of `range` in its dtype,
            // the output was just made with `n` elements of `dtype`, and
            // `cast_{from}_to_{to}` reads and writes exactly those types.
            unsafe { device.launch("convert", &kernel, Grid::Items(n), &values)? };
        }
        Ok(out)
    }

    /// The elements of the view `layout` of this storage, contiguous and in
    /// row-major order, in a new storage.
    pub(crate) fn gather(&self, layout: &Layout) -> Result<CudaStorage> {
        let device = self.device();
        let n = layout.shape().elem_count();
        let width = match self.dtype().size_in_bytes() {
            2 => "b16",
            4 => "b32",
            8 => "b64",
            _ => return Err(Error::NotImplementedOnCuda { op: "contiguous (strided copy) of this dtype" }),
        };
        let out = CudaStorage::uninit(device, self.dtype(), n)?;
        if n == 0 {
            return Ok(out);
        }
        // The dimensions then the strides, as the kernel reads them.
        let mut shape: Vec<u64> = layout.shape().dims().iter().chain(layout.strides()).map(|&d| d as u64).collect();
        let rank = layout.shape().dims().len();
        if shape.is_empty() {
            shape.push(0); // a scalar: nothing to index, but no empty allocation either
        }
        let stream = device.compute_stream();
        let table = stream.clone_htod(&shape).map_err(|e| device.error("copying a view's shape to the device", e))?;
        device.counters().upload();
        // Event tracking is off (see `CudaDevice::new`): the guard records nothing.
        let (table_ptr, _untracked) = cudarc::driver::DevicePtr::device_ptr(&table, stream);
        let values = [
            Value::U64(self.device_ptr_at(0)),
            Value::U64(out.device_ptr_at(0)),
            Value::U64(n as u64),
            Value::U64(table_ptr),
            Value::U32(rank as u32),
            Value::U64(layout.offset() as u64),
        ];
        // SAFETY: the output was just made with the view's `n` elements; the
        // table holds the view's `rank` dimensions then strides; every
        // element the view addresses lies in this storage (a layout is only
        // made within its storage). The table is freed in stream order,
        // after the kernel has read it.
        unsafe { device.launch("convert", &format!("strided_copy_{width}"), Grid::Items(n), &values)? };
        Ok(out)
    }
    /// The elements `parts` (each a storage of `dtype` and a range of it)
    /// one after another in a new storage: one device-to-device copy per
    /// part, queued on the compute stream.
    pub fn concat(device: &CudaDevice, dtype: DType, parts: &[(&CudaStorage, Range<usize>)]) -> Result<CudaStorage> {
        let width = dtype.size_in_bytes();
        let total = parts.iter().map(|(_, r)| r.len()).sum();
        let out = CudaStorage::uninit(device, dtype, total)?;
        let stream = device.compute_stream();
        stream.context().bind_to_thread().map_err(|e| device.error("making the device current before a copy", e))?;
        let mut at = 0;
        for (part, range) in parts {
            if part.dtype() != dtype || !part.device().same(device) || range.end > part.len() {
                return Err(Error::placement(
                    "concat_flat",
                    format!(
                        "a part of {} {} elements on cuda:{} does not fit a join of {dtype} on cuda:{}",
                        part.len(),
                        part.dtype(),
                        part.device().ordinal(),
                        device.ordinal()
                    ),
                ));
            }
            let bytes = range.len() * width;
            if bytes > 0 {
                // SAFETY: the source holds `range` (checked against its
                // length) and the destination `total` elements from `at`, of
                // `width` bytes each, on this device; both storages outlive
                // the copy, which is queued on the compute stream that orders
                // every use and reuse of their blocks.
                unsafe { cudarc::driver::result::memcpy_dtod_async(out.device_ptr_at(at), part.device_ptr_at(range.start), bytes, stream.cu_stream()) }
                    .map_err(|e| device.error("copying a part of a join", e))?;
            }
            at += range.len();
        }
        Ok(out)
    }
}
