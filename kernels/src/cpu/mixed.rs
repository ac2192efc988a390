//! Kernels on operands stored in half precision (bf16, f16) or f32,
//! computed in f32 a cache-sized block at a time.
//!
//! Half-precision storage with f32 arithmetic used to mean: widen every
//! input into a whole f32 copy, run the f32 kernel, narrow every output
//! from a whole f32 copy. For a point-wise op on a bf16 activation that is
//! five passes over memory (two widenings, the op, the narrowing, and the op
//! reading f32) moving about 30 bytes per element where the op itself needs
//! 6, plus three tensor-sized temporaries. Here each operand is widened a
//! block of [`BLOCK`] elements at a time into scratch that stays in L1/L2,
//! the unchanged f32 kernel runs on the block, and its results are rounded
//! straight into the half-precision output: one pass over memory, the same
//! arithmetic.
//!
//! Results are bit-identical to the whole-tensor path for every kernel whose
//! values for one element (or one row) do not depend on how the rows are
//! grouped: widening is exact, the f32 arithmetic is the same code on the
//! same values, and the narrowing rounds to nearest even exactly as
//! [`cast`](super::cast) does.

use super::elementwise::PAR_CHUNK;
use super::wide::widest;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rayon::prelude::*;
use std::ops::Range;

/// Elements of each operand widened at once: a block of every operand of a
/// kernel with a few inputs and outputs fits in the 32 KiB L1 and 1 MiB L2,
/// and the per-block bookkeeping is small next to the block's work.
pub const BLOCK: usize = 2048;

/// A type a kernel's operands may be stored in while it computes in `T`:
/// `T` itself, or bf16 for f32. Kernels generic over it read every element
/// through [`load`](Self::load) and write through [`store`](Self::store), so
/// on bf16 storage they widen and round as they go instead of working on
/// widened copies of whole tensors.
pub trait Stored<T>: Copy + Send + Sync + 'static {
    /// The value in the compute type (exact).
    fn load(self) -> T;
    /// `v` rounded to this type (to nearest even, as the casts round).
    fn store(v: T) -> Self;
    /// The elements themselves when they already are of the compute type
    /// (so a kernel can read them in place rather than through a copy).
    fn as_compute(x: &[Self]) -> Option<&[T]>;
}

impl<T: crate::Real> Stored<T> for T {
    #[inline(always)]
    fn load(self) -> T {
        self
    }
    #[inline(always)]
    fn store(v: T) -> T {
        v
    }
    #[inline(always)]
    fn as_compute(x: &[T]) -> Option<&[T]> {
        Some(x)
    }
}

impl Stored<f32> for bf16 {
    #[inline(always)]
    fn load(self) -> f32 {
        f32_of(self)
    }
    #[inline(always)]
    fn store(v: f32) -> bf16 {
        bf16_of(v)
    }
    #[inline(always)]
    fn as_compute(_: &[bf16]) -> Option<&[f32]> {
        None
    }
}

/// A read-only operand, in the type it is stored in.
#[derive(Clone, Copy, Debug)]
pub enum Src<'a> {
    /// Stored as f32: read in place.
    F32(&'a [f32]),
    /// Stored as bfloat16.
    BF16(&'a [bf16]),
    /// Stored as IEEE half precision.
    F16(&'a [f16]),
}

impl<'a> Src<'a> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Src::F32(x) => x.len(),
            Src::BF16(x) => x.len(),
            Src::F16(x) => x.len(),
        }
    }

    /// Whether the operand has no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements in `r`.
    pub fn slice(&self, r: Range<usize>) -> Src<'a> {
        match *self {
            Src::F32(x) => Src::F32(&x[r]),
            Src::BF16(x) => Src::BF16(&x[r]),
            Src::F16(x) => Src::F16(&x[r]),
        }
    }

    /// The elements as f32: borrowed when they are stored as f32, otherwise
    /// widened (exactly) into `scratch`, which must be at least as long.
    pub fn read<'s>(self, scratch: &'s mut [f32]) -> &'s [f32]
    where
        'a: 's,
    {
        match self {
            Src::F32(x) => x,
            Src::BF16(x) => {
                let out = &mut scratch[..x.len()];
                widen_bf16(x, out);
                out
            }
            Src::F16(x) => {
                let out = &mut scratch[..x.len()];
                x.convert_to_f32_slice(out);
                out
            }
        }
    }

    /// Asks the CPU to start loading the elements in `r` into the caches (a
    /// hint; no effect off x86-64). [`blocked`] calls it for the next block
    /// while the current one computes: its short bursts of reads would
    /// otherwise wait on memory at the start of every block.
    pub fn prefetch(&self, r: Range<usize>) {
        #[cfg(target_arch = "x86_64")]
        {
            fn span<T>(x: &[T]) -> (*const i8, usize) {
                (x.as_ptr() as *const i8, std::mem::size_of_val(x))
            }
            let (ptr, bytes) = match *self {
                Src::F32(x) => span(&x[r]),
                Src::BF16(x) => span(&x[r]),
                Src::F16(x) => span(&x[r]),
            };
            for off in (0..bytes).step_by(64) {
                // SAFETY: a prefetch is a hint that never faults and reads
                // nothing into registers (SSE, part of every x86-64); the
                // address lies inside the slice anyway.
                unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(ptr.wrapping_add(off)) };
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = r;
    }

    /// The elements when they are stored as f32.
    pub fn as_f32(&self) -> Option<&'a [f32]> {
        match *self {
            Src::F32(x) => Some(x),
            _ => None,
        }
    }

    /// The elements when they are stored as bf16.
    pub fn as_bf16(&self) -> Option<&'a [bf16]> {
        match *self {
            Src::BF16(x) => Some(x),
            _ => None,
        }
    }

    /// The whole operand as f32 (borrowed, or widened into a new vector):
    /// for small operands every block reads, such as a norm's gain.
    pub fn to_f32(&self) -> std::borrow::Cow<'a, [f32]> {
        match *self {
            Src::F32(x) => std::borrow::Cow::Borrowed(x),
            _ => {
                let mut v = vec![0f32; self.len()];
                self.read(&mut v);
                std::borrow::Cow::Owned(v)
            }
        }
    }
}

/// An output, in the type it is stored in.
#[derive(Debug)]
pub enum Dst<'a> {
    /// Stored as f32: written in place.
    F32(&'a mut [f32]),
    /// Stored as bfloat16.
    BF16(&'a mut [bf16]),
    /// Stored as IEEE half precision.
    F16(&'a mut [f16]),
}

impl<'a> Dst<'a> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Dst::F32(x) => x.len(),
            Dst::BF16(x) => x.len(),
            Dst::F16(x) => x.len(),
        }
    }

    /// Whether the output has no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements in `r`, reborrowed.
    pub fn slice_mut(&mut self, r: Range<usize>) -> Dst<'_> {
        match self {
            Dst::F32(x) => Dst::F32(&mut x[r]),
            Dst::BF16(x) => Dst::BF16(&mut x[r]),
            Dst::F16(x) => Dst::F16(&mut x[r]),
        }
    }

    /// The elements when they are stored as f32.
    pub fn as_f32(&mut self) -> Option<&mut [f32]> {
        match self {
            Dst::F32(x) => Some(x),
            _ => None,
        }
    }

    /// The elements when they are stored as bf16.
    pub fn as_bf16(&mut self) -> Option<&mut [bf16]> {
        match self {
            Dst::BF16(x) => Some(x),
            _ => None,
        }
    }

    /// Cuts the output into consecutive pieces of `size` elements (the last
    /// may be shorter), each owning its elements.
    pub fn into_chunks(self, size: usize) -> Vec<Dst<'a>> {
        let size = size.max(1);
        match self {
            Dst::F32(x) => x.chunks_mut(size).map(Dst::F32).collect(),
            Dst::BF16(x) => x.chunks_mut(size).map(Dst::BF16).collect(),
            Dst::F16(x) => x.chunks_mut(size).map(Dst::F16).collect(),
        }
    }

    /// Rounds `src` (f32 values, as long as this output) into the output,
    /// or copies them when it is f32.
    pub fn store(&mut self, src: &[f32]) {
        match self {
            Dst::F32(x) => x.copy_from_slice(src),
            Dst::BF16(x) => narrow_bf16(src, x),
            Dst::F16(x) => x.convert_from_f32_slice(src),
        }
    }
}

/// Widens bf16 to f32 (exact: the bits move to the top half of the word).
pub(crate) fn widen_bf16(src: &[bf16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "source and destination lengths differ");
    widest(
        #[inline(always)]
        || {
            for (d, &s) in dst.iter_mut().zip(src) {
                *d = f32_of(s);
            }
        },
    )
}

/// Narrows f32 to bf16, to nearest even, bit-identical to
/// `half::bf16::from_f32` (tested): NaN stays a quiet NaN with its sign and
/// top payload bits, overflow gives infinity, denormals are rounded.
/// Branch-free, so the loop vectorises.
pub(crate) fn narrow_bf16(src: &[f32], dst: &mut [bf16]) {
    assert_eq!(src.len(), dst.len(), "source and destination lengths differ");
    widest(
        #[inline(always)]
        || {
            for (d, &s) in dst.iter_mut().zip(src) {
                *d = bf16_of(s);
            }
        },
    )
}

/// The bf16 bits nearest (ties to even) to the f32 with bits `x`.
#[inline(always)]
fn round_bf16_bits(x: u32) -> u16 {
    // Adding 0x7fff plus the lowest kept bit carries into the kept half
    // exactly when the dropped half is above a tie, or a tie with an odd
    // kept half. A NaN is truncated instead, with its quiet bit set (its
    // payload could carry into the sign). Masks rather than a select keep
    // the whole computation in 32-bit lanes, which vectorises better.
    let nan = 0u32.wrapping_sub(((x & 0x7fff_ffff) > 0x7f80_0000) as u32);
    let bias = (0x7fff + ((x >> 16) & 1)) & !nan;
    ((x | (0x0040_0000 & nan)).wrapping_add(bias) >> 16) as u16
}

/// `out[i] = f(x[i])` with the operand and the result stored in whatever
/// types `x` and `out` are: on bf16 storage each element is widened, mapped
/// and rounded in registers (a vectorised loop, one pass over memory);
/// otherwise through [`map`]'s blocks. The same bits either way, and as
/// widening every element, mapping in f32 and rounding once.
pub fn map1(x: Src<'_>, out: Dst<'_>, f: impl Fn(f32) -> f32 + Sync + Send + Copy) {
    assert_eq!(x.len(), out.len(), "input and output lengths differ");
    match (x, out) {
        (Src::BF16(x), Dst::BF16(out)) => par_chunks(out, |o, off| {
            let x = &x[off..off + o.len()];
            widest(
                #[inline(always)]
                || {
                    for (o, &v) in o.iter_mut().zip(x) {
                        *o = bf16_of(f(f32_of(v)));
                    }
                },
            )
        }),
        (x, out) => map(&[x], out, |i, o| {
            widest(
                #[inline(always)]
                || {
                    for (o, &v) in o.iter_mut().zip(i[0]) {
                        *o = f(v);
                    }
                },
            )
        }),
    }
}

/// `out[i] = f(a[i], b[i])` on operands stored in any float type: see [`map1`].
pub fn map2(a: Src<'_>, b: Src<'_>, out: Dst<'_>, f: impl Fn(f32, f32) -> f32 + Sync + Send + Copy) {
    assert_eq!(a.len(), out.len(), "first input and output lengths differ");
    assert_eq!(b.len(), out.len(), "second input and output lengths differ");
    match (a, b, out) {
        (Src::BF16(a), Src::BF16(b), Dst::BF16(out)) => par_chunks(out, |o, off| {
            let (a, b) = (&a[off..off + o.len()], &b[off..off + o.len()]);
            widest(
                #[inline(always)]
                || {
                    for ((o, &x), &y) in o.iter_mut().zip(a).zip(b) {
                        *o = bf16_of(f(f32_of(x), f32_of(y)));
                    }
                },
            )
        }),
        (a, b, out) => map(&[a, b], out, |i, o| {
            widest(
                #[inline(always)]
                || {
                    for ((o, &x), &y) in o.iter_mut().zip(i[0]).zip(i[1]) {
                        *o = f(x, y);
                    }
                },
            )
        }),
    }
}

/// Runs `f(chunk, offset)` over [`PAR_CHUNK`]-element pieces of `out`, in
/// parallel once there is more than one.
fn par_chunks<T: Send>(out: &mut [T], f: impl Fn(&mut [T], usize) + Sync + Send) {
    if out.len() <= PAR_CHUNK {
        f(out, 0);
    } else {
        out.par_chunks_mut(PAR_CHUNK).enumerate().for_each(|(c, o)| f(o, c * PAR_CHUNK));
    }
}

/// A bf16 value as f32 (exact).
#[inline(always)]
pub(crate) fn f32_of(v: bf16) -> f32 {
    f32::from_bits((v.to_bits() as u32) << 16)
}

/// The bf16 nearest to `v` (ties to even), as [`narrow_bf16`] rounds.
#[inline(always)]
pub(crate) fn bf16_of(v: f32) -> bf16 {
    bf16::from_bits(round_bf16_bits(v.to_bits()))
}

/// `out = f(ins)` element-wise, where `f` is an f32 kernel on buffers of
/// equal length and every input has the output's length.
pub fn map(ins: &[Src<'_>], out: Dst<'_>, f: impl Fn(&[&[f32]], &mut [f32]) + Sync) {
    let cut: Vec<(Src<'_>, Cut)> = ins.iter().map(|&s| (s, Cut::Units(1))).collect();
    blocked(out.len(), &cut, vec![(out, 1)], |_, i, o| f(i, o[0]))
}

thread_local! {
    /// Block scratch of [`blocked`], kept per thread; taken out while in use
    /// (a nested call on the same thread finds it empty and allocates).
    static SCRATCH: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Cuts `buf` into consecutive pieces of the given lengths.
fn split_lens<'b>(mut buf: &'b mut [f32], lens: &[usize]) -> Vec<&'b mut [f32]> {
    lens.iter()
        .map(|&l| {
            let (head, tail) = std::mem::take(&mut buf).split_at_mut(l);
            buf = tail;
            head
        })
        .collect()
}

/// How an operand of [`blocked`] is cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cut {
    /// `units × width` elements: each block gets the elements of its units.
    Units(usize),
    /// Passed whole to every block (a norm's gain, a bias).
    Whole,
}

/// Runs `block` over consecutive blocks of whole units (rows, or single
/// elements for a point-wise op), in parallel tasks once the operands are
/// large.
///
/// `units` is the number of units; each input is cut as its [`Cut`] says,
/// and each output `(dst, width)` holds `units × width` elements. `block`
/// gets, for one block of units, every input as f32 (in the order given)
/// and every output as an f32 buffer to fill completely; values are widened
/// and rounded around it as [`Src::read`] and [`Dst::store`] do. A block
/// spans about [`BLOCK`] elements of the widest operand, and at least one
/// unit.
///
/// `block` must compute each unit's outputs from that unit's inputs (and the
/// whole ones) alone: then the results do not depend on the blocking or on
/// the number of threads.
pub fn blocked(units: usize, ins: &[(Src<'_>, Cut)], outs: Vec<(Dst<'_>, usize)>, block: impl Fn(usize, &[&[f32]], &mut [&mut [f32]]) + Sync) {
    for (i, (s, cut)) in ins.iter().enumerate() {
        if let Cut::Units(w) = cut {
            assert_eq!(s.len(), units * w, "blocked: input {i} has {} elements, not {units} × {w}", s.len());
        }
    }
    for (i, (d, w)) in outs.iter().enumerate() {
        assert_eq!(d.len(), units * w, "blocked: output {i} has {} elements, not {units} × {w}", d.len());
    }
    if units == 0 {
        return;
    }
    let widest_unit =
        ins.iter().filter_map(|(_, c)| if let Cut::Units(w) = c { Some(*w) } else { None }).chain(outs.iter().map(|(_, w)| *w)).max().unwrap_or(1).max(1);
    let per_block = (BLOCK / widest_unit).max(1);
    let per_task = (PAR_CHUNK / widest_unit).max(1).next_multiple_of(per_block);
    let wholes: Vec<Option<std::borrow::Cow<'_, [f32]>>> = ins.iter().map(|(s, c)| (*c == Cut::Whole).then(|| s.to_f32())).collect();
    let widths: Vec<usize> = outs.iter().map(|(_, w)| *w).collect();

    let run_task = |t0: usize, mut task_outs: Vec<Dst<'_>>| {
        let t_units = (units - t0).min(per_task);
        // Scratch for one block of every cut input and every output, taken
        // from this thread's buffer (reused from call to call, so a small op
        // neither allocates nor zeroes its scratch).
        let in_lens: Vec<usize> = ins.iter().map(|(_, c)| if let Cut::Units(w) = c { per_block * w } else { 0 }).collect();
        let out_lens: Vec<usize> = widths.iter().map(|w| per_block * w).collect();
        let mut buf = SCRATCH.with(std::cell::Cell::take);
        let need: usize = in_lens.iter().chain(&out_lens).sum();
        if buf.len() < need {
            buf = vec![0f32; need];
        }
        let (in_all, out_all) = buf[..need].split_at_mut(in_lens.iter().sum());
        let mut in_scratch = split_lens(in_all, &in_lens);
        let mut out_scratch = split_lens(out_all, &out_lens);
        for b0 in (0..t_units).step_by(per_block) {
            let n = per_block.min(t_units - b0);
            let u0 = t0 + b0;
            let next = (u0 + n)..(u0 + n + per_block).min(t0 + t_units);
            for (src, cut) in ins {
                if let Cut::Units(w) = cut {
                    src.prefetch(next.start * w..next.end * w);
                }
            }
            let inputs: Vec<&[f32]> = ins
                .iter()
                .zip(in_scratch.iter_mut())
                .zip(&wholes)
                .map(|(((s, c), scratch), whole)| match (c, whole) {
                    (Cut::Units(w), _) => s.slice(u0 * w..(u0 + n) * w).read(&mut scratch[..]),
                    (Cut::Whole, Some(v)) => &v[..],
                    (Cut::Whole, None) => unreachable!("whole inputs are widened up front"),
                })
                .collect();
            // Outputs: the block's elements, written in place when f32,
            // otherwise into scratch that is rounded into them afterwards.
            let mut views: Vec<Dst<'_>> = task_outs.iter_mut().zip(&widths).map(|(d, w)| d.slice_mut(b0 * w..(b0 + n) * w)).collect();
            let mut bufs: Vec<&mut [f32]> = views
                .iter_mut()
                .zip(out_scratch.iter_mut())
                .map(|(view, scratch)| match view {
                    Dst::F32(x) => &mut **x,
                    other => {
                        let len = other.len();
                        &mut scratch[..len]
                    }
                })
                .collect();
            block(u0, &inputs, &mut bufs);
            drop(bufs);
            for (view, scratch) in views.iter_mut().zip(&out_scratch) {
                if !matches!(view, Dst::F32(_)) {
                    let len = view.len();
                    view.store(&scratch[..len]);
                }
            }
        }
        drop((in_scratch, out_scratch));
        SCRATCH.with(|s| s.set(buf));
    };

    let total: usize = ins.iter().map(|(s, _)| s.len()).sum::<usize>() + outs.iter().map(|(d, _)| d.len()).sum::<usize>();
    if units <= per_task || total <= PAR_CHUNK {
        let task_outs = outs.into_iter().map(|(d, _)| d).collect();
        run_task(0, task_outs);
    } else {
        // Cut every output at the task boundaries, then hand each task its pieces.
        let tasks = units.div_ceil(per_task);
        let mut per: Vec<Vec<Dst<'_>>> = (0..tasks).map(|_| Vec::with_capacity(outs.len())).collect();
        for (d, w) in outs {
            for (t, piece) in d.into_chunks(per_task * w).into_iter().enumerate() {
                per[t].push(piece);
            }
        }
        per.into_par_iter().enumerate().for_each(|(t, o)| run_task(t * per_task, o));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::{activation, elementwise, norm, softmax};
    use crate::testing::rand_vec;

    /// Random f32 bit patterns of every class, plus the edge cases of rounding.
    fn awkward_f32(n: usize) -> Vec<f32> {
        let mut s = 0x2545_F491_4F6C_DD1Du64;
        let mut v: Vec<f32> = (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                f32::from_bits(s as u32)
            })
            .collect();
        v.extend(
            [
                0x3F80_8000u32,
                0x3F81_8000,
                0x7F7F_FFFF,
                0xFF7F_FFFF,
                0x7F80_0000,
                0xFF80_0000,
                0x7FFF_FFFF,
                0xFFC0_0001,
                0x0000_8000,
                0x0001_8000,
                0x8000_0000,
                0,
            ]
            .map(f32::from_bits),
        );
        v
    }

    #[test]
    fn narrowing_matches_half_bit_for_bit() {
        let x = awkward_f32(1 << 18);
        let mut got = vec![bf16::ZERO; x.len()];
        narrow_bf16(&x, &mut got);
        for (v, g) in x.iter().zip(&got) {
            assert_eq!(g.to_bits(), bf16::from_f32(*v).to_bits(), "bf16 of {:#010x}", v.to_bits());
        }
        let mut back = vec![0f32; x.len()];
        widen_bf16(&got, &mut back);
        assert!(got.iter().zip(&back).all(|(h, w)| h.to_f32().to_bits() == w.to_bits()));
    }

    /// The whole-tensor path these kernels replace: widen every input, run
    /// the f32 kernel, round the output with `half`.
    fn reference<H: Copy>(ins: &[&[H]], to: fn(H) -> f32, from: fn(f32) -> H, f: impl Fn(&[&[f32]], &mut [f32])) -> Vec<H> {
        let wide: Vec<Vec<f32>> = ins.iter().map(|x| x.iter().map(|&v| to(v)).collect()).collect();
        let refs: Vec<&[f32]> = wide.iter().map(|v| &v[..]).collect();
        let mut out = vec![0f32; ins[0].len()];
        f(&refs, &mut out);
        out.into_iter().map(from).collect()
    }

    /// The bits of `x`, every NaN as one canonical NaN: which sign and
    /// payload a NaN result carries is left to the instructions (a vector
    /// and a scalar path may differ), and means nothing.
    fn bits16<H: Copy>(x: &[H], bits: fn(H) -> u16, is_nan: fn(H) -> bool) -> Vec<u16> {
        x.iter().map(|&v| if is_nan(v) { 0x7FFF } else { bits(v) }).collect()
    }

    #[test]
    fn point_wise_ops_give_the_bits_of_the_widening_path() {
        // Longer than one parallel chunk, not a multiple of anything.
        let n = 2 * PAR_CHUNK + 1234;
        let mut a32: Vec<f32> = rand_vec(1, n).iter().map(|&v| 6.0 * v as f32).collect();
        let b32: Vec<f32> = rand_vec(2, n).iter().map(|&v| 3.0 * v as f32).collect();
        a32[..12].copy_from_slice(&[f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -0.0, 1e30, -1e30, 65504.0, 1e-6, -88.0, 88.0, 1e-40, 3.0]);
        let (ah, bh): (Vec<bf16>, Vec<bf16>) = (a32.iter().map(|&v| bf16::from_f32(v)).collect(), b32.iter().map(|&v| bf16::from_f32(v)).collect());
        let (af, bf): (Vec<f16>, Vec<f16>) = (a32.iter().map(|&v| f16::from_f32(v)).collect(), b32.iter().map(|&v| f16::from_f32(v)).collect());
        type Unary = (&'static str, fn(Src<'_>, Dst<'_>), fn(&[f32], &mut [f32]));
        type Binary = (&'static str, fn(Src<'_>, Src<'_>, Dst<'_>), fn(&[f32], &[f32], &mut [f32]));
        let unary: [Unary; 3] = [
            ("gelu", activation::gelu_forward_mixed, activation::gelu_forward),
            ("silu", activation::silu_forward_mixed, activation::silu_forward),
            ("scale", |x, o| elementwise::scale_mixed(x, -0.37, o), |x, o| elementwise::scale(x, -0.37, o)),
        ];
        let binary: [Binary; 6] = [
            ("add", elementwise::add_mixed, elementwise::add),
            ("sub", elementwise::sub_mixed, elementwise::sub),
            ("mul", elementwise::mul_mixed, elementwise::mul),
            ("gelu_backward", activation::gelu_backward_mixed, activation::gelu_backward),
            ("silu_backward", activation::silu_backward_mixed, activation::silu_backward),
            ("swiglu", activation::swiglu_forward_mixed, activation::swiglu_forward),
        ];
        for (name, mixed, f32_kernel) in unary {
            let want = reference(&[&ah], bf16::to_f32, bf16::from_f32, |i, o| f32_kernel(i[0], o));
            let mut got = vec![bf16::ZERO; n];
            mixed(Src::BF16(&ah), Dst::BF16(&mut got));
            assert_eq!(bits16(&got, bf16::to_bits, bf16::is_nan), bits16(&want, bf16::to_bits, bf16::is_nan), "{name} bf16");
            let want = reference(&[&af], f16::to_f32, f16::from_f32, |i, o| f32_kernel(i[0], o));
            let mut got = vec![f16::ZERO; n];
            mixed(Src::F16(&af), Dst::F16(&mut got));
            assert_eq!(bits16(&got, f16::to_bits, f16::is_nan), bits16(&want, f16::to_bits, f16::is_nan), "{name} f16");
        }
        for (name, mixed, f32_kernel) in binary {
            let want = reference(&[&ah, &bh], bf16::to_f32, bf16::from_f32, |i, o| f32_kernel(i[0], i[1], o));
            let mut got = vec![bf16::ZERO; n];
            mixed(Src::BF16(&ah), Src::BF16(&bh), Dst::BF16(&mut got));
            assert_eq!(bits16(&got, bf16::to_bits, bf16::is_nan), bits16(&want, bf16::to_bits, bf16::is_nan), "{name} bf16");
            let want = reference(&[&af, &bf], f16::to_f32, f16::from_f32, |i, o| f32_kernel(i[0], i[1], o));
            let mut got = vec![f16::ZERO; n];
            mixed(Src::F16(&af), Src::F16(&bf), Dst::F16(&mut got));
            assert_eq!(bits16(&got, f16::to_bits, f16::is_nan), bits16(&want, f16::to_bits, f16::is_nan), "{name} f16");
            // A bf16 operand with an f32 one, into an f32 output: no rounding at all.
            let mut got = vec![0f32; n];
            mixed(Src::BF16(&ah), Src::F32(&b32), Dst::F32(&mut got));
            let wide: Vec<f32> = ah.iter().map(|v| v.to_f32()).collect();
            let mut want = vec![0f32; n];
            f32_kernel(&wide, &b32, &mut want);
            assert!(got.iter().zip(&want).all(|(g, w)| g.to_bits() == w.to_bits()), "{name} bf16 with f32");
        }
    }

    #[test]
    fn blocked_row_ops_give_the_bits_of_the_widening_path_for_any_thread_count() {
        // Rows shorter and longer than a block, enough of them for parallel tasks.
        for (rows, row) in [(1000, 129), (3, 5000), (1, 1), (77, 384)] {
            let n = rows * row;
            let x32: Vec<f32> = rand_vec(3, n).iter().map(|&v| 4.0 * v as f32).collect();
            let g32: Vec<f32> = rand_vec(4, row).iter().map(|&v| 1.0 + 0.5 * v as f32).collect();
            let xh: Vec<bf16> = x32.iter().map(|&v| bf16::from_f32(v)).collect();
            let gh: Vec<bf16> = g32.iter().map(|&v| bf16::from_f32(v)).collect();
            let (xw, gw): (Vec<f32>, Vec<f32>) = (xh.iter().map(|v| v.to_f32()).collect(), gh.iter().map(|v| v.to_f32()).collect());
            // Softmax: one row input, one row output.
            let mut want = vec![0f32; n];
            softmax::softmax_forward(&xw, row, &mut want);
            // Layer norm: a whole-tensor parameter and per-row statistics besides.
            let (mut ln, mut mean, mut rstd) = (vec![0f32; n], vec![0f32; rows], vec![0f32; rows]);
            norm::layernorm_forward(&xw, &gw, None, 1e-5, row, &mut ln, &mut mean, &mut rstd);
            for threads in [1, 3] {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                pool.install(|| {
                    let mut got = vec![bf16::ZERO; n];
                    blocked(rows, &[(Src::BF16(&xh), Cut::Units(row))], vec![(Dst::BF16(&mut got), row)], |_, i, o| softmax::softmax_forward(i[0], row, o[0]));
                    assert!(got.iter().zip(&want).all(|(g, w)| g.to_bits() == bf16::from_f32(*w).to_bits()), "softmax {rows}x{row}, {threads} threads");
                    let (mut y, mut m, mut r) = (vec![bf16::ZERO; n], vec![0f32; rows], vec![0f32; rows]);
                    let ins = [(Src::BF16(&xh), Cut::Units(row)), (Src::BF16(&gh), Cut::Whole)];
                    blocked(rows, &ins, vec![(Dst::BF16(&mut y), row), (Dst::F32(&mut m), 1), (Dst::F32(&mut r), 1)], |_, i, o| {
                        let (y, rest) = o.split_at_mut(1);
                        let (m, r) = rest.split_at_mut(1);
                        norm::layernorm_forward(i[0], i[1], None, 1e-5, row, y[0], m[0], r[0])
                    });
                    assert!(y.iter().zip(&ln).all(|(g, w)| g.to_bits() == bf16::from_f32(*w).to_bits()), "layernorm {rows}x{row}, {threads} threads");
                    assert_eq!(m, mean);
                    assert_eq!(r, rstd);
                });
            }
        }
    }

    #[test]
    fn blocked_passes_each_block_its_first_unit() {
        // The unit offset is what lets a row kernel find per-row side data
        // (a cross-entropy's targets): every unit must be seen exactly once.
        let units = 3 * PAR_CHUNK / 7 + 5;
        let x: Vec<f32> = (0..units * 7).map(|i| (i / 7) as f32).collect();
        let mut out = vec![0f32; units];
        blocked(units, &[(Src::F32(&x), Cut::Units(7))], vec![(Dst::F32(&mut out), 1)], |u0, i, o| {
            for (k, (o, row)) in o[0].iter_mut().zip(i[0].chunks(7)).enumerate() {
                assert_eq!(row[0] as usize, u0 + k);
                *o = row[6] + 1.0;
            }
        });
        assert!(out.iter().enumerate().all(|(u, &v)| v == u as f32 + 1.0));
    }
}
