//! Compute kernels of Tessera on raw, row-major buffers.
//!
//! This crate knows nothing of tensors, devices or memory accounting: every
//! kernel takes plain slices plus the sizes that describe them, writes its
//! results into caller-provided output slices, and is generic over [`Real`]
//! (`f32` for training, `f64` so gradient checks can run the very same code in
//! double precision). Half-precision data is converted to `f32` by the caller
//! (see [`cpu::cast`]); kernels never see `bf16`/`f16` arithmetic.
//!
//! Conventions shared by every kernel:
//! - buffers are contiguous and row-major; a "row" is the last dimension;
//! - forward kernels overwrite their outputs; backward kernels overwrite the
//!   gradients they produce unless their doc says they accumulate;
//! - sizes are checked with `assert!` (the runtime validates user input and
//!   turns mistakes into typed errors before any kernel runs);
//! - work is split over rows with `rayon` once it is large enough to pay for it.

pub mod cpu;
pub mod cuda;
pub mod desc;
mod real;
pub mod rng;

#[cfg(test)]
pub(crate) mod testing;

pub use real::Real;
