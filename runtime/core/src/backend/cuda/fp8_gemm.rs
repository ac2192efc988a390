//! FP8 matrix products on the tensor cores through cuBLASLt
//! (`ops::matmul_fp8`): the operands' FP8 values are turned into their code
//! bytes (`kernels/cuda/fp8.cu`, `fp8_codes_*`) and multiplied as E4M3 or
//! E5M2 matrices with f32 accumulation, the scales' `alpha` applied before
//! the output's one rounding.
//!
//! cuBLASLt takes FP8 operands only in its "TN" form: both operands stored
//! with the inner dimension contiguous. Row-major `C[m, n] = A[m, k] · B[k, n]`
//! is the column-major `Cᵀ (n × m) = op(X) · Y` with `X` = `Bᵀ` stored `[n,
//! k]` row-major (column-major `k × n`, transposed by the op) and `Y` = `A`
//! stored `[m, k]` row-major (column-major `k × m`): so the caller hands
//! `A` and `Bᵀ`, both row-major with `k` innermost, which is how a linear
//! layer holds its input and weight already.

use super::device::CudaDevice;
use super::launch::Value;
use super::storage::CudaStorage;
use crate::error::{Error, Result};
use crate::tensor::DType;
use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use std::ffi::c_void;
use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use tessera_kernels::cpu::fp8::Fp8Format;

/// The cuBLASLt workspace each product may use (what NVIDIA advises for Hopper).
const WORKSPACE_BYTES: usize = 32 << 20;

/// A device's cuBLASLt handle.
pub(crate) struct BlasLt {
    handle: sys::cublasLtHandle_t,
}

// SAFETY: a cuBLASLt handle may be used from any thread (one at a time is
// not required: the library documents the handle as thread safe once
// created); it is only destroyed on drop, when no product can be running.
unsafe impl Send for BlasLt {}
// SAFETY: as above.
unsafe impl Sync for BlasLt {}

impl Drop for BlasLt {
    fn drop(&mut self) {
        // SAFETY: the handle was created by `create` and is destroyed once.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

/// Creates the cuBLASLt handle of a device, or says why it cannot.
pub(crate) fn create(device: &CudaDevice) -> std::result::Result<BlasLt, String> {
    // SAFETY: only opens and closes the library to see whether it loads.
    if !unsafe { sys::is_culib_present() } {
        return Err("libcublasLt.so cannot be loaded; install the CUDA toolkit's cuBLAS and put it on LD_LIBRARY_PATH".into());
    }
    device.compute_stream().context().bind_to_thread().map_err(|e| format!("binding the device to this thread: {e:?}"))?;
    // cudarc panics when a symbol its bindings need is missing.
    let handle = catch_unwind(AssertUnwindSafe(lt::create_handle))
        .map_err(|_| "the cuBLASLt library lacks functions this build needs (CUDA 12.8 or newer)".to_string())?
        .map_err(|e| format!("creating a cuBLASLt handle failed: {e:?}"))?;
    Ok(BlasLt { handle })
}

/// Destroys a cuBLASLt descriptor when dropped (each kind has its own call).
struct Guard<T: Copy>(T, unsafe fn(T) -> std::result::Result<(), cudarc::cublaslt::result::CublasError>);

impl<T: Copy> Drop for Guard<T> {
    fn drop(&mut self) {
        // SAFETY: the descriptor was created once and is destroyed here once,
        // after the product that used it was queued (cuBLASLt copies what it
        // needs at the call).
        let _ = unsafe { (self.1)(self.0) };
    }
}

fn lt_type(format: Fp8Format) -> sys::cudaDataType {
    match format {
        Fp8Format::E4M3 => sys::cudaDataType::CUDA_R_8F_E4M3,
        Fp8Format::E5M2 => sys::cudaDataType::CUDA_R_8F_E5M2,
    }
}

fn codes_kernel(format: Fp8Format) -> &'static str {
    match format {
        Fp8Format::E4M3 => "fp8_codes_e4m3",
        Fp8Format::E5M2 => "fp8_codes_e5m2",
    }
}

impl CudaDevice {
    /// Whether the GPU multiplies FP8 on its tensor cores (compute
    /// capability 8.9, Ada, or newer: Hopper is 9.0).
    pub fn has_fp8_tensor_cores(&self) -> bool {
        let c = self.capability();
        (c.major, c.minor) >= (8, 9)
    }

    /// Whether the FP8 tensor cores take `[m, k] · [k, n]` with operands in
    /// `a` and `b` and an output of `out`: a GPU of compute capability 8.9 or
    /// newer, every dimension a positive multiple of 16 (cuBLASLt's FP8
    /// alignment), not both operands E5M2 (no such kernels), an output in
    /// f32, bf16 or f16.
    pub(crate) fn fp8_gemm_fits(&self, (m, k, n): (usize, usize, usize), a: Fp8Format, b: Fp8Format, out: DType) -> bool {
        let aligned = [m, k, n].iter().all(|&d| d > 0 && d % 16 == 0 && i32::try_from(d).is_ok());
        self.has_fp8_tensor_cores() && aligned && !(a == Fp8Format::E5M2 && b == Fp8Format::E5M2) && matches!(out, DType::F32 | DType::BF16 | DType::F16)
    }

    /// The code bytes of the FP8 values `x` (the elements `range` of a float
    /// storage), in a new storage of `range.len()` bytes (held as u32 words).
    fn fp8_codes(&self, x: &CudaStorage, range: Range<usize>, format: Fp8Format) -> Result<CudaStorage> {
        let n = range.len();
        let sfx = super::call::suffix(x.dtype()).ok_or(Error::NotImplementedOnCuda { op: "matmul_fp8 on this dtype" })?;
        let out = CudaStorage::uninit(self, DType::U32, n.div_ceil(4))?;
        let values = [Value::U64(x.device_ptr_at(range.start)), Value::U64(out.device_ptr_at(0)), Value::U64(n as u64)];
        // SAFETY: the kernel reads `n` elements of x's dtype from `range`
        // (inside the storage: the caller's contiguous range) and writes `n`
        // bytes, which the `ceil(n / 4)` words just allocated hold.
        unsafe { self.launch("fp8", &format!("{}_{sfx}", codes_kernel(format)), super::args::Grid::Items(n), &values)? };
        Ok(out)
    }

    /// `alpha · A · B` in `out` (row-major `[m, n]`) on the FP8 tensor cores,
    /// for `a` = the elements of row-major `A [m, k]` and `bt` = those of
    /// row-major `Bᵀ [n, k]`, each holding FP8 values of its format. The
    /// caller checked [`fp8_gemm_fits`](Self::fp8_gemm_fits).
    pub(crate) fn fp8_gemm(
        &self,
        (a, a_range, a_format): (&CudaStorage, Range<usize>, Fp8Format),
        (bt, bt_range, b_format): (&CudaStorage, Range<usize>, Fp8Format),
        (m, k, n): (usize, usize, usize),
        alpha: f32,
        out: DType,
    ) -> Result<CudaStorage> {
        const OP: &str = "matmul_fp8";
        if a_range.len() != m * k || bt_range.len() != n * k {
            return Err(Error::shape(OP, format!("operands of {} and {} elements for [{m}, {k}] · [{k}, {n}]", a_range.len(), bt_range.len())));
        }
        let failed = |what: &str, e: cudarc::cublaslt::result::CublasError| Error::Cuda {
            ordinal: self.ordinal(),
            op: "a cuBLASLt FP8 product",
            detail: format!("{what}: {e:?}"),
        };
        let a_codes = self.fp8_codes(a, a_range, a_format)?;
        let b_codes = self.fp8_codes(bt, bt_range, b_format)?;
        let d = CudaStorage::uninit(self, out, m * n)?;
        let workspace = CudaStorage::uninit(self, DType::U32, WORKSPACE_BYTES / 4)?;
        let blas = self.blas_lt().map_err(|detail| Error::Cuda { ordinal: self.ordinal(), op: "creating a cuBLASLt handle", detail })?;
        self.compute_stream().context().bind_to_thread().map_err(|e| self.error("binding the device to this thread", e))?;
        let d_type = match out {
            DType::F32 => sys::cudaDataType::CUDA_R_32F,
            DType::BF16 => sys::cudaDataType::CUDA_R_16BF,
            _ => sys::cudaDataType::CUDA_R_16F,
        };
        let (m64, k64, n64) = (m as u64, k as u64, n as u64);
        let desc =
            lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType::CUDA_R_32F).map_err(|e| failed("the descriptor", e))?;
        let desc = Guard(desc, lt::destroy_matmul_desc);
        let transposed = cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T;
        // SAFETY: the descriptor is live; the value is a cublasOperation_t of the size given.
        unsafe {
            lt::set_matmul_desc_attribute(
                desc.0,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                &transposed as *const _ as *const c_void,
                std::mem::size_of::<cudarc::cublas::sys::cublasOperation_t>(),
            )
        }
        .map_err(|e| failed("transposing the first operand", e))?;
        // Column-major: X = Bᵀ's codes, k × n (ld k), transposed by the op;
        // Y = A's codes, k × m (ld k); C = D, n × m (ld n).
        let layout = |t, rows, cols, ld: u64| lt::create_matrix_layout(t, rows, cols, ld as i64).map(|l| Guard(l, lt::destroy_matrix_layout));
        let x_layout = layout(lt_type(b_format), k64, n64, k64).map_err(|e| failed("the layout of B", e))?;
        let y_layout = layout(lt_type(a_format), k64, m64, k64).map_err(|e| failed("the layout of A", e))?;
        let d_layout = layout(d_type, n64, m64, n64).map_err(|e| failed("the layout of the output", e))?;
        let pref = lt::create_matmul_pref().map_err(|e| failed("the preferences", e))?;
        let pref = Guard(pref, lt::destroy_matmul_pref);
        let ws = WORKSPACE_BYTES as u64;
        // SAFETY: the preference is live; the value is a u64 of the size given.
        unsafe {
            lt::set_matmul_pref_attribute(
                pref.0,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const u64 as *const c_void,
                std::mem::size_of::<u64>(),
            )
        }
        .map_err(|e| failed("the workspace limit", e))?;
        // SAFETY: every descriptor is live and describes the buffers below.
        let heuristic = unsafe { lt::get_matmul_algo_heuristic(blas.handle, desc.0, x_layout.0, y_layout.0, d_layout.0, d_layout.0, pref.0) }
            .map_err(|e| failed(&format!("no FP8 algorithm for [{m}, {k}] · [{k}, {n}]"), e))?;
        let (alpha, beta) = (alpha, 0.0f32);
        let stream = self.compute_stream().cu_stream() as sys::cudaStream_t;
        // SAFETY: X holds n·k code bytes and Y m·k (written above on this
        // stream, which orders the product after them); D holds m·n elements
        // of `out`; beta is 0, so C (= D) is not read; the workspace holds
        // WORKSPACE_BYTES, the limit the algorithm was chosen under; alpha and
        // beta are host f32 values (the default pointer mode, the scale type
        // f32) that outlive the call.
        unsafe {
            lt::matmul(
                blas.handle,
                desc.0,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                b_codes.device_ptr_at(0) as *const c_void,
                x_layout.0,
                a_codes.device_ptr_at(0) as *const c_void,
                y_layout.0,
                d.device_ptr_at(0) as *const c_void,
                d_layout.0,
                d.device_ptr_at(0) as *mut c_void,
                d_layout.0,
                &heuristic.algo,
                workspace.device_ptr_at(0) as *mut c_void,
                WORKSPACE_BYTES,
                stream,
            )
        }
        .map_err(|e| failed("the product", e))?;
        self.counters().gemm();
        // The codes and the workspace go back to the allocator in stream
        // order: a later use of their blocks is queued after this product.
        drop((a_codes, b_codes, workspace));
        Ok(d)
    }
}
