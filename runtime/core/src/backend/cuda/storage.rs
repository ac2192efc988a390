//! A tensor's elements on a CUDA device: one block of the device's caching
//! allocator, its dtype and length. Dropping the storage gives the block
//! back to the allocator.

use super::device::CudaDevice;
use crate::error::{Error, Result};
use crate::tensor::DType;
use cudarc::driver::{CudaSlice, DevicePtr};

/// The elements of a tensor on a CUDA device.
pub struct CudaStorage {
    // `None` only while being dropped.
    block: Option<CudaSlice<u8>>,
    class: usize,
    dtype: DType,
    len: usize,
    device: CudaDevice,
}

impl CudaStorage {
    /// `len` elements of `dtype` whose bytes are not yet written.
    pub fn uninit(device: &CudaDevice, dtype: DType, len: usize) -> Result<Self> {
        let bytes = len
            .checked_mul(dtype.size_in_bytes())
            .ok_or_else(|| Error::unsupported("cuda alloc", format!("{len} elements of {dtype} overflow the address space")))?;
        let (block, class) = device.allocate(bytes)?;
        Ok(CudaStorage { block: Some(block), class, dtype, len, device: device.clone() })
    }

    /// `len` zeros of `dtype`.
    pub(crate) fn zeros(device: &CudaDevice, dtype: DType, len: usize) -> Result<Self> {
        let mut s = Self::uninit(device, dtype, len)?;
        let bytes = s.bytes();
        let stream = device.compute_stream().clone();
        stream.memset_zeros(&mut s.block_mut().slice_mut(..bytes)).map_err(|e| device.error("zeroing device memory", e))?;
        Ok(s)
    }

    /// A copy of host bytes holding `len` elements of `dtype` (their native layout).
    pub(crate) fn from_host_bytes(device: &CudaDevice, dtype: DType, len: usize, data: &[u8]) -> Result<Self> {
        let mut s = Self::uninit(device, dtype, len)?;
        if data.len() != s.bytes() {
            return Err(Error::shape("cuda copy", format!("{} bytes given for {len} elements of {dtype}", data.len())));
        }
        let stream = device.compute_stream().clone();
        let bytes = s.bytes();
        stream.memcpy_htod(data, &mut s.block_mut().slice_mut(..bytes)).map_err(|e| device.error("copying to the device", e))?;
        device.counters().upload();
        Ok(s)
    }

    /// The elements' bytes copied to the host, after the work queued on them.
    pub(crate) fn to_host_bytes(&self) -> Result<Vec<u8>> {
        let mut out = vec![0u8; self.bytes()];
        let block = self.block.as_ref().expect("a live storage holds its block");
        self.device.compute_stream().memcpy_dtoh(&block.slice(..self.bytes()), &mut out).map_err(|e| self.device.error("copying to the host", e))?;
        self.device.counters().host_read();
        Ok(out)
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the storage holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device holding the elements.
    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    /// The device address of element `index`, for a kernel argument.
    ///
    /// Every kernel, copy and allocation of a device is queued on its compute
    /// stream, whose order is what orders the kernel after earlier writes;
    /// the communication stream is ordered against it by the device's own
    /// events (see `CudaDevice::comm_waits_for_compute`).
    pub fn device_ptr_at(&self, index: usize) -> u64 {
        let block = self.block.as_ref().expect("a live storage holds its block");
        // cudarc's event tracking is off for Tessera's contexts (see
        // `CudaDevice::new`): the guard records nothing, so dropping it
        // before the pointer is used loses no ordering.
        let (ptr, _untracked) = block.device_ptr(self.device.compute_stream());
        ptr + (index * self.dtype.size_in_bytes()) as u64
    }

    fn bytes(&self) -> usize {
        self.len * self.dtype.size_in_bytes()
    }

    fn block_mut(&mut self) -> &mut CudaSlice<u8> {
        self.block.as_mut().expect("a live storage holds its block")
    }

    /// The error of an operation the CUDA backend does not have yet.
    pub(crate) fn unsupported<T>(&self, op: &'static str) -> Result<T> {
        self.device.unsupported(op)
    }
}

impl Drop for CudaStorage {
    fn drop(&mut self) {
        if let Some(block) = self.block.take() {
            self.device.release(block, self.class);
        }
    }
}
