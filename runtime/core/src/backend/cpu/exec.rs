//! Running a floating-point kernel on CPU storage of any float dtype.
//!
//! Kernels compute in `f32` (or `f64` when the op's primary input is `f64`).
//! For half-precision operands, an op with a half-precision form
//! ([`FloatKernel::half`]) gets them in their storage dtype and writes its
//! outputs in their final dtype; for the others, inputs are widened into
//! tracked temporaries, the kernel runs, and outputs are narrowed back where
//! the op asks for it. These two paths are where "stored in bf16/f16,
//! computed in f32" is implemented.

use super::{convert, Buffer, CpuDevice, CpuStorage};
use crate::backend::kernel::{FloatKernel, Out};
use crate::tensor::DType;
use std::ops::Range;
use tessera_kernels::cpu::mixed::{Dst, Src};
use tessera_kernels::Real;

/// A compute type together with the conversions into and out of it.
trait ComputeType: Real + crate::tensor::Element {
    fn view(s: &CpuStorage) -> Option<&[Self]>;
    fn wrap(b: Buffer<Self>) -> CpuStorage;
}

impl ComputeType for f32 {
    fn view(s: &CpuStorage) -> Option<&[f32]> {
        s.as_slice()
    }
    fn wrap(b: Buffer<f32>) -> CpuStorage {
        CpuStorage::F32(b)
    }
}

impl ComputeType for f64 {
    fn view(s: &CpuStorage) -> Option<&[f64]> {
        s.as_slice()
    }
    fn wrap(b: Buffer<f64>) -> CpuStorage {
        CpuStorage::F64(b)
    }
}

/// Runs `kernel` on `inputs` (each a storage and the contiguous range the
/// operand occupies). `outputs` gives each output's element count and dtype.
/// All inputs must be float storages; the caller has checked.
pub(crate) fn run_float<K: FloatKernel>(
    dev: &CpuDevice,
    kernel: &K,
    primary: DType,
    inputs: &[(&CpuStorage, Range<usize>)],
    outputs: &[(usize, Out)],
) -> Vec<CpuStorage> {
    let dtypes: Vec<DType> = inputs.iter().map(|(s, _)| s.dtype()).collect();
    match primary {
        DType::F64 => run_in::<f64, K>(dev, kernel, primary, inputs, outputs),
        DType::BF16 | DType::F16 if kernel.half(primary, &dtypes) => run_half(dev, kernel, primary, inputs, outputs),
        _ => run_in::<f32, K>(dev, kernel, primary, inputs, outputs),
    }
}

/// Runs a kernel's half-precision form: inputs are read in their storage
/// dtype (f64 or integer ones, which a half-precision op does not normally
/// get, are converted to f32 first), outputs are allocated in their final
/// dtype and written once.
fn run_half<K: FloatKernel>(dev: &CpuDevice, kernel: &K, primary: DType, inputs: &[(&CpuStorage, Range<usize>)], outputs: &[(usize, Out)]) -> Vec<CpuStorage> {
    let converted: Vec<Option<CpuStorage>> = inputs
        .iter()
        .map(|(s, r)| match s.dtype() {
            DType::F32 | DType::BF16 | DType::F16 => None,
            _ => Some(convert(dev, s, r.clone(), DType::F32)),
        })
        .collect();
    let srcs: Vec<Src<'_>> = inputs
        .iter()
        .zip(&converted)
        .map(|((s, r), c)| {
            let (s, r) = match c {
                Some(c) => (c, 0..c.len()),
                None => (*s, r.clone()),
            };
            match s {
                CpuStorage::F32(b) => Src::F32(&b[r]),
                CpuStorage::BF16(b) => Src::BF16(&b[r]),
                CpuStorage::F16(b) => Src::F16(&b[r]),
                _ => unreachable!("converted to f32 above"),
            }
        })
        .collect();
    let mut outs: Vec<CpuStorage> = outputs
        .iter()
        .map(|&(n, kind)| {
            let dtype = if kind == Out::Primary { primary } else { DType::F32 };
            match (dtype, K::WRITES_ALL) {
                (DType::BF16, true) => CpuStorage::BF16(dev.buffer_for_overwrite(n)),
                (DType::F16, true) => CpuStorage::F16(dev.buffer_for_overwrite(n)),
                (_, true) => CpuStorage::F32(dev.buffer_for_overwrite(n)),
                (dtype, false) => CpuStorage::zeros(dev, dtype, n),
            }
        })
        .collect();
    {
        let dsts: Vec<Dst<'_>> = outs
            .iter_mut()
            .map(|s| match s {
                CpuStorage::F32(b) => Dst::F32(b),
                CpuStorage::BF16(b) => Dst::BF16(b),
                CpuStorage::F16(b) => Dst::F16(b),
                _ => unreachable!("allocated as a float type above"),
            })
            .collect();
        kernel.run_half(&srcs, dsts);
    }
    outs
}

fn run_in<T: ComputeType, K: FloatKernel>(
    dev: &CpuDevice,
    kernel: &K,
    primary: DType,
    inputs: &[(&CpuStorage, Range<usize>)],
    outputs: &[(usize, Out)],
) -> Vec<CpuStorage> {
    // Inputs already in the compute type are borrowed; others are widened
    // into temporaries that count against the device until the op returns.
    let widened: Vec<Option<CpuStorage>> = inputs
        .iter()
        .map(|(s, r)| match T::view(s) {
            Some(_) => None,
            None => Some(convert(dev, s, r.clone(), T::DTYPE)),
        })
        .collect();
    let slices: Vec<&[T]> = inputs
        .iter()
        .zip(&widened)
        .map(|((s, r), w)| match w {
            Some(w) => T::view(w).expect("converted to the compute type"),
            None => &T::view(s).expect("compute type")[r.clone()],
        })
        .collect();
    let fresh = |n| if K::WRITES_ALL { dev.buffer_for_overwrite::<T>(n) } else { dev.buffer_zeros::<T>(n) };
    let mut outs: Vec<Buffer<T>> = outputs.iter().map(|&(n, _)| fresh(n)).collect();
    {
        let mut out_slices: Vec<&mut [T]> = outs.iter_mut().map(|b| &mut **b).collect();
        kernel.run(&slices, &mut out_slices);
    }
    drop(slices);
    drop(widened);
    outs.into_iter()
        .zip(outputs)
        .map(|(b, &(n, kind))| {
            let s = T::wrap(b);
            match kind {
                Out::Primary if primary != T::DTYPE => convert(dev, &s, 0..n, primary),
                _ => s,
            }
        })
        .collect()
}
