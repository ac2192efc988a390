//! An op's element arithmetic as every backend runs it: one description,
//! whichever device the operands live on. The CPU backend runs
//! [`FloatKernel::run`] over its storages (`cpu::run_float`); the CUDA
//! backend calls [`FloatKernel::cuda`].

use crate::backend::cuda::CudaCall;
use crate::error::Result;
use tessera_kernels::Real;

/// An op's arithmetic, written once over the compute type `T` for the CPU,
/// and, where the op has one, its CUDA implementation.
pub(crate) trait FloatKernel {
    /// Whether [`run`](Self::run) writes every element of every output. Then
    /// the outputs are handed over with stale contents instead of zeros;
    /// otherwise they start zeroed.
    const WRITES_ALL: bool = false;
    /// Reads `inputs` and writes `outputs` (lengths as the op requested).
    fn run<T: Real>(&self, inputs: &[&[T]], outputs: &mut [&mut [T]]);

    /// The same on a CUDA device: launches on `call`'s operands that write
    /// its outputs (same order, lengths and dtypes as [`run`](Self::run)'s;
    /// statistics of [`Out::Compute`] are `f32`). An op without one says so.
    fn cuda(&self, call: &mut CudaCall) -> Result<()> {
        call.unsupported()
    }
}

/// The dtype an output is stored in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Out {
    /// The dtype of the op's primary (first) input: activations keep their precision.
    Primary,
    /// The compute dtype (`f32`, or `f64` for `f64` ops): statistics saved for
    /// backward (means, log-sum-exps) and losses stay in full precision.
    Compute,
}
