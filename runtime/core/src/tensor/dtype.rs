use half::{bf16, f16};
use std::fmt;

/// The element type of a tensor.
///
/// Floating-point tensors of any dtype are computed in `f32` (or `f64` for
/// `F64`, used by gradient checks); `BF16` and `F16` are storage formats.
/// `I32` and `U32` hold token ids, targets and indices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// 64-bit IEEE float.
    F64,
    /// 16-bit brain float (8-bit exponent, as `f32`).
    BF16,
    /// 16-bit IEEE float.
    F16,
    /// 32-bit signed integer.
    I32,
    /// 32-bit unsigned integer.
    U32,
}

impl DType {
    /// Bytes per element.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F64 => 8,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::BF16 | DType::F16 => 2,
        }
    }

    /// Whether the dtype is a floating-point type.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::BF16 | DType::F16)
    }

    /// Whether the dtype is a 16-bit float (bf16 or f16), whose values need
    /// a full-precision master copy to be trained.
    pub fn is_half(self) -> bool {
        matches!(self, DType::BF16 | DType::F16)
    }

    /// The lower-case name used in messages and file formats (`f32`, `bf16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::I32 => "i32",
            DType::U32 => "u32",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A Rust type that can be the element of a tensor.
pub trait Element: bytemuck::Pod + Send + Sync + fmt::Debug + 'static {
    /// The dtype of tensors holding this type.
    const DTYPE: DType;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for f64 {
    const DTYPE: DType = DType::F64;
}
impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
}
impl Element for f16 {
    const DTYPE: DType = DType::F16;
}
impl Element for i32 {
    const DTYPE: DType = DType::I32;
}
impl Element for u32 {
    const DTYPE: DType = DType::U32;
}

/// Runs `$body` with `$t` bound to the Rust element type of `$dtype`: the one
/// place that maps each dtype to its type, for code generic over [`Element`].
#[macro_export]
macro_rules! with_elem {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            $crate::tensor::DType::F32 => {
                type $t = f32;
                $body
            }
            $crate::tensor::DType::F64 => {
                type $t = f64;
                $body
            }
            $crate::tensor::DType::BF16 => {
                type $t = $crate::bf16;
                $body
            }
            $crate::tensor::DType::F16 => {
                type $t = $crate::f16;
                $body
            }
            $crate::tensor::DType::I32 => {
                type $t = i32;
                $body
            }
            $crate::tensor::DType::U32 => {
                type $t = u32;
                $body
            }
        }
    };
}
