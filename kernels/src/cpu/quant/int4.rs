//! int4 weights with one scale per group of `group` consecutive weights of
//! a row: `s = max|group| / 7`, codes `q = round(w / s)` in `-7..=7`, two
//! per byte.
//!
//! Layout: a row of `k` weights is `k / group` groups; a group is `group /
//! 2` bytes, byte `j` holding weight `j` of the group in its low nibble and
//! weight `j + group / 2` in its high nibble, each as `q + 8` (`1..=15`).
//! Pairing a weight with the one half a group away, rather than with its
//! neighbour, lets a loop unpack a run of bytes with one mask and one shift
//! into two runs of consecutive weights, each met by consecutive values of
//! `x` (the portable and CUDA loops); the AVX2 loop reads `x` in an order
//! of its own instead (see `x86::dot_i4`). Scales are `[n, k / group]`
//! row-major.
//!
//! `group` must be even and divide `k`. Groups of a multiple of 32 weights
//! (the default 128 included) run the SIMD loop; others the portable one.

use super::driver::{for_output_blocks, with_tile, Frame};
use super::portable::{high, low};
use super::{check_out, check_x, code, max_abs, portable, Isa, Rows};
use crate::cpu::matmul::matmul as gemm;
use crate::desc::Gemm;
use rayon::prelude::*;
use std::ops::Range;

/// The group size used when none is given: what GPTQ and AWQ checkpoints
/// use most, a scale (4 bytes) per 64 bytes of codes.
pub const DEFAULT_GROUP: usize = 128;

/// An int4 weight `[n, k]`: its packed codes and one scale per group.
#[derive(Clone, Copy, Debug)]
pub struct Int4Weight<'a> {
    /// The packed codes, `n·k/2` bytes (see [the module](self) for the order).
    pub packed: &'a [u8],
    /// One scale per group, `[n, k / group]` row-major.
    pub scales: &'a [f32],
    /// Rows: output features.
    pub n: usize,
    /// Columns: input features.
    pub k: usize,
    /// Weights per scale along a row.
    pub group: usize,
}

impl<'a> Int4Weight<'a> {
    fn check(&self, op: &str) {
        check_group(op, self.k, self.group);
        assert_eq!(self.packed.len(), self.n * self.k / 2, "{op}: the packed codes must be n*k/2 = {}*{}/2 bytes", self.n, self.k);
        assert_eq!(self.scales.len(), self.n * (self.k / self.group), "{op}: one scale per group, n*k/group");
    }

    /// The packed codes of row `j`.
    fn row(&self, j: usize) -> &'a [u8] {
        &self.packed[j * self.k / 2..(j + 1) * self.k / 2]
    }

    /// The scales of row `j`.
    fn row_scales(&self, j: usize) -> &'a [f32] {
        let g = self.k / self.group;
        &self.scales[j * g..(j + 1) * g]
    }
}

fn check_group(op: &str, k: usize, group: usize) {
    assert!(group >= 2 && group.is_multiple_of(2) && k.is_multiple_of(group), "{op}: the group ({group}) must be even and divide k ({k})");
}

/// Rows quantized on the calling thread below this many weights.
const PAR_MIN_WEIGHTS: usize = 1 << 18;

/// Quantizes the row-major f32 weight `w` (`[n, k]`) into `packed`
/// (`n·k/2` bytes) and `scales` (`n·k/group`).
pub fn quantize(w: &[f32], n: usize, k: usize, group: usize, packed: &mut [u8], scales: &mut [f32]) {
    const OP: &str = "int4::quantize";
    check_group(OP, k, group);
    assert_eq!(w.len(), n * k, "{OP}: w must be n*k = {n}*{k}");
    assert_eq!(packed.len(), n * k / 2, "{OP}: packed must be n*k/2 bytes");
    assert_eq!(scales.len(), n * (k / group), "{OP}: one scale per group, n*k/group");
    if k == 0 {
        return;
    }
    let half = group / 2;
    let one = |((row, bytes), s): ((&[f32], &mut [u8]), &mut [f32])| {
        for ((g, b), s) in row.chunks_exact(group).zip(bytes.chunks_exact_mut(half)).zip(s) {
            *s = max_abs(g) / 7.0;
            let (lo, hi) = g.split_at(half);
            for ((b, &l), &h) in b.iter_mut().zip(lo).zip(hi) {
                *b = nibble(l, *s) | (nibble(h, *s) << 4);
            }
        }
    };
    let groups = k / group;
    if n * k >= PAR_MIN_WEIGHTS {
        w.par_chunks(k).zip(packed.par_chunks_mut(k / 2)).zip(scales.par_chunks_mut(groups)).for_each(one);
    } else {
        w.chunks(k).zip(packed.chunks_mut(k / 2)).zip(scales.chunks_mut(groups)).for_each(one);
    }
}

/// The stored nibble of weight `v` under scale `s`: `q + 8`.
fn nibble(v: f32, s: f32) -> u8 {
    (code(v, s, 7.0) as i8 + 8) as u8
}

/// Writes the f32 weight the codes stand for, `q · s`, into `out` (`n·k`):
/// for tests and for checking a quantized model, never on the product's path.
pub fn dequantize(w: &Int4Weight<'_>, out: &mut [f32]) {
    w.check("int4::dequantize");
    assert_eq!(out.len(), w.n * w.k, "int4::dequantize: out must be n*k");
    for j in 0..w.n {
        dequantize_row(w, j, &mut out[j * w.k..(j + 1) * w.k]);
    }
}

fn dequantize_row(w: &Int4Weight<'_>, j: usize, out: &mut [f32]) {
    let half = w.group / 2;
    for ((o, b), &s) in out.chunks_exact_mut(w.group).zip(w.row(j).chunks_exact(half)).zip(w.row_scales(j)) {
        let (lo, hi) = o.split_at_mut(half);
        for ((l, h), &b) in lo.iter_mut().zip(hi).zip(b) {
            *l = low(b) * s;
            *h = high(b) * s;
        }
    }
}

/// `y = x · dequant(W)ᵀ (+ bias)`: `x` is `[m, k]` row-major f32, `y` is
/// `[m, n]`, `bias` has `n` values. See [the module](super) for how it runs.
pub fn matmul(x: &[f32], m: usize, w: &Int4Weight<'_>, bias: Option<&[f32]>, y: &mut [f32]) {
    matmul_with(Isa::detect(), Rows::Fastest, x, m, w, bias, y)
}

/// [`matmul`] with every row of `y` the bits that row of `x` gets alone,
/// whatever the other rows are: the decode loops at any row count, never
/// the prefill tile (slower from [`TILE_MIN_ROWS`](super::TILE_MIN_ROWS) rows on). For serving,
/// where a request's outputs must not depend on its batch.
pub fn matmul_rows(x: &[f32], m: usize, w: &Int4Weight<'_>, bias: Option<&[f32]>, y: &mut [f32]) {
    matmul_with(Isa::detect(), Rows::Invariant, x, m, w, bias, y)
}

pub(crate) fn matmul_with(isa: Isa, order: Rows, x: &[f32], m: usize, w: &Int4Weight<'_>, bias: Option<&[f32]>, y: &mut [f32]) {
    const OP: &str = "int4::matmul";
    w.check(OP);
    check_x(OP, x, m, w.k);
    check_out(OP, m, w.n, bias, y);
    let frame = Frame { m, n: w.n, k: w.k, row_bytes: w.k / 2 + 4 * (w.k / w.group), rows_multiple: 1 };
    // Groups the SIMD loop does not take run the portable one.
    let isa = if (w.group / 2).is_multiple_of(16) { isa } else { Isa::Portable };
    if w.k == 0 {
        for_output_blocks(frame, bias, y, |_, out| out.fill(0.0));
    } else if order.tile(m) {
        for_output_blocks(Frame { rows_multiple: super::TILE_ROWS, ..frame }, bias, y, |rows, out| tile(x, m, w, rows, out));
    } else {
        // The SIMD loop reads each row of x in its own order (once per
        // product: k values against the n·k weights).
        #[cfg(target_arch = "x86_64")]
        let ordered = (isa == Isa::Avx2).then(|| super::x86::i4_order(x, w.k, w.group));
        #[cfg(target_arch = "x86_64")]
        let x = ordered.as_deref().unwrap_or(x);
        for_output_blocks(frame, bias, y, |rows, out| fused(isa, x, m, w, rows, out));
    }
}

/// Channels `rows` for every row of `x` (`m` rows, in the form `isa`'s
/// loop reads), straight from the packed codes.
/// One row of `x` (decode): four channels at a time share each load of `x`.
/// More rows: each sixteen bytes are unpacked once for up to four of them.
/// Either way a row's outputs are the bits it gets alone (see
/// [`dot_i4`](super::x86::dot_i4)).
fn fused(isa: Isa, x: &[f32], m: usize, w: &Int4Weight<'_>, rows: Range<usize>, out: &mut [f32]) {
    if m == 0 {
        return;
    }
    let xs: Vec<&[f32]> = x.chunks_exact(x.len() / m).collect();
    let chan = |j: usize| (w.row(j), w.row_scales(j));
    if m == 1 {
        let (first, mut j) = (rows.start, rows.start);
        while j + 4 <= rows.end {
            let [d] = dot::<1, 4>(isa, &[xs[0]], &[chan(j), chan(j + 1), chan(j + 2), chan(j + 3)], w.group);
            out[j - first..j - first + 4].copy_from_slice(&d);
            j += 4;
        }
        while j + 2 <= rows.end {
            let [d] = dot::<1, 2>(isa, &[xs[0]], &[chan(j), chan(j + 1)], w.group);
            out[j - first..j - first + 2].copy_from_slice(&d);
            j += 2;
        }
        for j in j..rows.end {
            out[j - first] = dot::<1, 1>(isa, &[xs[0]], &[chan(j)], w.group)[0][0];
        }
        return;
    }
    for (j, out) in rows.zip(out.chunks_exact_mut(m)) {
        let mut i = 0;
        while i < m {
            i += match m - i {
                4.. => channel_rows::<4>(isa, &xs, i, chan(j), w.group, out),
                2 | 3 => channel_rows::<2>(isa, &xs, i, chan(j), w.group, out),
                _ => channel_rows::<1>(isa, &xs, i, chan(j), w.group, out),
            };
        }
    }
}

/// One int4 channel: its packed codes and its scales.
type Channel<'a> = (&'a [u8], &'a [f32]);

/// Rows `i..i + M` of `x` against one channel, written to `out[i..i + M]`;
/// returns `M`.
fn channel_rows<const M: usize>(isa: Isa, xs: &[&[f32]], i: usize, chan: Channel<'_>, group: usize, out: &mut [f32]) -> usize {
    let x: [&[f32]; M] = std::array::from_fn(|t| xs[i + t]);
    let d = dot::<M, 1>(isa, &x, &[chan], group);
    for (o, d) in out[i..i + M].iter_mut().zip(d) {
        *o = d[0];
    }
    M
}

/// `out[row][channel]` for `M` rows of `x` against `R` channels, on the
/// portable loops or the SIMD ones.
fn dot<const M: usize, const R: usize>(isa: Isa, xs: &[&[f32]; M], chans: &[Channel<'_>; R], group: usize) -> [[f32; R]; M] {
    match isa {
        Isa::Portable => std::array::from_fn(|r| std::array::from_fn(|c| portable::dot_i4(xs[r], chans[c].0, chans[c].1, group))),
        // SAFETY: `Isa::Avx2` is only made after `x86::available()` found
        // AVX2 and FMA; the group suits its loop (checked by `matmul_with`).
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { super::x86::dot_i4(xs, chans, group) },
    }
}

/// Channels `rows` for every row of `x` by an f32 tile of the block's
/// weights (in cache, reused per thread) and the matrix-product kernel.
fn tile(x: &[f32], m: usize, w: &Int4Weight<'_>, rows: Range<usize>, out: &mut [f32]) {
    let k = w.k;
    with_tile(rows.len() * k, |t| {
        for (r, j) in rows.clone().enumerate() {
            dequantize_row(w, j, &mut t[r * k..(r + 1) * k]);
        }
        gemm(&Gemm::new(1, rows.len(), k, m).trans_b(true), t, x, out);
    });
}
