//! A CUDA device: its context, a compute stream and a communication stream
//! ordered by events, and its caching allocator.

use super::alloc::{BlockSource, CachingAllocator, SourceError};
use super::module::Modules;
use super::storage::CudaStorage;
use super::work::{DeviceWork, WorkCounters};
use crate::backend::memory::MemoryStats;
use crate::backend::BackendDevice;
use crate::error::{Error, Result};
use crate::tensor::DType;
use cudarc::cublas::CudaBlas;
use cudarc::driver::{sys, CudaContext, CudaSlice, CudaStream, DriverError};
use std::fmt;
use std::panic::catch_unwind;
use std::sync::{Arc, OnceLock};

/// A GPU's compute capability (`9.0` for H100 / H200).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ComputeCapability {
    /// The major version (`9` of `9.0`).
    pub major: u32,
    /// The minor version (`0` of `9.0`).
    pub minor: u32,
}

impl ComputeCapability {
    /// The virtual architecture NVRTC compiles PTX for (`compute_90`).
    pub fn virtual_arch(&self) -> String {
        format!("compute_{}{}", self.major, self.minor)
    }

    /// The real architecture ptxas assembles for (`sm_90`).
    pub fn real_arch(&self) -> String {
        format!("sm_{}{}", self.major, self.minor)
    }
}

impl fmt::Display for ComputeCapability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.real_arch())
    }
}

/// A CUDA GPU. Cloning shares the device.
///
/// Kernels and allocations go to the compute stream; collectives go to the
/// communication stream, so that a gradient all-reduce overlaps the rest of
/// backward. The streams are ordered by events only where data crosses them
/// ([`comm_waits_for_compute`](Self::comm_waits_for_compute) before a
/// collective reads what compute wrote, [`compute_waits_for_comm`](Self::compute_waits_for_comm)
/// before compute reads what a collective wrote), never by synchronising the host.
#[derive(Clone)]
pub struct CudaDevice {
    inner: Arc<Inner>,
}

struct Inner {
    ordinal: usize,
    name: String,
    capability: ComputeCapability,
    compute: Arc<CudaStream>,
    comm: Arc<CudaStream>,
    // The streams and every block hold the context, which lives as long as they do.
    allocator: CachingAllocator<StreamBlocks>,
    modules: Modules,
    // Created on the first matrix product; the error says why it cannot be.
    blas: OnceLock<std::result::Result<CudaBlas, String>>,
    // Created on the first FP8 product; the error says why it cannot be.
    blas_lt: OnceLock<std::result::Result<super::fp8_gemm::BlasLt, String>>,
    work: WorkCounters,
}

/// Blocks allocated in the order of the compute stream.
pub(crate) struct StreamBlocks {
    stream: Arc<CudaStream>,
}

impl BlockSource for StreamBlocks {
    type Block = CudaSlice<u8>;

    fn allocate(&self, bytes: usize) -> Result<CudaSlice<u8>, SourceError> {
        // SAFETY: the block's bytes are uninitialised; every storage made from
        // it is zeroed or fully written on this stream before it is read.
        unsafe { self.stream.alloc::<u8>(bytes) }.map_err(|e| {
            if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                SourceError::OutOfMemory
            } else {
                SourceError::Other(describe(&e))
            }
        })
    }
}

/// Loads the driver library and initialises it, once per process.
///
/// cudarc loads the library lazily and panics when it (or a symbol this
/// build's bindings need) is missing; the library is probed first and the
/// first calls run under `catch_unwind`, so a machine without a driver gets
/// an error.
fn driver() -> std::result::Result<(), String> {
    static READY: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    READY
        .get_or_init(|| {
            // SAFETY: only opens and closes the driver library to see whether it loads.
            if !unsafe { sys::is_culib_present() } {
                return Err("the CUDA driver library (libcuda.so.1) cannot be loaded: no NVIDIA driver is installed, or it is not on the loader path".into());
            }
            match catch_unwind(cudarc::driver::result::init) {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) if e.0 == sys::CUresult::CUDA_ERROR_NO_DEVICE => Err("the driver sees no CUDA device (check CUDA_VISIBLE_DEVICES)".into()),
                Ok(Err(e)) => Err(format!("initialising the CUDA driver failed: {}", describe(&e))),
                Err(_) => Err("the CUDA driver library lacks functions this build needs (CUDA 12.8 or newer); update the NVIDIA driver".into()),
            }
        })
        .clone()
}

/// The error name and text of a driver error.
pub(crate) fn describe(e: &DriverError) -> String {
    match (e.error_name(), e.error_string()) {
        (Ok(name), Ok(text)) => format!("{} ({})", name.to_string_lossy(), text.to_string_lossy()),
        _ => format!("CUDA error {:?}", e.0),
    }
}

impl CudaDevice {
    /// Opens CUDA device `ordinal`.
    ///
    /// [`Error::CudaUnavailable`] when the driver cannot be loaded, the
    /// machine has no GPU or fewer than `ordinal + 1`; never a panic.
    pub fn new(ordinal: usize) -> Result<Self> {
        let unavailable = |reason: String| Error::CudaUnavailable { ordinal, reason };
        driver().map_err(unavailable)?;
        let count = catch_unwind(CudaContext::device_count)
            .map_err(|_| unavailable("the CUDA driver panicked while counting devices".into()))?
            .map_err(|e| unavailable(format!("counting devices failed: {}", describe(&e))))?;
        let count = usize::try_from(count).unwrap_or(0);
        if ordinal >= count {
            return Err(unavailable(match count {
                0 => "this machine has no CUDA device".into(),
                n => format!("this machine has {n} CUDA device(s), ordinals 0..{n}"),
            }));
        }
        let failed = |op: &'static str| move |e: DriverError| Error::Cuda { ordinal, op, detail: describe(&e) };
        let context = catch_unwind(|| CudaContext::new(ordinal))
            .map_err(|_| unavailable("the CUDA driver panicked while creating a context".into()))?
            .map_err(failed("creating a context"))?;
        let (major, minor) = context.compute_capability().map_err(failed("reading the compute capability"))?;
        let capability = ComputeCapability { major: major as u32, minor: minor as u32 };
        let name = context.name().map_err(failed("reading the device name"))?;
        // One mechanism orders the two streams: Tessera's own events (see
        // `comm_waits_for_compute` and `compute_waits_for_comm`), not
        // cudarc's per-allocation tracking, which records a use when a
        // pointer is taken rather than when the kernel that uses it runs.
        // SAFETY: turned off before any stream or allocation exists, and the
        // three duties it leaves to us are met: (1) no block is freed while
        // another stream still uses it: a collective's buffers are held until
        // the compute stream, on which blocks are reused, waits for it
        // (`dist::nccl`'s in-flight handles); (2) no block is used on the
        // communication stream before its allocation, queued on the compute
        // stream, is done: every collective first makes the communication
        // stream wait for the compute stream; (3) no block is written by both
        // streams at once: compute reads or writes a collective's buffers
        // only after waiting for it.
        unsafe { context.disable_event_tracking() };
        let compute = context.new_stream().map_err(failed("creating the compute stream"))?;
        let comm = context.new_stream().map_err(failed("creating the communication stream"))?;
        let allocator = CachingAllocator::new(StreamBlocks { stream: compute.clone() });
        Ok(CudaDevice {
            inner: Arc::new(Inner {
                ordinal,
                name,
                capability,
                compute,
                comm,
                allocator,
                modules: Modules::default(),
                blas: OnceLock::new(),
                blas_lt: OnceLock::new(),
                work: WorkCounters::default(),
            }),
        })
    }

    /// The device's CUDA ordinal.
    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }

    /// The GPU's name as the driver reports it.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The GPU's compute capability: what kernels are compiled for.
    pub fn capability(&self) -> ComputeCapability {
        self.inner.capability
    }

    /// Whether both handles name the same device.
    pub fn same(&self, other: &CudaDevice) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// What this device has been asked to do since it was opened: kernels,
    /// cuBLAS products, uploads and reads back to the host.
    pub fn work(&self) -> DeviceWork {
        self.inner.work.read()
    }

    /// The live counters behind [`work`](Self::work).
    pub(crate) fn counters(&self) -> &WorkCounters {
        &self.inner.work
    }

    /// The stream kernels and allocations are queued on.
    pub fn compute_stream(&self) -> &Arc<CudaStream> {
        &self.inner.compute
    }

    /// The stream collectives are queued on.
    pub fn comm_stream(&self) -> &Arc<CudaStream> {
        &self.inner.comm
    }

    /// Makes work queued on the communication stream from now on wait for
    /// everything queued on the compute stream so far (a collective about to
    /// read a gradient the backward just wrote).
    pub fn comm_waits_for_compute(&self) -> Result<()> {
        self.inner.comm.join(&self.inner.compute).map_err(|e| self.error("ordering the communication stream after compute", e))
    }

    /// Makes work queued on the compute stream from now on wait for
    /// everything queued on the communication stream so far (the optimizer
    /// about to read an all-reduced gradient).
    pub fn compute_waits_for_comm(&self) -> Result<()> {
        self.inner.compute.join(&self.inner.comm).map_err(|e| self.error("ordering the compute stream after communication", e))
    }

    /// The kernel modules and functions loaded on this device.
    pub(crate) fn modules(&self) -> &Modules {
        &self.inner.modules
    }

    /// The device's cuBLAS handle, created on first use on the compute stream.
    pub(crate) fn blas(&self) -> std::result::Result<&CudaBlas, String> {
        self.inner.blas.get_or_init(|| super::blas::create_handle(self)).as_ref().map_err(Clone::clone)
    }

    /// The device's cuBLASLt handle (for FP8 products), created on first use.
    pub(crate) fn blas_lt(&self) -> std::result::Result<&super::fp8_gemm::BlasLt, String> {
        self.inner.blas_lt.get_or_init(|| super::fp8_gemm::create(self)).as_ref().map_err(Clone::clone)
    }

    /// The device's memory as the driver reports it: (bytes free now,
    /// bytes in all).
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.inner.compute.context().mem_get_info().map_err(|e| self.error("CudaDevice::memory_info", e))
    }

    /// Returns the allocator's cached blocks to the driver; the bytes released.
    pub fn empty_cache(&self) -> usize {
        self.inner.allocator.empty_cache()
    }

    /// A block of at least `bytes` from the caching allocator, with its class size.
    pub(crate) fn allocate(&self, bytes: usize) -> Result<(CudaSlice<u8>, usize)> {
        self.inner.allocator.allocate(bytes).map_err(|e| match e {
            SourceError::OutOfMemory => Error::CudaOutOfMemory { ordinal: self.ordinal(), requested: bytes, in_use: self.inner.allocator.stats().in_use },
            SourceError::Other(detail) => Error::Cuda { ordinal: self.ordinal(), op: "allocating device memory", detail },
        })
    }

    /// A copy of host bytes holding `len` elements of `dtype`.
    pub(crate) fn upload(&self, dtype: DType, len: usize, data: &[u8]) -> Result<CudaStorage> {
        CudaStorage::from_host_bytes(self, dtype, len, data)
    }

    /// Takes back a block from [`allocate`](Self::allocate).
    pub(crate) fn release(&self, block: CudaSlice<u8>, class: usize) {
        self.inner.allocator.release(block, class);
    }

    /// The [`Error::Cuda`] of `op` failing on this device with driver error `e`.
    pub fn error(&self, op: &'static str, e: DriverError) -> Error {
        Error::Cuda { ordinal: self.ordinal(), op, detail: describe(&e) }
    }

    /// The error of an operation the CUDA backend does not have yet.
    pub fn unsupported<T>(&self, op: &'static str) -> Result<T> {
        Err(Error::NotImplementedOnCuda { op })
    }
}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaDevice({}: {}, {})", self.inner.ordinal, self.inner.name, self.inner.capability)
    }
}

impl BackendDevice for CudaDevice {
    type Storage = CudaStorage;

    fn zeros(&self, dtype: DType, len: usize) -> Result<CudaStorage> {
        CudaStorage::zeros(self, dtype, len)
    }

    fn memory_stats(&self) -> MemoryStats {
        self.inner.allocator.stats()
    }

    fn reset_peak(&self) {
        self.inner.allocator.reset_peak();
    }

    fn synchronize(&self) -> Result<()> {
        self.inner.compute.synchronize().map_err(|e| self.error("synchronising the compute stream", e))?;
        self.inner.comm.synchronize().map_err(|e| self.error("synchronising the communication stream", e))
    }
}
