//! Running a floating-point kernel on CPU storage of any float dtype.
//!
//! Kernels compute in `f32` (or `f64` when the op's primary input is `f64`).
//! Half-precision inputs are widened into tracked temporaries, the kernel
//! runs, and outputs are narrowed back where the op asks for it: this is the
//! one place where "stored in bf16/f16, computed in f32" is implemented.

use super::{convert, Buffer, CpuDevice, CpuStorage};
use crate::backend::kernel::{FloatKernel, Out};
use crate::tensor::DType;
use std::ops::Range;
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
    match primary {
        DType::F64 => run_in::<f64, K>(dev, kernel, primary, inputs, outputs),
        _ => run_in::<f32, K>(dev, kernel, primary, inputs, outputs),
    }
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
