//! Counts of what a CUDA device has been asked to do, kept so a benchmark
//! can tell launch overhead and host round trips from arithmetic: a step
//! whose device time is far above its kernels' floor either launches too
//! many small kernels or waits on the host between them.

use std::sync::atomic::{AtomicU64, Ordering};

/// What a CUDA device has been asked to do since it was opened
/// ([`CudaDevice::work`](super::CudaDevice::work)); subtract two readings
/// for what happened between them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceWork {
    /// Kernels launched (every `extern "C"` kernel of `kernels/cuda/`).
    pub kernels: u64,
    /// cuBLAS matrix products (one per strided-batched call).
    pub gemms: u64,
    /// Copies from the host (uploads of tensors, index lists, shape tables).
    pub uploads: u64,
    /// Copies to the host: each waits for the work queued before it.
    pub host_reads: u64,
}

impl std::ops::Sub for DeviceWork {
    type Output = DeviceWork;

    fn sub(self, earlier: DeviceWork) -> DeviceWork {
        DeviceWork {
            kernels: self.kernels - earlier.kernels,
            gemms: self.gemms - earlier.gemms,
            uploads: self.uploads - earlier.uploads,
            host_reads: self.host_reads - earlier.host_reads,
        }
    }
}

/// The live counters behind [`DeviceWork`], one set per device.
#[derive(Default)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct WorkCounters {
    kernels: AtomicU64,
    gemms: AtomicU64,
    uploads: AtomicU64,
    host_reads: AtomicU64,
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl WorkCounters {
    pub(crate) fn kernel(&self) {
        self.kernels.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn gemm(&self) {
        self.gemms.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn upload(&self) {
        self.uploads.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn host_read(&self) {
        self.host_reads.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn read(&self) -> DeviceWork {
        DeviceWork {
            kernels: self.kernels.load(Ordering::Relaxed),
            gemms: self.gemms.load(Ordering::Relaxed),
            uploads: self.uploads.load(Ordering::Relaxed),
            host_reads: self.host_reads.load(Ordering::Relaxed),
        }
    }
}
