//! An op's element arithmetic as every backend runs it: one description,
//! whichever device the operands live on. The CPU backend runs
//! [`FloatKernel::run`] over its storages (`cpu::run_float`); the CUDA
//! backend calls [`FloatKernel::cuda`].

use crate::backend::cuda::CudaCall;
use crate::error::Result;
use crate::tensor::DType;
use tessera_kernels::cpu::mixed::{Dst, Src};
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

    /// Whether [`run_half`](Self::run_half) computes this op on a CPU when
    /// its primary input is `dtype` (bf16 or f16) and its inputs are stored
    /// as `inputs`. The operands are then read and written in their own
    /// dtype instead of being widened into whole f32 copies around
    /// [`run`](Self::run) and narrowed back.
    fn half(&self, _dtype: DType, _inputs: &[DType]) -> bool {
        false
    }

    /// The op on operands in their storage dtype (only called where
    /// [`half`](Self::half) said so): outputs of [`Out::Primary`] are in the
    /// primary input's dtype, those of [`Out::Compute`] f32. Where the op's
    /// f32 result rounded once to the output dtype is what [`run`](Self::run)
    /// gives after widening, this must give the same bits.
    fn run_half(&self, _inputs: &[Src<'_>], _outputs: Vec<Dst<'_>>) {
        unreachable!("run_half on a kernel without a half-precision form")
    }

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
