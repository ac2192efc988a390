//! The CUDA device and storage in a build without the CUDA backend.
//!
//! Both types are uninhabited: no value of them can exist, so every code path
//! that dispatches on a device or storage handles CUDA without any `#[cfg]`,
//! and asking for a CUDA device is the one place that reports the missing
//! backend.

use crate::backend::memory::MemoryStats;
use crate::backend::BackendDevice;
use crate::tensor::DType;
use crate::error::{Error, Result};

/// A CUDA device (none can exist in this build).
#[derive(Clone, Debug)]
pub enum CudaDevice {}

/// The elements of a tensor on a CUDA device (none can exist in this build).
pub enum CudaStorage {}

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

    /// Frees the allocator's cached blocks.
    pub fn empty_cache(&self) {
        match *self {}
    }

    pub(crate) fn unsupported<T>(&self, _: &'static str) -> Result<T> {
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

    pub(crate) fn unsupported<T>(&self, _: &'static str) -> Result<T> {
        match *self {}
    }

    pub(crate) fn to_host_bytes(&self) -> Result<Vec<u8>> {
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
