use super::{Buffer, CpuDevice};
use crate::tensor::{DType, Element};
use half::{bf16, f16};
use std::any::Any;

/// The elements of one CPU tensor, typed by dtype.
pub enum CpuStorage {
    /// `f32` elements.
    F32(Buffer<f32>),
    /// `f64` elements.
    F64(Buffer<f64>),
    /// `bf16` elements.
    BF16(Buffer<bf16>),
    /// `f16` elements.
    F16(Buffer<f16>),
    /// `i32` elements.
    I32(Buffer<i32>),
    /// `u32` elements.
    U32(Buffer<u32>),
}

/// Applies `$body` to the buffer inside any variant, bound as `$b`.
macro_rules! with_buffer {
    ($s:expr, $b:ident => $body:expr) => {
        match $s {
            CpuStorage::F32($b) => $body,
            CpuStorage::F64($b) => $body,
            CpuStorage::BF16($b) => $body,
            CpuStorage::F16($b) => $body,
            CpuStorage::I32($b) => $body,
            CpuStorage::U32($b) => $body,
        }
    };
}

impl CpuStorage {
    /// The dtype of the elements.
    pub fn dtype(&self) -> DType {
        match self {
            CpuStorage::F32(_) => DType::F32,
            CpuStorage::F64(_) => DType::F64,
            CpuStorage::BF16(_) => DType::BF16,
            CpuStorage::F16(_) => DType::F16,
            CpuStorage::I32(_) => DType::I32,
            CpuStorage::U32(_) => DType::U32,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        with_buffer!(self, b => b.len())
    }

    /// Whether the storage holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `len` zeros of `dtype` on `dev`.
    pub fn zeros(dev: &CpuDevice, dtype: DType, len: usize) -> Self {
        match dtype {
            DType::F32 => CpuStorage::F32(dev.buffer_zeros(len)),
            DType::F64 => CpuStorage::F64(dev.buffer_zeros(len)),
            DType::BF16 => CpuStorage::BF16(dev.buffer_zeros(len)),
            DType::F16 => CpuStorage::F16(dev.buffer_zeros(len)),
            DType::I32 => CpuStorage::I32(dev.buffer_zeros(len)),
            DType::U32 => CpuStorage::U32(dev.buffer_zeros(len)),
        }
    }

    /// Wraps a tracked buffer of any element type.
    pub fn from_buffer<T: Element>(buf: Buffer<T>) -> Self {
        // The dtype ties T to exactly one variant; the downcast cannot fail.
        let mut slot = Some(buf);
        let any: &mut dyn Any = &mut slot;
        macro_rules! take {
            ($t:ty, $v:ident) => {
                CpuStorage::$v(any.downcast_mut::<Option<Buffer<$t>>>().and_then(Option::take).expect("dtype matches type"))
            };
        }
        match T::DTYPE {
            DType::F32 => take!(f32, F32),
            DType::F64 => take!(f64, F64),
            DType::BF16 => take!(bf16, BF16),
            DType::F16 => take!(f16, F16),
            DType::I32 => take!(i32, I32),
            DType::U32 => take!(u32, U32),
        }
    }

    /// The elements as `&[T]`, if `T` is this storage's element type.
    pub fn as_slice<T: Element>(&self) -> Option<&[T]> {
        if T::DTYPE != self.dtype() {
            return None;
        }
        with_buffer!(self, b => bytemuck::try_cast_slice::<_, T>(b).ok())
    }

    /// The elements as `&mut [T]`, if `T` is this storage's element type.
    pub fn as_mut_slice<T: Element>(&mut self) -> Option<&mut [T]> {
        if T::DTYPE != self.dtype() {
            return None;
        }
        with_buffer!(self, b => bytemuck::try_cast_slice_mut::<_, T>(b).ok())
    }

    /// The elements' bytes, whatever the dtype: for operations that move
    /// values without reading them (element `i` is bytes `i·size..(i+1)·size`).
    pub fn as_bytes(&self) -> &[u8] {
        with_buffer!(self, b => bytemuck::cast_slice(b))
    }

    /// The elements' bytes, writable (see [`as_bytes`](Self::as_bytes)).
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        with_buffer!(self, b => bytemuck::cast_slice_mut(b))
    }
}
