//! Quantized products on the device: `x · dequant(W)ᵀ (+ bias)` from the
//! codes and scales of a quantized weight, launched straight from the
//! storages (the operands are of three dtypes, x's, `u32` words of codes
//! and f32 scales, which the float-op path does not describe). The kernels
//! are `kernels/cuda/quant.cu`.

use super::args::Grid;
use super::call::suffix;
use super::launch::Value;
use super::storage::CudaStorage;
use crate::error::{Error, Result};
use crate::tensor::DType;
use std::ops::Range;
use tessera_kernels::desc::QuantFormat;

/// Threads per block of the product kernels: eight warps, one output
/// channel each at a time.
const THREADS: u32 = 256;
/// Most blocks of a launch; the kernels' grid-stride loop over the
/// channels covers the rest.
const MAX_BLOCKS: usize = 1 << 16;

/// One block per eight output channels, capped.
fn channels(n: usize) -> Grid {
    Grid::Fixed { blocks: n.div_ceil(THREADS as usize / 32).min(MAX_BLOCKS) as u32, threads: THREADS, shared_bytes: 0 }
}

impl CudaStorage {
    /// `y = x · dequant(W)ᵀ (+ bias)`, `y` a new `[m, n]` storage of this
    /// storage's dtype. `self[x]` holds the `m·k` activations; `codes`
    /// the weight's bytes in `u32` words, `scales` its f32 scales, `bias`
    /// (if any) `n` values of the activations' dtype, each with the range
    /// of its elements. The caller has checked the shapes against the
    /// format; the lengths the kernels rely on are checked again here.
    pub(crate) fn quant_matmul(
        &self,
        x: Range<usize>,
        codes: (&CudaStorage, Range<usize>),
        scales: (&CudaStorage, Range<usize>),
        bias: Option<(&CudaStorage, Range<usize>)>,
        format: QuantFormat,
        (m, n, k): (usize, usize, usize),
    ) -> Result<CudaStorage> {
        const OP: &str = "quant_matmul";
        let sfx = suffix(self.dtype()).ok_or(Error::NotImplementedOnCuda { op: OP })?;
        let ((cs, cr), (ss, sr)) = (codes, scales);
        let fits = x.len() == m * k
            && cs.dtype() == DType::U32
            && cr.len() * 4 >= format.code_bytes(n, k)
            && ss.dtype() == DType::F32
            && sr.len() == format.scale_count(n, k)
            && bias.as_ref().is_none_or(|(b, r)| b.dtype() == self.dtype() && r.len() == n);
        if !fits {
            return Err(Error::shape(OP, format!("the operands do not fit a {format} product of [{m}, {k}] by [{n}, {k}]")));
        }
        let device = self.device();
        let y = CudaStorage::uninit(device, self.dtype(), m * n)?;
        let ptr = |s: &CudaStorage, r: &Range<usize>| Value::U64(s.device_ptr_at(r.start));
        let (xp, cp, sp) = (ptr(self, &x), ptr(cs, &cr), ptr(ss, &sr));
        let bp = bias.as_ref().map_or(Value::U64(0), |(b, r)| ptr(b, r));
        let yp = Value::U64(y.device_ptr_at(0));
        let dims = [Value::U64(m as u64), Value::U64(n as u64), Value::U64(k as u64)];
        match format {
            QuantFormat::Int8 => {
                let args = [xp, cp, sp, bp, yp, dims[0], dims[1], dims[2]];
                // SAFETY: x holds m*k elements, the codes at least n*k bytes, the scales n
                // values and the bias (or null) n, all checked above; y was just made with m*n.
                unsafe { device.launch("quant", &format!("quant_matmul_int8_{sfx}"), channels(n), &args)? }
            }
            QuantFormat::Int4 { group_size } => {
                let args = [xp, cp, sp, bp, yp, dims[0], dims[1], dims[2], Value::U64(group_size as u64)];
                // SAFETY: as for int8, with n*k/2 bytes of codes and n*k/group scales
                // (checked above); the group divides k (checked by the op).
                unsafe { device.launch("quant", &format!("quant_matmul_int4_{sfx}"), channels(n), &args)? }
            }
            QuantFormat::W8A8 => {
                // The activations' codes and scales, freed in stream order after the product.
                let xq = CudaStorage::uninit(device, DType::U32, (m * k).div_ceil(4).max(1))?;
                let sx = CudaStorage::uninit(device, DType::F32, m.max(1))?;
                let (xqp, sxp) = (Value::U64(xq.device_ptr_at(0)), Value::U64(sx.device_ptr_at(0)));
                // SAFETY: x holds m*k elements (checked); xq was just made with at least m*k
                // bytes and sx with m values.
                unsafe { device.launch("quant", &format!("quantize_rows_{sfx}"), Grid::Rows { rows: m, cols: k }, &[xp, xqp, sxp, dims[0], dims[2]])? }
                let args = [xqp, sxp, cp, sp, bp, yp, dims[0], dims[1], dims[2]];
                // SAFETY: xq and sx as written above; the codes, scales, bias and y as for int8.
                unsafe { device.launch("quant", &format!("quant_matmul_w8a8_{sfx}"), channels(n), &args)? }
            }
        }
        Ok(y)
    }
}
