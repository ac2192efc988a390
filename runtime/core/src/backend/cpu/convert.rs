use super::{CpuDevice, CpuStorage};
use crate::tensor::DType;
use std::ops::Range;
use tessera_kernels::cpu::cast;

/// Copies `src[range]` into new storage of dtype `to`.
///
/// Float conversions round to nearest-even; a conversion between two
/// non-`f32` float types goes through `f32`, which is exact for every source
/// type except `f64` (rounded once to `f32`, then to the target). Float to
/// integer truncates toward zero and saturates, as Rust's `as` does.
pub(crate) fn convert(dev: &CpuDevice, src: &CpuStorage, range: Range<usize>, to: DType) -> CpuStorage {
    use CpuStorage as S;
    match (src, to) {
        (S::F32(s), DType::F32) => S::F32(copied(dev, &s[range])),
        (S::F64(s), DType::F64) => S::F64(copied(dev, &s[range])),
        (S::BF16(s), DType::BF16) => S::BF16(copied(dev, &s[range])),
        (S::F16(s), DType::F16) => S::F16(copied(dev, &s[range])),
        (S::I32(s), DType::I32) => S::I32(copied(dev, &s[range])),
        (S::U32(s), DType::U32) => S::U32(copied(dev, &s[range])),
        (S::F32(s), _) => from_f32(dev, &s[range], to),
        (S::I32(s), DType::U32) => S::U32(dev.buffer(s[range].iter().map(|&x| x.max(0) as u32).collect())),
        (S::U32(s), DType::I32) => S::I32(dev.buffer(s[range].iter().map(|&x| x.min(i32::MAX as u32) as i32).collect())),
        (S::F64(s), DType::I32) => S::I32(dev.buffer(s[range].iter().map(|&x| x as i32).collect())),
        (S::F64(s), DType::U32) => S::U32(dev.buffer(s[range].iter().map(|&x| x as u32).collect())),
        // Widening to f32 is the last step: no copy of the widened buffer.
        (_, DType::F32) => S::F32(to_f32(dev, src, range)),
        _ => {
            let f32s = to_f32(dev, src, range);
            from_f32(dev, &f32s, to)
        }
    }
}

/// A tracked copy of `src`, in a buffer the pool may supply (every element
/// is overwritten, so a reused buffer needs no zeroing).
fn copied<T: bytemuck::Pod + Send>(dev: &CpuDevice, src: &[T]) -> super::Buffer<T> {
    let mut out = dev.buffer_for_overwrite(src.len());
    out.copy_from_slice(src);
    out
}

/// `src[range]` as tracked `f32` elements.
fn to_f32(dev: &CpuDevice, src: &CpuStorage, range: Range<usize>) -> super::Buffer<f32> {
    let mut out = dev.buffer_for_overwrite::<f32>(range.len());
    match src {
        CpuStorage::F32(s) => out.copy_from_slice(&s[range]),
        CpuStorage::F64(s) => cast::f64_to_f32(&s[range], &mut out),
        CpuStorage::BF16(s) => cast::bf16_to_f32(&s[range], &mut out),
        CpuStorage::F16(s) => cast::f16_to_f32(&s[range], &mut out),
        CpuStorage::I32(s) => out.iter_mut().zip(&s[range]).for_each(|(o, &x)| *o = x as f32),
        CpuStorage::U32(s) => out.iter_mut().zip(&s[range]).for_each(|(o, &x)| *o = x as f32),
    }
    out
}

fn from_f32(dev: &CpuDevice, src: &[f32], to: DType) -> CpuStorage {
    let n = src.len();
    match to {
        DType::F32 => CpuStorage::F32(copied(dev, src)),
        DType::F64 => {
            let mut out = dev.buffer_for_overwrite(n);
            cast::f32_to_f64(src, &mut out);
            CpuStorage::F64(out)
        }
        DType::BF16 => {
            let mut out = dev.buffer_for_overwrite(n);
            cast::f32_to_bf16(src, &mut out);
            CpuStorage::BF16(out)
        }
        DType::F16 => {
            let mut out = dev.buffer_for_overwrite(n);
            cast::f32_to_f16(src, &mut out);
            CpuStorage::F16(out)
        }
        DType::I32 => CpuStorage::I32(dev.buffer(src.iter().map(|&x| x as i32).collect())),
        DType::U32 => CpuStorage::U32(dev.buffer(src.iter().map(|&x| x as u32).collect())),
    }
}
