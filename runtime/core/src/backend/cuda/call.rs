//! One op run on a CUDA device: its operands, its fresh outputs from the
//! caching allocator, and the launches its CUDA implementation makes.
//!
//! An op's kernel struct describes its launches with [`CudaCall::launch`]
//! and [`CudaCall::gemm`] (see `FloatKernel::cuda`); the names of the
//! kernels follow the rule `{op}_{dtype}` of the primary input's dtype.

use super::args::{Arg, Grid};
use super::device::CudaDevice;
use super::launch::{AttnArg, Value};
use super::storage::CudaStorage;
use crate::backend::kernel::Out;
use crate::error::{Error, Result};
use crate::tensor::DType;
use std::ops::Range;
use tessera_kernels::desc::Gemm;

/// An op's operands and outputs on one device, while its CUDA
/// implementation runs.
pub struct CudaCall {
    op: &'static str,
    device: CudaDevice,
    primary: DType,
    // Each input's device pointer at its first element, its length and
    // dtype. The caller holds the storages (and their read guards) for the
    // whole call.
    inputs: Vec<(u64, usize, DType)>,
    outputs: Vec<CudaStorage>,
    // f32 buffers the op needs between its launches (attention's `delta`);
    // freed after the call in stream order, so later work may reuse them.
    scratch: Vec<CudaStorage>,
}

/// The dtype part of a kernel's symbol; `None` for dtypes with no kernels.
pub(crate) fn suffix(dtype: DType) -> Option<&'static str> {
    match dtype {
        DType::F32 => Some("f32"),
        DType::BF16 => Some("bf16"),
        DType::F16 => Some("f16"),
        _ => None,
    }
}

/// Runs `body` on the operands `inputs` (each a storage and the contiguous
/// range the operand occupies) and returns the outputs, one per entry of
/// `outputs` (element count and dtype). Outputs start zeroed unless the op
/// writes every element.
pub(crate) fn run_op(
    op: &'static str,
    device: &CudaDevice,
    primary: DType,
    inputs: &[(&CudaStorage, Range<usize>)],
    outputs: &[(usize, Out)],
    writes_all: bool,
    body: impl FnOnce(&mut CudaCall) -> Result<()>,
) -> Result<Vec<CudaStorage>> {
    if suffix(primary).is_none() {
        return Err(Error::NotImplementedOnCuda { op });
    }
    let inputs = inputs.iter().map(|(s, r)| (s.device_ptr_at(r.start), r.len(), s.dtype())).collect();
    let outputs = outputs
        .iter()
        .map(|&(n, kind)| {
            let dtype = match kind {
                Out::Primary => primary,
                Out::Compute => DType::F32,
            };
            if writes_all {
                CudaStorage::uninit(device, dtype, n)
            } else {
                CudaStorage::zeros(device, dtype, n)
            }
        })
        .collect::<Result<_>>()?;
    let mut call = CudaCall { op, device: device.clone(), primary, inputs, outputs, scratch: Vec::new() };
    body(&mut call)?;
    Ok(call.outputs)
}

impl CudaCall {
    /// The error of an op that has no CUDA implementation.
    pub(crate) fn unsupported<T>(&self) -> Result<T> {
        Err(Error::NotImplementedOnCuda { op: self.op })
    }

    /// The dtype part of this call's kernel symbols (`f32`, `bf16`, `f16`):
    /// the primary input's, which picks between kernel families.
    pub(crate) fn dtype_suffix(&self) -> &'static str {
        suffix(self.primary).expect("checked by run_op")
    }

    /// The device's compute capability as one number (`90` for sm_90):
    /// kernel families that need newer instructions check it.
    pub(crate) fn sm(&self) -> u32 {
        let c = self.device.capability();
        10 * c.major + c.minor
    }

    /// The number of elements of output `i`.
    pub(crate) fn output_len(&self, i: usize) -> usize {
        self.outputs[i].len()
    }

    /// The number of elements of input `i`.
    pub(crate) fn input_len(&self, i: usize) -> usize {
        self.inputs[i].1
    }

    /// Refuses the launch unless the operand `arg` holds at least `n`
    /// elements: what a launch's safety rests on, checked rather than assumed.
    pub(crate) fn at_least(&self, arg: Arg, n: usize) -> Result<()> {
        let (what, len) = match arg {
            Arg::Input(i) | Arg::Stats(i) => ("an input", self.inputs[i].1),
            Arg::Output(i) => ("an output", self.outputs[i].len()),
            Arg::Scratch(i) => ("a scratch buffer", self.scratch[i].len()),
            Arg::Null | Arg::U64(_) | Arg::F32(_) | Arg::U32(_) | Arg::Attn(_) => return Ok(()),
        };
        if len < n {
            return Err(Error::shape(
                self.op,
                format!("a CUDA launch needs {n} elements of {what}, which holds {len}; the operands' shapes do not fit the op"),
            ));
        }
        Ok(())
    }

    /// A zeroed f32 buffer of `n` elements for the rest of the call, named
    /// by the returned index in [`Arg::Scratch`].
    pub(crate) fn scratch_f32(&mut self, n: usize) -> Result<usize> {
        self.scratch.push(CudaStorage::zeros(&self.device, DType::F32, n)?);
        Ok(self.scratch.len() - 1)
    }

    /// A copy of the host values `data` on the device for the rest of the
    /// call (token ids, targets, index lists), named by the returned index in
    /// [`Arg::Scratch`].
    pub(crate) fn upload_u32(&mut self, data: &[u32]) -> Result<usize> {
        self.upload(DType::U32, data.len(), data.iter().flat_map(|v| v.to_ne_bytes()).collect())
    }

    /// The same for f32 values (lookup tables).
    pub(crate) fn upload_f32(&mut self, data: &[f32]) -> Result<usize> {
        self.upload(DType::F32, data.len(), data.iter().flat_map(|v| v.to_ne_bytes()).collect())
    }

    fn upload(&mut self, dtype: DType, len: usize, mut bytes: Vec<u8>) -> Result<usize> {
        // An empty list still gets a (one-element) buffer: its pointer must be valid.
        if len == 0 {
            bytes = vec![0; dtype.size_in_bytes()];
        }
        self.scratch.push(CudaStorage::from_host_bytes(&self.device, dtype, len.max(1), &bytes)?);
        Ok(self.scratch.len() - 1)
    }

    /// Launches the kernel `{kernel}_{dtype}` of the source `source` over
    /// `grid`, `dtype` being the primary input's.
    ///
    /// The pointers are this call's own operands, outputs and scratch
    /// buffers, named by index, so they are live for the whole call; inputs
    /// read as the primary dtype (or f32 statistics) are checked to be
    /// stored in it; and the arguments are checked against the parameters
    /// the kernel's PTX declares (see `CudaDevice::launch`).
    ///
    /// # Safety
    ///
    /// Every length and dimension among `args` must describe no more
    /// elements than the kernel then reads from the inputs and scratch
    /// buffers and writes to the outputs it is given (each kernel's
    /// parameter list is in `kernels/cuda/`; the op's checks of its
    /// operands' shapes, before the call, are what make that true).
    pub(crate) unsafe fn launch(&mut self, source: &'static str, kernel: &str, grid: Grid, args: &[Arg]) -> Result<()> {
        let symbol = format!("{kernel}_{}", suffix(self.primary).expect("checked by run_op"));
        let values: Vec<Value> = args
            .iter()
            .map(|a| match *a {
                Arg::Input(i) => self.input(i, self.primary).map(Value::U64),
                Arg::Stats(i) => self.input(i, DType::F32).map(Value::U64),
                Arg::Output(i) => Ok(Value::U64(self.outputs[i].device_ptr_at(0))),
                Arg::Null => Ok(Value::U64(0)),
                Arg::U64(x) => Ok(Value::U64(x as u64)),
                Arg::F32(x) => Ok(Value::F32(x)),
                Arg::U32(x) => Ok(Value::U32(x)),
                Arg::Scratch(i) => Ok(Value::U64(self.scratch[i].device_ptr_at(0))),
                Arg::Attn(p) => Ok(Value::Attn(AttnArg(p))),
            })
            .collect::<Result<_>>()?;
        // SAFETY: the pointers are the call's live operands of the dtypes
        // the kernel takes (above); the lengths are this function's contract.
        unsafe { self.device.launch(source, &symbol, grid, &values) }
    }

    /// The pointer of input `i`, which the kernel reads as `dtype`.
    ///
    /// The CPU widens operands of mixed dtypes; the GPU kernels read each
    /// operand in one dtype, so a mismatch is an error rather than garbage.
    fn input(&self, i: usize, dtype: DType) -> Result<u64> {
        let (ptr, _, got) = self.inputs[i];
        if got != dtype {
            return Err(Error::DType {
                op: self.op,
                expected: format!("{dtype} (the dtype of the op's first operand) for operand {i}"),
                got,
                hint: "; on a GPU the operands of an op must share a dtype: convert them with `to_dtype`",
            });
        }
        Ok(ptr)
    }

    /// `output 0 = op(input 0) · op(input 1)` through cuBLAS, with the
    /// shapes, transpositions and batch strides of `g` (row-major, as the
    /// CPU kernel reads them).
    pub(crate) fn gemm(&mut self, g: &Gemm) -> Result<()> {
        let (a, b) = (self.input(0, self.primary)?, self.input(1, self.primary)?);
        let c = self.outputs[0].device_ptr_at(0);
        self.device.gemm(self.op, self.primary, g, a, b, c)
    }
}
