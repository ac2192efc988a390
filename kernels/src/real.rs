use num_traits::{Float, FromPrimitive, NumAssign};
use std::fmt::Debug;
use std::iter::Sum;

/// A floating-point element the CPU kernels compute in: `f32` or `f64`.
///
/// Kernels are written once, generically; production runs use `f32`, while
/// gradient checks instantiate the same code with `f64` so that central finite
/// differences are accurate enough to compare against.
pub trait Real: Float + FromPrimitive + NumAssign + Sum + Default + Debug + Send + Sync + 'static {
    /// Converts an `f64` constant into this type.
    fn lit(x: f64) -> Self;
    /// Converts to `f64` (exact for both implementations).
    fn to_f64_lossless(self) -> f64;
}

impl Real for f32 {
    #[inline(always)]
    fn lit(x: f64) -> Self {
        x as f32
    }
    #[inline(always)]
    fn to_f64_lossless(self) -> f64 {
        self as f64
    }
}

impl Real for f64 {
    #[inline(always)]
    fn lit(x: f64) -> Self {
        x
    }
    #[inline(always)]
    fn to_f64_lossless(self) -> f64 {
        self
    }
}
