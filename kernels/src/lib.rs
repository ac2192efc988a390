//! Compute kernels of Tessera on raw, row-major buffers.
//!
//! This crate knows nothing of tensors, devices or memory accounting: every
//! kernel takes plain slices plus the sizes that describe them, writes its
//! results into caller-provided output slices, and is generic over [`Real`]
//! (`f32` for training, `f64` so gradient checks can run the very same code in
//! double precision). Half-precision data is computed in `f32` too: either
//! the caller converts it (see [`cpu::cast`]), or a kernel reads and writes
//! bf16/f16 storage itself, widening and rounding as it goes ([`cpu::mixed`],
//! the bf16 GEMM and attention entry points); the one place bf16 arithmetic
//! happens is the CPU's bf16 dot-product instruction, whose products are
//! exact and whose sums are f32.
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
