//! The CUDA device and storage in a build without the CUDA backend.
//!
//! Both types are uninhabited: no value of them can exist, so every code path
//! that dispatches on a device or storage handles CUDA without any `#[cfg]`,
//! and asking for a CUDA device is the one place that reports the missing
//! backend.

use crate::backend::kernel::Out;
use crate::backend::memory::MemoryStats;
use crate::backend::BackendDevice;
use crate::error::{Error, Result};
use crate::tensor::DType;

/// A CUDA device (none can exist in this build).
#[derive(Clone, Debug)]
pub enum CudaDevice {}

/// The elements of a tensor on a CUDA device (none can exist in this build).
pub enum CudaStorage {}

/// An op running on a CUDA device (none can in this build).
pub enum CudaCall {}

impl CudaCall {
    pub(crate) fn unsupported<T>(&self) -> Result<T> {
        match *self {}
    }

    pub(crate) fn dtype_suffix(&self) -> &'static str {
        match *self {}
    }

    pub(crate) fn sm(&self) -> u32 {
        match *self {}
    }

    pub(crate) fn output_len(&self, _: usize) -> usize {
        match *self {}
    }

    pub(crate) fn input_len(&self, _: usize) -> usize {
        match *self {}
    }

    pub(crate) fn at_least(&self, _: super::args::Arg, _: usize) -> Result<()> {
        match *self {}
    }

    pub(crate) fn scratch_f32(&mut self, _: usize) -> Result<usize> {
        match *self {}
    }

    pub(crate) fn upload_u32(&mut self, _: &[u32]) -> Result<usize> {
        match *self {}
    }

    pub(crate) fn upload_f32(&mut self, _: &[f32]) -> Result<usize> {
        match *self {}
    }

    /// # Safety
    ///
    /// As the CUDA build's (never reached here: this call cannot exist).
    pub(crate) unsafe fn launch(&mut self, _: &'static str, _: &str, _: super::args::Grid, _: &[super::args::Arg]) -> Result<()> {
        match *self {}
    }

    pub(crate) fn gemm(&mut self, _: &tessera_kernels::desc::Gemm) -> Result<()> {
        match *self {}
    }
}

/// Runs an op on a CUDA device (none can exist in this build).
pub(crate) fn run_op(
    _: &'static str,
    device: &CudaDevice,
    _: DType,
    _: &[(&CudaStorage, std::ops::Range<usize>)],
    _: &[(usize, Out)],
    _: bool,
    _: impl FnOnce(&mut CudaCall) -> Result<()>,
) -> Result<Vec<CudaStorage>> {
    match *device {}
}

/// The AdamW step on a CUDA device (none can exist in this build).
pub(crate) mod adamw {
    pub(crate) use super::super::AdamWSlot;
    use super::CudaDevice;
    use crate::error::Result;

    pub(crate) fn adamw_f32(device: &CudaDevice, _: &[AdamWSlot]) -> Result<()> {
        match *device {}
    }
}

impl CudaDevice {
    /// Opens CUDA device `ordinal`: always [`Error::NotCompiledWithCuda`] here.
    pub fn new(ordinal: usize) -> Result<Self> {
        let _ = ordinal;
        Err(Error::NotCompiledWithCuda)
    }

    /// The device's CUDA ordinal.
    pub fn ordinal(&self) -> usize {
        match *self {}
    }

    /// Whether both handles name the same device.
    pub fn same(&self, _: &CudaDevice) -> bool {
        match *self {}
    }

    /// The device's memory: (bytes free now, bytes in all).
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        match *self {}
    }

    /// Frees the allocator's cached blocks.
    pub fn empty_cache(&self) {
        match *self {}
    }

    /// The error of an operation the CUDA backend does not have yet.
    pub fn unsupported<T>(&self, _: &'static str) -> Result<T> {
        match *self {}
    }

    /// What this device has been asked to do since it was opened.
    pub fn work(&self) -> super::DeviceWork {
        match *self {}
    }

    /// Whether the GPU multiplies FP8 on its tensor cores.
    pub fn has_fp8_tensor_cores(&self) -> bool {
        match *self {}
    }

    pub(crate) fn fp8_gemm_fits(
        &self,
        _: (usize, usize, usize),
        _: tessera_kernels::cpu::fp8::Fp8Format,
        _: tessera_kernels::cpu::fp8::Fp8Format,
        _: DType,
    ) -> bool {
        match *self {}
    }

    pub(crate) fn fp8_gemm(
        &self,
        _: (&CudaStorage, std::ops::Range<usize>, tessera_kernels::cpu::fp8::Fp8Format),
        _: (&CudaStorage, std::ops::Range<usize>, tessera_kernels::cpu::fp8::Fp8Format),
        _: (usize, usize, usize),
        _: f32,
        _: DType,
    ) -> Result<CudaStorage> {
        match *self {}
    }

    pub(crate) fn upload(&self, _: DType, _: usize, _: &[u8]) -> Result<CudaStorage> {
        match *self {}
    }
}

impl CudaStorage {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match *self {}
    }

    pub(crate) fn device_ptr_at(&self, _: usize) -> u64 {
        match *self {}
    }

    pub(crate) fn concat(device: &CudaDevice, _: DType, _: &[(&CudaStorage, std::ops::Range<usize>)]) -> Result<CudaStorage> {
        match *device {}
    }

    pub(crate) fn unsupported<T>(&self, _: &'static str) -> Result<T> {
        match *self {}
    }

    pub(crate) fn to_host_bytes(&self) -> Result<Vec<u8>> {
        match *self {}
    }

    pub(crate) fn to_dtype(&self, _: std::ops::Range<usize>, _: DType) -> Result<CudaStorage> {
        match *self {}
    }

    pub(crate) fn gather(&self, _: &crate::tensor::Layout) -> Result<CudaStorage> {
        match *self {}
    }

    pub(crate) fn axpy(&self, _: usize, _: f64, _: &CudaStorage, _: usize, _: usize) -> Result<()> {
        match *self {}
    }

    pub(crate) fn topk(&self, _: std::ops::Range<usize>, _: usize, _: usize) -> Result<(CudaStorage, CudaStorage)> {
        match *self {}
    }

    pub(crate) fn quant_matmul(
        &self,
        _: std::ops::Range<usize>,
        _: (&CudaStorage, std::ops::Range<usize>),
        _: (&CudaStorage, std::ops::Range<usize>),
        _: Option<(&CudaStorage, std::ops::Range<usize>)>,
        _: tessera_kernels::desc::QuantFormat,
        _: (usize, usize, usize),
    ) -> Result<CudaStorage> {
        match *self {}
    }

    pub(crate) fn topk_backward(
        &self,
        _: std::ops::Range<usize>,
        _: (&CudaStorage, std::ops::Range<usize>),
        _: usize,
        _: usize,
        _: usize,
    ) -> Result<CudaStorage> {
        match *self {}
    }
}

impl BackendDevice for CudaDevice {
    type Storage = CudaStorage;

    fn zeros(&self, _: DType, _: usize) -> Result<CudaStorage> {
        match *self {}
    }

    fn memory_stats(&self) -> MemoryStats {
        match *self {}
    }

    fn reset_peak(&self) {
        match *self {}
    }

    fn synchronize(&self) -> Result<()> {
        match *self {}
    }
}
