//! Moving and summing elements between host tensors: the arithmetic of the
//! collectives that run on CPU threads (in-process and between processes).
//!
//! Every function reads its sources through their storage's read lock and
//! writes only into buffers of the calling rank's device, so the bytes a
//! rank receives are counted where they land. Every backend sums with
//! [`Summand`] (through [`reduce`], [`sum_into`] or [`sum_blocks`]), which is
//! what makes their results the same bits. Results come from the device's
//! pool of freed buffers when it holds one of their length (a training step
//! asks for the same lengths every time), and large ones are written past
//! the caches ([`streams`]).

use half::{bf16, f16};
use std::ops::Range;
use tessera_core::backend::cpu::Buffer;
use tessera_core::backend::{CpuDevice, CpuStorage, Device, Storage};
use tessera_core::tensor::{with_elem, DType, Element, Shape, Tensor};
use tessera_kernels::cpu::copy::copy_nontemporal;
use tessera_kernels::cpu::{cast, elementwise};

/// The CPU device a tensor lives on: communicators refuse CUDA devices when
/// they are made, and collectives refuse CUDA tensors at their first step.
pub(crate) fn cpu_device(d: &Device) -> &CpuDevice {
    match d {
        Device::Cpu(dev) => dev,
        Device::Cuda(_) => unreachable!("host collectives move host tensors only"),
    }
}

/// The CPU device of `t`, or the error a host collective gives a CUDA tensor
/// (`what`: the collectives that refuse it, and why).
pub(crate) fn host_device<'t>(t: &'t Tensor, what: &'static str) -> tessera_core::Result<&'t CpuDevice> {
    match t.device() {
        Device::Cpu(d) => Ok(d),
        Device::Cuda(d) => d.unsupported(what),
    }
}

/// The element range of part `i` when `len` elements are cut into `n`
/// near-equal parts: the chunk of an all-reduce that rank `i` sums, the
/// same on every backend.
pub(crate) fn chunk(len: usize, n: usize, i: usize) -> Range<usize> {
    i * len / n..(i + 1) * len / n
}

/// Why a reduce-scatter over `n` ranks cannot split `t` along `dim`, if it
/// cannot: the dimension must exist and be a multiple of `n`.
pub(crate) fn check_split(op: &'static str, t: &Tensor, dim: usize, n: usize) -> tessera_core::Result<()> {
    let d = t.shape().dim(op, dim)?;
    if !d.is_multiple_of(n) {
        return Err(tessera_core::Error::shape(
            op,
            format!("dimension {dim} of shape {} has size {d}, which does not split into {n} equal parts; pad it to a multiple of {n}", t.shape()),
        ));
    }
    Ok(())
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

fn concat_typed<T: Element + Default>(dev: &CpuDevice, pieces: &[(&Tensor, Range<usize>)]) -> Buffer<T> {
    let total = pieces.iter().map(|(_, r)| r.len()).sum();
    // A buffer of this length freed earlier (the previous step's result)
    // comes back from the pool as is: no zero-fill, no page faults.
    let mut out = dev.buffer_for_overwrite::<T>(total);
    let stream = streams(std::mem::size_of_val(&out[..]));
    let mut at = 0;
    for (t, r) in pieces {
        let guard = t.read();
        let src = &elements::<T>(t, &guard)[r.clone()];
        store(src, &mut out[at..at + r.len()], stream);
        at += r.len();
    }
    out
}

/// The elements of a contiguous host tensor, from its first one.
pub(crate) fn elements<'g, T: Element>(t: &Tensor, guard: &'g Storage) -> &'g [T] {
    let Storage::Cpu(s) = guard else { unreachable!("host collectives move host tensors only") };
    &s.as_slice::<T>().expect("collective checked the dtypes agree")[range_of(t)]
}

/// The elementwise sum over `sources` (in that order) of the elements
/// `segments` (counted from each source's offset: its tensor's first element
/// plus the `usize`), concatenated, as new storage of `dtype` on `dev`.
///
/// Floats are summed in `f32` (`f64` for `f64`) and rounded to `dtype` once
/// at the end; integers wrap. The order of the additions is fixed by the
/// order of `sources`, so the result never depends on which thread runs it.
pub(crate) fn reduce(dev: &CpuDevice, dtype: DType, sources: &[(&Tensor, usize)], segments: &[Range<usize>]) -> CpuStorage {
    with_elem!(dtype, T => CpuStorage::from_buffer(reduce_typed::<T>(dev, sources, segments)))
}

fn reduce_typed<T: Summand>(dev: &CpuDevice, sources: &[(&Tensor, usize)], segments: &[Range<usize>]) -> Buffer<T> {
    let total: usize = segments.iter().map(Range::len).sum();
    let guards: Vec<_> = sources.iter().map(|(t, _)| t.read()).collect();
    let inputs: Vec<&[T]> = guards.iter().zip(sources).map(|(g, (t, offset))| &elements::<T>(t, g)[*offset..]).collect();
    let mut out = dev.buffer_for_overwrite::<T>(total);
    let stream = streams(std::mem::size_of_val(&out[..]));
    let mut at = 0;
    for seg in segments {
        let srcs: Vec<&[T]> = inputs.iter().map(|s| &s[seg.clone()]).collect();
        if stream {
            sum_blocks(&srcs, |off, block| store(block, &mut out[at + off..at + off + block.len()], true));
        } else {
            sum_into(&srcs, &mut out[at..at + seg.len()]);
        }
        at += seg.len();
    }
    out
}

/// Results of at least this many bytes are written with non-temporal
/// stores (see [`streams`]).
const STREAM_BYTES: usize = 4 << 20;

/// Whether a collective writes a result of `bytes` bytes past the caches: a
/// result this large does not stay in the cache anyway, and an ordinary
/// store reads every cache line before writing it, so streaming stores move
/// a third less memory (what a large `memcpy` does too). Smaller results are
/// written through the cache, where the caller finds them.
pub(crate) fn streams(bytes: usize) -> bool {
    bytes >= STREAM_BYTES
}

/// Copies `src` to `dst`, past the caches when `stream` is set.
pub(crate) fn store<T: Copy>(src: &[T], dst: &mut [T], stream: bool) {
    if stream {
        copy_nontemporal(src, dst);
    } else {
        dst.copy_from_slice(src);
    }
}

/// Elements per block of a sum: every source's block, the `f32`
/// accumulator and the result stay in the core's L1/L2 cache while they are
/// added, so each source element is read from memory once and each result
/// element written once. Below the kernels' parallel threshold: the ranks
/// already are the parallelism (one thread each), so every rank keeps to its
/// own thread instead of competing for the shared pool.
pub(crate) const BLOCK: usize = 1 << 13;

/// Scratch of the half-precision sums: the `f32` accumulator and a widened source.
#[derive(Default)]
pub(crate) struct Scratch {
    acc: Vec<f32>,
    tmp: Vec<f32>,
}

impl Scratch {
    fn take(&mut self, len: usize) -> (&mut [f32], &mut [f32]) {
        if self.acc.len() < len {
            self.acc.resize(len, 0.0);
            self.tmp.resize(len, 0.0);
        }
        (&mut self.acc[..len], &mut self.tmp[..len])
    }
}

/// An element type the collectives sum, with the rule that fixes its bits.
pub(crate) trait Summand: Element + Default {
    /// `out = srcs[0] + srcs[1] + …` elementwise, added in this order in the
    /// compute type (`f32` for half types, the type itself otherwise) and
    /// rounded to `Self` once; integers wrap. At most [`BLOCK`] elements.
    fn sum(srcs: &[&[Self]], out: &mut [Self], scratch: &mut Scratch);
}

fn sum_real<T: tessera_kernels::Real>(srcs: &[&[T]], out: &mut [T]) {
    match srcs {
        [a] => out.copy_from_slice(a),
        [a, b, rest @ ..] => {
            elementwise::add(a, b, out);
            for x in rest {
                elementwise::add_assign(out, x);
            }
        }
        [] => unreachable!("a sum of no sources"),
    }
}

fn sum_half<T>(srcs: &[&[T]], out: &mut [T], scratch: &mut Scratch, widen: fn(&[T], &mut [f32]), narrow: fn(&[f32], &mut [T])) {
    let (acc, tmp) = scratch.take(out.len());
    widen(srcs[0], acc);
    for x in &srcs[1..] {
        widen(x, tmp);
        elementwise::add_assign(acc, tmp);
    }
    narrow(acc, out);
}

fn sum_int<T: Copy>(srcs: &[&[T]], out: &mut [T], add: fn(T, T) -> T) {
    out.copy_from_slice(srcs[0]);
    for x in &srcs[1..] {
        for (a, &v) in out.iter_mut().zip(*x) {
            *a = add(*a, v);
        }
    }
}

impl Summand for f32 {
    fn sum(srcs: &[&[f32]], out: &mut [f32], _: &mut Scratch) {
        sum_real(srcs, out)
    }
}

impl Summand for f64 {
    fn sum(srcs: &[&[f64]], out: &mut [f64], _: &mut Scratch) {
        sum_real(srcs, out)
    }
}

impl Summand for bf16 {
    fn sum(srcs: &[&[bf16]], out: &mut [bf16], scratch: &mut Scratch) {
        sum_half(srcs, out, scratch, cast::bf16_to_f32, cast::f32_to_bf16)
    }
}

impl Summand for f16 {
    fn sum(srcs: &[&[f16]], out: &mut [f16], scratch: &mut Scratch) {
        sum_half(srcs, out, scratch, cast::f16_to_f32, cast::f32_to_f16)
    }
}

impl Summand for i32 {
    fn sum(srcs: &[&[i32]], out: &mut [i32], _: &mut Scratch) {
        sum_int(srcs, out, i32::wrapping_add)
    }
}

impl Summand for u32 {
    fn sum(srcs: &[&[u32]], out: &mut [u32], _: &mut Scratch) {
        sum_int(srcs, out, u32::wrapping_add)
    }
}

/// `out = Σ srcs` elementwise (see [`Summand::sum`]), block by block; every
/// source has `out.len()` elements.
pub(crate) fn sum_into<T: Summand>(srcs: &[&[T]], out: &mut [T]) {
    let mut scratch = Scratch::default();
    let mut parts: Vec<&[T]> = Vec::with_capacity(srcs.len());
    for start in (0..out.len()).step_by(BLOCK) {
        let end = (start + BLOCK).min(out.len());
        parts.clear();
        parts.extend(srcs.iter().map(|s| &s[start..end]));
        T::sum(&parts, &mut out[start..end], &mut scratch);
    }
}

/// The sum of `srcs` (as [`sum_into`]), handed to `sink` block by block with
/// each block's offset: for a caller that writes every block to several
/// places while it is still in the cache.
pub(crate) fn sum_blocks<T: Summand>(srcs: &[&[T]], mut sink: impl FnMut(usize, &[T])) {
    let len = srcs.first().map_or(0, |s| s.len());
    let mut scratch = Scratch::default();
    let mut block = vec![T::default(); BLOCK.min(len)];
    let mut parts: Vec<&[T]> = Vec::with_capacity(srcs.len());
    for start in (0..len).step_by(BLOCK) {
        let end = (start + BLOCK).min(len);
        parts.clear();
        parts.extend(srcs.iter().map(|s| &s[start..end]));
        let out = &mut block[..end - start];
        T::sum(&parts, out, &mut scratch);
        sink(start, out);
    }
}
