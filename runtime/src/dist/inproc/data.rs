//! Moving and summing elements between the ranks' tensors.
//!
//! Every function reads other ranks' tensors through their storage's read
//! lock and writes only into new buffers of the calling rank's device, so the
//! bytes a rank receives are counted where they land.

use crate::backend::cpu::Buffer;
use crate::backend::{CpuDevice, CpuStorage, Device, Storage};
use crate::tensor::{DType, Element, Shape, Tensor};
use half::{bf16, f16};
use std::ops::Range;
use tessera_kernels::cpu::{cast, elementwise};

/// The CPU device a tensor lives on (every device of this build is one).
pub(super) fn cpu_device(d: &Device) -> &CpuDevice {
    match d {
        Device::Cpu(dev) => dev,
        Device::Cuda(c) => match *c {},
    }
}

/// The storage range a contiguous tensor occupies.
fn range_of(t: &Tensor) -> Range<usize> {
    t.layout().contiguous_range().expect("collectives post contiguous tensors")
}

/// Wraps `storage` as a tensor of `shape` on `dev`.
pub(super) fn wrap(storage: CpuStorage, shape: impl Into<Shape>, dev: &CpuDevice) -> Tensor {
    Tensor::from_cpu(storage, shape, dev)
}

/// Runs `$body` with `$t` bound to the Rust element type of `$dtype`.
macro_rules! with_elem {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            DType::F32 => { type $t = f32; $body }
            DType::F64 => { type $t = f64; $body }
            DType::BF16 => { type $t = bf16; $body }
            DType::F16 => { type $t = f16; $body }
            DType::I32 => { type $t = i32; $body }
            DType::U32 => { type $t = u32; $body }
        }
    };
}

/// A new storage on `dev` holding, in order, the elements `range` (counted
/// from the tensor's first element) of each piece's tensor. All pieces have
/// dtype `dtype` and are contiguous.
pub(super) fn concat(dev: &CpuDevice, dtype: DType, pieces: &[(&Tensor, Range<usize>)]) -> CpuStorage {
    with_elem!(dtype, T => CpuStorage::from_buffer(concat_typed::<T>(dev, pieces)))
}

fn concat_typed<T: Element>(dev: &CpuDevice, pieces: &[(&Tensor, Range<usize>)]) -> Buffer<T> {
    let total = pieces.iter().map(|(_, r)| r.len()).sum();
    // Built by appending rather than zero-filled and overwritten: one pass
    // over the destination instead of two.
    let mut out = Vec::with_capacity(total);
    for (t, r) in pieces {
        let base = range_of(t).start;
        let guard = t.read();
        let Storage::Cpu(s) = &*guard else { unreachable!("CPU tensors only") };
        let src = s.as_slice::<T>().expect("collective checked the dtypes agree");
        out.extend_from_slice(&src[base + r.start..base + r.end]);
    }
    dev.buffer(out)
}

/// The elementwise sum over `sources` (in that order) of the elements
/// `segments` (counted from each tensor's first element), concatenated, as
/// new storage of `dtype` on `dev`.
///
/// Floats are summed in `f32` (`f64` for `f64`) and rounded to `dtype` once
/// at the end; integers wrap. The order of the additions is fixed by the
/// order of `sources`, so the result never depends on which thread runs it.
pub(super) fn reduce(dev: &CpuDevice, dtype: DType, sources: &[&Tensor], segments: &[Range<usize>]) -> CpuStorage {
    let total: usize = segments.iter().map(Range::len).sum();
    let guards: Vec<_> = sources.iter().map(|t| t.read()).collect();
    let inputs: Vec<(&CpuStorage, usize)> = guards
        .iter()
        .zip(sources)
        .map(|(g, t)| match &**g {
            Storage::Cpu(s) => (s, range_of(t).start),
            Storage::Cuda(c) => match *c {},
        })
        .collect();
    match dtype {
        DType::F32 => CpuStorage::F32(sum_direct::<f32>(dev, &inputs, segments, total)),
        DType::F64 => CpuStorage::F64(sum_direct::<f64>(dev, &inputs, segments, total)),
        DType::BF16 => {
            let acc = sum_widened(dev, &inputs, segments, total, |s, r, out| cast::bf16_to_f32(&s.as_slice::<bf16>().expect("bf16")[r], out));
            let mut out = dev.buffer_zeros::<bf16>(total);
            cast::f32_to_bf16(&acc, &mut out);
            CpuStorage::BF16(out)
        }
        DType::F16 => {
            let acc = sum_widened(dev, &inputs, segments, total, |s, r, out| cast::f16_to_f32(&s.as_slice::<f16>().expect("f16")[r], out));
            let mut out = dev.buffer_zeros::<f16>(total);
            cast::f32_to_f16(&acc, &mut out);
            CpuStorage::F16(out)
        }
        DType::I32 => CpuStorage::I32(sum_ints(dev, &inputs, segments, total, i32::wrapping_add)),
        DType::U32 => CpuStorage::U32(sum_ints(dev, &inputs, segments, total, u32::wrapping_add)),
    }
}

/// Sums sources already in the compute type: the first is copied, the others
/// added in place with the parallel kernel.
fn sum_direct<T: tessera_kernels::Real + Element>(
    dev: &CpuDevice,
    inputs: &[(&CpuStorage, usize)],
    segments: &[Range<usize>],
    total: usize,
) -> Buffer<T> {
    let mut acc = dev.buffer_zeros::<T>(total);
    for (i, (s, base)) in inputs.iter().enumerate() {
        let src = s.as_slice::<T>().expect("collective checked the dtypes agree");
        let mut at = 0;
        for seg in segments {
            let dst = &mut acc[at..at + seg.len()];
            let x = &src[base + seg.start..base + seg.end];
            if i == 0 {
                dst.copy_from_slice(x);
            } else {
                elementwise::add_assign(dst, x);
            }
            at += seg.len();
        }
    }
    acc
}

/// Sums half-precision sources in `f32`: each segment is widened into a
/// scratch buffer, then added.
fn sum_widened(
    dev: &CpuDevice,
    inputs: &[(&CpuStorage, usize)],
    segments: &[Range<usize>],
    total: usize,
    widen: impl Fn(&CpuStorage, Range<usize>, &mut [f32]),
) -> Buffer<f32> {
    let mut acc = dev.buffer_zeros::<f32>(total);
    let longest = segments.iter().map(Range::len).max().unwrap_or(0);
    let mut scratch = dev.buffer_zeros::<f32>(if inputs.len() > 1 { longest } else { 0 });
    for (i, (s, base)) in inputs.iter().enumerate() {
        let mut at = 0;
        for seg in segments {
            let r = base + seg.start..base + seg.end;
            let dst = &mut acc[at..at + seg.len()];
            if i == 0 {
                widen(s, r, dst);
            } else {
                let tmp = &mut scratch[..seg.len()];
                widen(s, r, tmp);
                elementwise::add_assign(dst, tmp);
            }
            at += seg.len();
        }
    }
    acc
}

/// Sums integer sources exactly (wrapping on overflow, like the hardware).
fn sum_ints<T: Element + Default>(
    dev: &CpuDevice,
    inputs: &[(&CpuStorage, usize)],
    segments: &[Range<usize>],
    total: usize,
    add: fn(T, T) -> T,
) -> Buffer<T> {
    let mut acc = dev.buffer_zeros::<T>(total);
    for (i, (s, base)) in inputs.iter().enumerate() {
        let src = s.as_slice::<T>().expect("collective checked the dtypes agree");
        let mut at = 0;
        for seg in segments {
            for (a, &x) in acc[at..at + seg.len()].iter_mut().zip(&src[base + seg.start..base + seg.end]) {
                *a = if i == 0 { x } else { add(*a, x) };
            }
            at += seg.len();
        }
    }
    acc
}
