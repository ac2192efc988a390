//! Moving and summing elements between host tensors: the arithmetic of the
//! collectives that run on CPU threads (in-process and between processes).
//!
//! Every function reads its sources through their storage's read lock and
//! writes only into new buffers of the calling rank's device, so the bytes a
//! rank receives are counted where they land. Both backends sum with
//! [`reduce`], which is what makes their results the same bits.

use half::{bf16, f16};
use std::ops::Range;
use tessera_core::backend::cpu::Buffer;
use tessera_core::backend::{CpuDevice, CpuStorage, Device, Storage};
use tessera_core::tensor::{with_elem, DType, Element, Shape, Tensor};
use tessera_kernels::cpu::{cast, elementwise};

/// The CPU device a tensor lives on: communicators refuse CUDA devices when
/// they are made, and collectives refuse CUDA tensors at their first step.
pub(crate) fn cpu_device(d: &Device) -> &CpuDevice {
    match d {
        Device::Cpu(dev) => dev,
        Device::Cuda(_) => unreachable!("host collectives move host tensors only"),
    }
}

/// The storage range a contiguous tensor occupies.
fn range_of(t: &Tensor) -> Range<usize> {
    t.layout().contiguous_range().expect("collectives post contiguous tensors")
}

/// Wraps `storage` as a tensor of `shape` on `dev`.
pub(crate) fn wrap(storage: CpuStorage, shape: impl Into<Shape>, dev: &CpuDevice) -> Tensor {
    Tensor::from_cpu(storage, shape, dev)
}

/// A new storage on `dev` holding, in order, the elements `range` (counted
/// from the tensor's first element) of each piece's tensor. All pieces have
/// dtype `dtype` and are contiguous.
pub(crate) fn concat(dev: &CpuDevice, dtype: DType, pieces: &[(&Tensor, Range<usize>)]) -> CpuStorage {
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
/// `segments` (counted from each source's offset: its tensor's first element
/// plus the `usize`), concatenated, as new storage of `dtype` on `dev`.
///
/// Floats are summed in `f32` (`f64` for `f64`) and rounded to `dtype` once
/// at the end; integers wrap. The order of the additions is fixed by the
/// order of `sources`, so the result never depends on which thread runs it.
pub(crate) fn reduce(dev: &CpuDevice, dtype: DType, sources: &[(&Tensor, usize)], segments: &[Range<usize>]) -> CpuStorage {
    let total: usize = segments.iter().map(Range::len).sum();
    let guards: Vec<_> = sources.iter().map(|(t, _)| t.read()).collect();
    let inputs: Vec<(&CpuStorage, usize)> = guards
        .iter()
        .zip(sources)
        .map(|(g, (t, offset))| match &**g {
            Storage::Cpu(s) => (s, range_of(t).start + offset),
            Storage::Cuda(_) => unreachable!("host collectives move host tensors only"),
        })
        .collect();
    match dtype {
        DType::F32 => CpuStorage::F32(sum_direct::<f32>(dev, &inputs, segments, total)),
        DType::F64 => CpuStorage::F64(sum_direct::<f64>(dev, &inputs, segments, total)),
        DType::BF16 => {
            let acc = sum_widened(dev, &inputs, segments, total, |s, r, out| cast::bf16_to_f32(&s.as_slice::<bf16>().expect("bf16")[r], out));
            let mut out = dev.buffer_zeros::<bf16>(total);
            for (o, a) in out.chunks_mut(BLOCK).zip(acc.chunks(BLOCK)) {
                cast::f32_to_bf16(a, o);
            }
            CpuStorage::BF16(out)
        }
        DType::F16 => {
            let acc = sum_widened(dev, &inputs, segments, total, |s, r, out| cast::f16_to_f32(&s.as_slice::<f16>().expect("f16")[r], out));
            let mut out = dev.buffer_zeros::<f16>(total);
            for (o, a) in out.chunks_mut(BLOCK).zip(acc.chunks(BLOCK)) {
                cast::f32_to_f16(a, o);
            }
            CpuStorage::F16(out)
        }
        DType::I32 => CpuStorage::I32(sum_ints(dev, &inputs, segments, total, i32::wrapping_add)),
        DType::U32 => CpuStorage::U32(sum_ints(dev, &inputs, segments, total, u32::wrapping_add)),
    }
}

/// Elements per kernel call. The kernels go parallel above this size; here
/// the ranks already are the parallelism (one thread each), so every rank
/// keeps to its own thread instead of competing for the shared pool.
const BLOCK: usize = 1 << 15;

/// `acc += x` block by block, each block on the calling thread.
fn add_serial<T: tessera_kernels::Real>(acc: &mut [T], x: &[T]) {
    for (a, x) in acc.chunks_mut(BLOCK).zip(x.chunks(BLOCK)) {
        elementwise::add_assign(a, x);
    }
}

/// Sums sources already in the compute type: the first is copied, the others
/// added in place.
fn sum_direct<T: tessera_kernels::Real + Element>(dev: &CpuDevice, inputs: &[(&CpuStorage, usize)], segments: &[Range<usize>], total: usize) -> Buffer<T> {
    let slice = |i: usize, seg: &Range<usize>| {
        let (s, base) = inputs[i];
        &s.as_slice::<T>().expect("collective checked the dtypes agree")[base + seg.start..base + seg.end]
    };
    // Starting from a copy of the first input saves a zero-fill pass.
    let mut acc = Vec::with_capacity(total);
    for seg in segments {
        acc.extend_from_slice(slice(0, seg));
    }
    for i in 1..inputs.len() {
        let mut at = 0;
        for seg in segments {
            add_serial(&mut acc[at..at + seg.len()], slice(i, seg));
            at += seg.len();
        }
    }
    dev.buffer(acc)
}

/// Sums half-precision sources in `f32`, widening each block of every
/// segment into a scratch block before adding it.
fn sum_widened(
    dev: &CpuDevice,
    inputs: &[(&CpuStorage, usize)],
    segments: &[Range<usize>],
    total: usize,
    widen: impl Fn(&CpuStorage, Range<usize>, &mut [f32]),
) -> Buffer<f32> {
    let mut acc = dev.buffer_zeros::<f32>(total);
    let mut scratch = dev.buffer_zeros::<f32>(BLOCK.min(total));
    for (i, (s, base)) in inputs.iter().enumerate() {
        let mut at = 0;
        for seg in segments {
            for start in (seg.start..seg.end).step_by(BLOCK) {
                let end = (start + BLOCK).min(seg.end);
                let dst = &mut acc[at..at + end - start];
                let r = base + start..base + end;
                if i == 0 {
                    widen(s, r, dst);
                } else {
                    let tmp = &mut scratch[..end - start];
                    widen(s, r, tmp);
                    elementwise::add_assign(dst, tmp);
                }
                at += end - start;
            }
        }
    }
    acc
}

/// Sums integer sources exactly (wrapping on overflow, like the hardware).
fn sum_ints<T: Element + Default>(dev: &CpuDevice, inputs: &[(&CpuStorage, usize)], segments: &[Range<usize>], total: usize, add: fn(T, T) -> T) -> Buffer<T> {
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
