//! Differentiable operations, each a forward and a hand-written backward.
//!
//! There is no tape: the layers (and the code the model macros generate) call
//! an op's forward, keep what its backward needs, and call the backward with
//! the upstream gradient. Every op validates its operands and returns a typed
//! error naming the problem before any kernel runs.
//!
//! Floating-point tensors of any dtype are accepted; half-precision operands
//! are computed in `f32` and results stored back in the operand's dtype,
//! while saved statistics and losses stay in `f32` (`f64` for `f64` inputs).

mod activation;
mod attention;
mod cuda_launch;
mod dropout;
mod elementwise;
mod embedding;
mod flops;
mod fp8;
#[cfg(test)]
mod half_tests;
mod loss;
mod matmul;
mod norm;
mod optim;
mod paged;
mod quant;
mod reduce;
mod rope;
mod softmax;
mod topk;

pub use activation::*;
pub use attention::*;
pub use dropout::*;
pub use elementwise::*;
pub use embedding::*;
pub use flops::flops_counted;
pub use fp8::*;
pub use loss::*;
pub use matmul::*;
pub use norm::*;
pub use optim::*;
pub use paged::*;
pub use quant::*;
pub use reduce::*;
pub use rope::*;
pub use softmax::*;
pub use topk::*;

use crate::backend::cpu;
use crate::backend::cuda::{self, CudaStorage};
use crate::backend::kernel::{FloatKernel, Out};
use crate::backend::{CpuStorage, Device, Storage};
use crate::error::{Error, Result};
use crate::tensor::{check_device, check_float, DType, Shape, Tensor};

/// Declares a kernel struct and its [`FloatKernel`] impl; the body sees the
/// struct as `$s`, the input slices as `$i` and the output slices as `$o`.
///
/// A leading `writes_all` declares that the body writes every element of
/// every output (see [`FloatKernel::WRITES_ALL`]); a kernel that leaves any
/// element unwritten must not say so, or it would return stale values.
///
/// A trailing `; cuda |s, c| body` is the op's CUDA implementation
/// ([`FloatKernel::cuda`]), with the struct as `s` and the
/// [`CudaCall`](crate::backend::cuda::CudaCall) as `c`; without it the op
/// returns `NotImplementedOnCuda` on a GPU.
///
/// A trailing `; half |s, dtype, dtypes| condition => |i, o| body` is its
/// form on half-precision CPU operands ([`FloatKernel::half`] and
/// [`FloatKernel::run_half`]): `condition` says for which primary dtype and
/// input dtypes it applies, `body` gets the inputs as
/// [`Src`](tessera_kernels::cpu::mixed::Src) views and the outputs as
/// [`Dst`](tessera_kernels::cpu::mixed::Dst) views. Without it,
/// half-precision operands are widened to f32 around `run`.
macro_rules! float_kernel {
    (writes_all $name:ident $(<$lt:lifetime>)? { $($f:ident : $t:ty),* $(,)? } |$s:ident, $i:ident, $o:ident| $body:expr $(; cuda |$cs:ident, $c:ident| $cuda:expr)? $(; half |$hs:ident, $hd:ident, $hdt:ident| $when:expr => |$hi:ident, $ho:ident| $hbody:expr)?) => {
        float_kernel!(@impl true, $name $(<$lt>)? { $($f : $t),* } |$s, $i, $o| $body $(; cuda |$cs, $c| $cuda)? $(; half |$hs, $hd, $hdt| $when => |$hi, $ho| $hbody)?);
    };
    ($name:ident $(<$lt:lifetime>)? { $($f:ident : $t:ty),* $(,)? } |$s:ident, $i:ident, $o:ident| $body:expr $(; cuda |$cs:ident, $c:ident| $cuda:expr)? $(; half |$hs:ident, $hd:ident, $hdt:ident| $when:expr => |$hi:ident, $ho:ident| $hbody:expr)?) => {
        float_kernel!(@impl false, $name $(<$lt>)? { $($f : $t),* } |$s, $i, $o| $body $(; cuda |$cs, $c| $cuda)? $(; half |$hs, $hd, $hdt| $when => |$hi, $ho| $hbody)?);
    };
    (@impl $all:expr, $name:ident $(<$lt:lifetime>)? { $($f:ident : $t:ty),* } |$s:ident, $i:ident, $o:ident| $body:expr $(; cuda |$cs:ident, $c:ident| $cuda:expr)? $(; half |$hs:ident, $hd:ident, $hdt:ident| $when:expr => |$hi:ident, $ho:ident| $hbody:expr)?) => {
        struct $name $(<$lt>)? { $($f: $t),* }
        impl $(<$lt>)? $crate::backend::kernel::FloatKernel for $name $(<$lt>)? {
            const WRITES_ALL: bool = $all;
            #[allow(unused_variables)]
            fn run<T: tessera_kernels::Real>(&self, $i: &[&[T]], $o: &mut [&mut [T]]) {
                let $s = self;
                $body
            }
            $(
                #[allow(unused_variables)]
                fn cuda(&self, $c: &mut $crate::backend::cuda::CudaCall) -> $crate::error::Result<()> {
                    let $cs = self;
                    $cuda
                }
            )?
            $(
                #[allow(unused_variables)]
                fn half(&self, $hd: $crate::tensor::DType, $hdt: &[$crate::tensor::DType]) -> bool {
                    let $hs = self;
                    $when
                }
                #[allow(unused_variables, unused_mut)]
                fn run_half(&self, $hi: &[tessera_kernels::cpu::mixed::Src<'_>], mut $ho: Vec<tessera_kernels::cpu::mixed::Dst<'_>>) {
                    let $hs = self;
                    $hbody
                }
            )?
        }
    };
}
pub(crate) use float_kernel;

/// Runs a float kernel on `inputs` (made contiguous first) and returns one
/// tensor per entry of `outputs`, each with its shape and storage dtype.
pub(crate) fn run<K: FloatKernel>(op: &'static str, kernel: &K, inputs: &[&Tensor], outputs: &[(Shape, Out)]) -> Result<Vec<Tensor>> {
    let first = inputs.first().expect("an op has at least one input");
    for t in inputs {
        check_float(op, t)?;
        check_device(op, first, t)?;
    }
    let contiguous: Vec<Tensor> = inputs.iter().map(|t| t.contiguous()).collect::<Result<_>>()?;
    let guards: Vec<_> = contiguous.iter().map(|t| t.read()).collect();
    let device = first.device().clone();
    let sizes: Vec<(usize, Out)> = outputs.iter().map(|(s, o)| (s.elem_count(), *o)).collect();
    let dev = match &device {
        Device::Cpu(dev) => dev,
        Device::Cuda(d) => {
            let operands: Vec<(&CudaStorage, std::ops::Range<usize>)> = guards
                .iter()
                .zip(&contiguous)
                .map(|(g, t)| match &**g {
                    Storage::Cuda(s) => Ok((s, t.layout().contiguous_range().expect("contiguous"))),
                    Storage::Cpu(_) => Err(Error::DeviceMismatch { op, lhs: device.to_string(), rhs: "cpu".into() }),
                })
                .collect::<Result<_>>()?;
            let results = cuda::run_op(op, d, first.dtype(), &operands, &sizes, K::WRITES_ALL, |c| kernel.cuda(c))?;
            return Ok(results.into_iter().zip(outputs).map(|(s, (shape, _))| Tensor::from_storage(Storage::Cuda(s), shape.clone(), device.clone())).collect());
        }
    };
    let operands: Vec<(&CpuStorage, std::ops::Range<usize>)> = guards
        .iter()
        .zip(&contiguous)
        .map(|(g, t)| match &**g {
            Storage::Cpu(s) => Ok((s, t.layout().contiguous_range().expect("contiguous"))),
            Storage::Cuda(_) => Err(Error::DeviceMismatch { op, lhs: device.to_string(), rhs: t.device().to_string() }),
        })
        .collect::<Result<_>>()?;
    let results = cpu::run_float(dev, kernel, first.dtype(), &operands, &sizes);
    Ok(results.into_iter().zip(outputs).map(|(s, (shape, _))| Tensor::from_cpu(s, shape.clone(), dev)).collect())
}

/// Like [`run`] for ops with exactly one output.
pub(crate) fn run1<K: FloatKernel>(op: &'static str, kernel: &K, inputs: &[&Tensor], shape: Shape, out: Out) -> Result<Tensor> {
    Ok(run(op, kernel, inputs, &[(shape, out)])?.pop().expect("one output"))
}

/// Runs `f` on the elements of a `u32` tensor (token ids, targets, indices).
pub(crate) fn with_u32<R>(op: &'static str, what: &'static str, t: &Tensor, f: impl FnOnce(&[u32]) -> Result<R>) -> Result<R> {
    if t.dtype() != DType::U32 {
        return Err(Error::DType { op, expected: "u32".into(), got: t.dtype(), hint: index_hint(what) });
    }
    let t = t.contiguous()?;
    let range = t.layout().contiguous_range().expect("contiguous");
    let g = t.read();
    match &*g {
        Storage::Cpu(s) => f(&s.as_slice::<u32>().expect("u32 checked")[range]),
        // The ops check every index on the host (a bad one is an error, not
        // a fault), so indices on a GPU are copied back first; their kernels
        // get them uploaded again.
        Storage::Cuda(s) => {
            let bytes = s.to_host_bytes()?;
            let all: Vec<u32> = bytes.chunks_exact(4).map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]])).collect();
            f(&all[range])
        }
    }
}

fn index_hint(what: &'static str) -> &'static str {
    match what {
        "ids" => " for token ids; convert them with `to_dtype(DType::U32)`",
        "targets" => " for targets; convert them with `to_dtype(DType::U32)`",
        _ => "; convert with `to_dtype(DType::U32)`",
    }
}

/// The number of rows of a tensor seen as `[rows, last_dim]`.
pub(crate) fn rows(t: &Tensor) -> usize {
    let last = t.dims().last().copied().unwrap_or(1);
    t.elem_count().checked_div(last).unwrap_or(0)
}
