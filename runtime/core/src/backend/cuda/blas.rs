//! Matrix products through cuBLAS: one handle per device, bound to its
//! compute stream.
//!
//! Tensors are row-major and cuBLAS is column-major. A row-major `[r, c]`
//! matrix read column-major is its transpose, so the row-major product
//! `C = op(A) · op(B)` is computed as the column-major `Cᵀ = op(B)ᵀ · op(A)ᵀ`:
//! the operands swap places and each keeps its own transposition flag.
//!
//! f32 runs with f32 compute (no TF32, so results match the CPU to f32
//! rounding); bf16 and f16 run on tensor cores with f32 accumulation.

use super::device::CudaDevice;
use crate::error::{Error, Result};
use crate::tensor::DType;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::cublas::CudaBlas;
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use tessera_kernels::desc::Gemm;

/// Creates the cuBLAS handle of a device, or says why it cannot.
pub(crate) fn create_handle(device: &CudaDevice) -> std::result::Result<CudaBlas, String> {
    // SAFETY: only opens and closes the library to see whether it loads.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Err("libcublas.so.12 cannot be loaded; install the CUDA toolkit's cuBLAS and put it on LD_LIBRARY_PATH".into());
    }
    // cudarc panics when a symbol its bindings need is missing.
    catch_unwind(AssertUnwindSafe(|| CudaBlas::new(device.compute_stream().clone())))
        .map_err(|_| "the cuBLAS library lacks functions this build needs (CUDA 12.8 or newer)".to_string())?
        .map_err(|e| format!("creating a cuBLAS handle failed: {e:?}"))
}

impl CudaDevice {
    /// `c = op(a) · op(b)` for the row-major operands at device addresses
    /// `a`, `b`, `c` of `dtype`, with the shapes, transpositions and batch
    /// strides of `g`. The caller guarantees the addresses hold what `g` describes.
    pub(crate) fn gemm(&self, op: &'static str, dtype: DType, g: &Gemm, a: u64, b: u64, c: u64) -> Result<()> {
        if g.batch == 0 || g.m == 0 || g.n == 0 {
            return Ok(());
        }
        let data = match dtype {
            DType::F32 => cudaDataType::CUDA_R_32F,
            DType::BF16 => cudaDataType::CUDA_R_16BF,
            DType::F16 => cudaDataType::CUDA_R_16F,
            _ => return Err(Error::NotImplementedOnCuda { op }),
        };
        let int = |x: usize| {
            i32::try_from(x).map_err(|_| Error::shape(op, format!("a matrix dimension of {x} exceeds what cuBLAS takes (2^31 - 1); split the product")))
        };
        let long = |x: usize| i64::try_from(x).expect("a stride fits in i64");
        let (m, n, k) = (int(g.m)?, int(g.n)?, int(g.k)?);
        let batch = int(g.batch)?;
        // Column-major Cᵀ (n×m, ld n) = op(B)ᵀ (n×k) · op(A)ᵀ (k×m).
        let (trans_first, ld_first) = if g.trans_b { (cublasOperation_t::CUBLAS_OP_T, k) } else { (cublasOperation_t::CUBLAS_OP_N, n) };
        let (trans_second, ld_second) = if g.trans_a { (cublasOperation_t::CUBLAS_OP_T, m) } else { (cublasOperation_t::CUBLAS_OP_N, k) };
        let alpha = 1.0f32;
        // With k = 0 the product is empty and beta = 0 sets C to zeros (BLAS semantics).
        let beta = if g.accumulate { 1.0f32 } else { 0.0f32 };
        let blas = self.blas().map_err(|detail| Error::Cuda { ordinal: self.ordinal(), op: "creating a cuBLAS handle", detail })?;
        // cuBLAS runs in the context current on the calling thread, which
        // need not be the thread that created the handle.
        self.compute_stream().context().bind_to_thread().map_err(|e| self.error("binding the device to this thread", e))?;
        // SAFETY: the handle is bound to this device's compute stream; the
        // caller guarantees that a, b and c address batch matrices of the
        // shapes and strides of `g`; alpha and beta are f32, as
        // CUBLAS_COMPUTE_32F requires, and outlive the call.
        unsafe {
            cudarc::cublas::result::gemm_strided_batched_ex(
                *blas.handle(),
                trans_first,
                trans_second,
                n,
                m,
                k,
                &alpha as *const f32 as *const c_void,
                b as *const c_void,
                data,
                ld_first,
                long(g.batch_stride_b),
                a as *const c_void,
                data,
                ld_second,
                long(g.batch_stride_a),
                &beta as *const f32 as *const c_void,
                c as *mut c_void,
                data,
                n,
                long(g.m * g.n),
                batch,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
            )
        }
        .map_err(|e| Error::Cuda { ordinal: self.ordinal(), op: "a cuBLAS matrix product", detail: format!("{e:?}") })?;
        self.counters().gemm();
        Ok(())
    }
}
