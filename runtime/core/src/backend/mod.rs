//! Devices and storages: where tensors live and what computes on them.
//!
//! A [`Device`] is a CPU accounting domain or a CUDA GPU; a [`Storage`] holds a
//! tensor's elements on one. Both enums always have a CUDA variant: in a build
//! without the CUDA backend its types are uninhabited stand-ins, so dispatch
//! code never needs `#[cfg]` and a request for a GPU is answered with
//! [`Error::NotCompiledWithCuda`](crate::Error::NotCompiledWithCuda).
//!
//! Work on a device may be queued asynchronously; reading a tensor back to the
//! host ([`Tensor::to_vec`](crate::Tensor::to_vec)) waits for it.

pub mod cpu;
pub mod cuda;
pub(crate) mod kernel;
/// Memory accounting: the bytes each device holds and its peak.
pub mod memory;

pub use cpu::{CpuDevice, CpuStorage, HostArena, MIN_ARENA_BYTES};
pub use cuda::{CudaDevice, CudaStorage};
pub use memory::{MemoryStats, MemoryTracker};

use crate::error::Result;
use crate::tensor::DType;
use std::fmt;

/// What every backend's device provides to the tensor layer.
///
/// Work may be queued asynchronously (a CUDA device queues on its streams);
/// [`synchronize`](Self::synchronize) waits for it, and reading a tensor back
/// to the host synchronises implicitly. Ops reach a backend through the
/// kernels of `backend::cpu` (and, with the CUDA backend, their device
/// counterparts), dispatched on [`Storage`].
pub trait BackendDevice: Clone + fmt::Debug + Send + Sync {
    /// Where this device keeps a tensor's elements.
    type Storage;
    /// `len` zeros of `dtype`, counted by the device's memory accounting.
    fn zeros(&self, dtype: DType, len: usize) -> Result<Self::Storage>;
    /// Bytes in use and the peak since the last reset.
    fn memory_stats(&self) -> MemoryStats;
    /// Starts a new peak window at the bytes in use now.
    fn reset_peak(&self);
    /// Waits until all queued work has finished.
    fn synchronize(&self) -> Result<()>;
}

/// Where a tensor lives.
#[derive(Clone, Debug)]
pub enum Device {
    /// A CPU accounting domain.
    Cpu(CpuDevice),
    /// A CUDA GPU.
    Cuda(CudaDevice),
}

impl Device {
    /// A new CPU device with its own memory accounting.
    pub fn cpu() -> Self {
        Device::Cpu(CpuDevice::new())
    }

    /// CUDA device `ordinal`; an error when this build or machine has none.
    pub fn cuda(ordinal: usize) -> Result<Self> {
        CudaDevice::new(ordinal).map(Device::Cuda)
    }

    /// Bytes in use and the peak since the last [`reset_peak`](Self::reset_peak).
    pub fn memory_stats(&self) -> MemoryStats {
        match self {
            Device::Cpu(d) => BackendDevice::memory_stats(d),
            Device::Cuda(d) => d.memory_stats(),
        }
    }

    /// Bytes of memory a GPU has in all, as its driver reports them; `None`
    /// for the CPU, whose ranks share the host's memory with everything
    /// else on it.
    pub fn total_memory(&self) -> Result<Option<u64>> {
        match self {
            Device::Cpu(_) => Ok(None),
            Device::Cuda(d) => d.memory_info().map(|(_, total)| Some(total as u64)),
        }
    }

    /// Starts a new peak window at the bytes in use now.
    pub fn reset_peak(&self) {
        match self {
            Device::Cpu(d) => BackendDevice::reset_peak(d),
            Device::Cuda(d) => d.reset_peak(),
        }
    }

    /// Waits until all work queued on the device has finished.
    pub fn synchronize(&self) -> Result<()> {
        match self {
            Device::Cpu(d) => d.synchronize(),
            Device::Cuda(d) => d.synchronize(),
        }
    }

    /// Whether both handles name the same device.
    pub fn same(&self, other: &Device) -> bool {
        match (self, other) {
            (Device::Cpu(a), Device::Cpu(b)) => a.same(b),
            (Device::Cuda(a), Device::Cuda(b)) => a.same(b),
            _ => false,
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu(d) => write!(f, "cpu:{}", d.id()),
            Device::Cuda(d) => write!(f, "cuda:{}", d.ordinal()),
        }
    }
}

/// A tensor's elements on its device.
pub enum Storage {
    /// Elements in host memory.
    Cpu(CpuStorage),
    /// Elements in a CUDA GPU's memory.
    Cuda(CudaStorage),
}

impl Device {
    /// `len` zeros of `dtype` on this device.
    pub(crate) fn zeros_storage(&self, dtype: DType, len: usize) -> Result<Storage> {
        match self {
            Device::Cpu(d) => d.zeros(dtype, len).map(Storage::Cpu),
            Device::Cuda(d) => d.zeros(dtype, len).map(Storage::Cuda),
        }
    }
}
