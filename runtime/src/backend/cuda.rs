//! The CUDA device and storage in a build without the CUDA backend.
//!
//! Both types are uninhabited: no value of them can exist, so every code path
//! that dispatches on a device or storage handles CUDA without any `#[cfg]`,
//! and asking for a CUDA device is the one place that reports the missing
//! backend.

use crate::backend::memory::MemoryStats;
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

    pub fn ordinal(&self) -> usize {
        match *self {}
    }

    pub fn memory_stats(&self) -> MemoryStats {
        match *self {}
    }

    pub fn reset_peak(&self) {
        match *self {}
    }

    pub fn synchronize(&self) -> Result<()> {
        match *self {}
    }
}
