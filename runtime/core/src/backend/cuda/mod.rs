//! The CUDA backend: devices, their caching allocator, storages and the
//! run-time kernel compiler.
//!
//! Built with the `cuda` cargo feature on top of `cudarc`, which opens the
//! CUDA libraries with `dlopen` at run time: the feature builds on any
//! machine, and a machine without a driver or GPU gets
//! [`Error::CudaUnavailable`](crate::Error::CudaUnavailable) from
//! [`CudaDevice::new`], never a panic. Without the feature the device and
//! storage are uninhabited stand-ins (see `stub.rs`), so code that dispatches
//! on [`Device`](crate::Device) never needs `#[cfg]`.
//!
//! What runs on a CUDA device so far: allocation (zeros), copies between host
//! and device, memory statistics and synchronisation, dtype conversion and
//! strided copies, and the ops whose kernel struct has a CUDA implementation
//! (`FloatKernel::cuda`: elementwise arithmetic, activations, norms, sums,
//! matrix products through cuBLAS, fused attention, softmax, cross-entropy,
//! embedding, RoPE, dropout), top-k and its backward, the AdamW step,
//! paged attention with its KV-cache write (`ops::paged_attention`,
//! `ops::kv_cache_write`) and the quantized products (int8, int4, W8A8).
//! Every other operation returns
//! [`Error::NotImplementedOnCuda`](crate::Error::NotImplementedOnCuda)
//! naming the operation. docs/cuda.md says what is next.

// The allocator's policy is plain Rust and is tested in every build.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod alloc;

#[cfg(feature = "cuda")]
pub(crate) mod adamw;
pub(crate) mod args;
#[cfg(feature = "cuda")]
mod blas;
#[cfg(feature = "cuda")]
pub(crate) mod call;
#[cfg(feature = "cuda")]
mod copy;
#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
mod fp8_gemm;
#[cfg(feature = "cuda")]
mod inplace;
#[cfg(feature = "cuda")]
mod launch;
#[cfg(feature = "cuda")]
mod module;
#[cfg(feature = "cuda")]
pub mod nvrtc;
#[cfg(feature = "cuda")]
mod quant;
#[cfg(feature = "cuda")]
mod storage;
#[cfg(not(feature = "cuda"))]
mod stub;
pub mod testing;
#[cfg(feature = "cuda")]
mod topk;
mod work;

#[cfg(feature = "cuda")]
pub(crate) use call::{run_op, CudaCall};
#[cfg(feature = "cuda")]
pub use device::{ComputeCapability, CudaDevice};
#[cfg(feature = "cuda")]
pub use storage::CudaStorage;
#[cfg(not(feature = "cuda"))]
pub(crate) use stub::{adamw, run_op, CudaCall};
#[cfg(not(feature = "cuda"))]
pub use stub::{CudaDevice, CudaStorage};
pub use testing::report_skip;
pub use work::DeviceWork;

/// One tensor of a multi-tensor AdamW step on a device: the device
/// addresses of its f32 parameter, gradient and moments (each `len`
/// elements), and its step.
#[derive(Clone, Copy, Debug)]
// Without the CUDA backend nothing launches the step, so nothing reads these.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct AdamWSlot {
    pub step: tessera_kernels::desc::AdamWStep,
    pub param: u64,
    pub grad: u64,
    pub m: u64,
    pub v: u64,
    pub len: usize,
}

/// Whether this build has the CUDA backend (the `cuda` cargo feature).
///
/// Says nothing about the machine: [`CudaDevice::new`] answers that.
pub const COMPILED: bool = cfg!(feature = "cuda");
