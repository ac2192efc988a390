//! int8 weights with one scale per output channel: `s_n = max_k |W[n, k]| /
//! 127`, codes `q = round(W / s_n)` in `-127..=127`, one byte per weight,
//! row-major like the f32 weight.

use super::driver::{for_output_blocks, with_tile, Frame};
use super::{check_out, check_x, code, max_abs, portable, Isa, Rows};
use crate::cpu::matmul::matmul as gemm;
use crate::desc::Gemm;
use rayon::prelude::*;
use std::ops::Range;

/// An int8 weight `[n, k]`: its codes and one scale per row.
#[derive(Clone, Copy, Debug)]
pub struct Int8Weight<'a> {
    /// The codes, `n·k` row-major.
    pub q: &'a [i8],
    /// One scale per row, `n`.
    pub scales: &'a [f32],
    /// Rows: output features.
    pub n: usize,
    /// Columns: input features.
    pub k: usize,
}

impl<'a> Int8Weight<'a> {
    fn check(&self, op: &str) {
        assert_eq!(self.q.len(), self.n * self.k, "{op}: the codes must be n*k = {}*{}", self.n, self.k);
        assert_eq!(self.scales.len(), self.n, "{op}: one scale per row, n = {}", self.n);
    }

    /// The codes of row `j`.
    pub(super) fn row(&self, j: usize) -> &'a [i8] {
        &self.q[j * self.k..(j + 1) * self.k]
    }
}

/// Rows quantized on the calling thread below this many weights.
const PAR_MIN_WEIGHTS: usize = 1 << 18;

/// Quantizes the row-major f32 weight `w` (`[n, k]`) into `q` (`n·k` codes)
/// and `scales` (`n`).
pub fn quantize(w: &[f32], n: usize, k: usize, q: &mut [i8], scales: &mut [f32]) {
    assert_eq!(w.len(), n * k, "int8::quantize: w must be n*k = {n}*{k}");
    assert_eq!(q.len(), n * k, "int8::quantize: q must be n*k = {n}*{k}");
    assert_eq!(scales.len(), n, "int8::quantize: one scale per row, n = {n}");
    if k == 0 {
        scales.fill(0.0);
        return;
    }
    let one = |((row, q_row), s): ((&[f32], &mut [i8]), &mut f32)| *s = quantize_row(row, q_row);
    if n * k >= PAR_MIN_WEIGHTS {
        w.par_chunks(k).zip(q.par_chunks_mut(k)).zip(scales.par_iter_mut()).for_each(one);
    } else {
        w.chunks(k).zip(q.chunks_mut(k)).zip(scales.iter_mut()).for_each(one);
    }
}

/// Quantizes one row (of weights, or of W8A8's activations) symmetrically
/// to `-127..=127`; returns its scale.
pub(super) fn quantize_row(row: &[f32], q: &mut [i8]) -> f32 {
    let s = max_abs(row) / 127.0;
    for (c, &v) in q.iter_mut().zip(row) {
        *c = code(v, s, 127.0) as i8;
    }
    s
}

/// Writes the f32 weight the codes stand for, `q · s`, into `out` (`n·k`):
/// for tests and for checking a quantized model, never on the product's path.
pub fn dequantize(w: &Int8Weight<'_>, out: &mut [f32]) {
    w.check("int8::dequantize");
    assert_eq!(out.len(), w.n * w.k, "int8::dequantize: out must be n*k");
    for j in 0..w.n {
        dequantize_row(w, j, &mut out[j * w.k..(j + 1) * w.k]);
    }
}

fn dequantize_row(w: &Int8Weight<'_>, j: usize, out: &mut [f32]) {
    let s = w.scales[j];
    for (o, &c) in out.iter_mut().zip(w.row(j)) {
        *o = c as f32 * s;
    }
}

/// `y = x · dequant(W)ᵀ (+ bias)`: `x` is `[m, k]` row-major f32, `y` is
/// `[m, n]`, `bias` has `n` values. See [the module](super) for how it runs.
pub fn matmul(x: &[f32], m: usize, w: &Int8Weight<'_>, bias: Option<&[f32]>, y: &mut [f32]) {
    matmul_with(Isa::detect(), Rows::Fastest, x, m, w, bias, y)
}

/// [`matmul`] with every row of `y` the bits that row of `x` gets alone,
/// whatever the other rows are: the decode loops at any row count, never
/// the prefill tile (slower from [`TILE_MIN_ROWS`](super::TILE_MIN_ROWS) rows on). For serving,
/// where a request's outputs must not depend on its batch.
pub fn matmul_rows(x: &[f32], m: usize, w: &Int8Weight<'_>, bias: Option<&[f32]>, y: &mut [f32]) {
    matmul_with(Isa::detect(), Rows::Invariant, x, m, w, bias, y)
}

pub(crate) fn matmul_with(isa: Isa, order: Rows, x: &[f32], m: usize, w: &Int8Weight<'_>, bias: Option<&[f32]>, y: &mut [f32]) {
    const OP: &str = "int8::matmul";
    w.check(OP);
    check_x(OP, x, m, w.k);
    check_out(OP, m, w.n, bias, y);
    let frame = Frame { m, n: w.n, k: w.k, row_bytes: w.k + 4, rows_multiple: 4 };
    if w.k == 0 {
        for_output_blocks(frame, bias, y, |_, out| out.fill(0.0));
    } else if order.tile(m) {
        for_output_blocks(Frame { rows_multiple: super::TILE_ROWS, ..frame }, bias, y, |rows, out| tile(x, m, w, rows, out));
    } else {
        for_output_blocks(frame, bias, y, |rows, out| fused(isa, x, m, w, rows, out));
    }
}

/// Channels `rows` for every row of `x`, straight from the codes. One row
/// of `x` (decode): four channels at a time share each load of `x`. More
/// rows: each channel's codes are widened once for up to four rows of `x`.
fn fused(isa: Isa, x: &[f32], m: usize, w: &Int8Weight<'_>, rows: Range<usize>, out: &mut [f32]) {
    let first = rows.start;
    if m > 1 {
        let xs: Vec<&[f32]> = x.chunks_exact(w.k).collect();
        for (j, out) in rows.zip(out.chunks_exact_mut(m)) {
            let (row, s) = (w.row(j), w.scales[j]);
            let mut i = 0;
            while i < m {
                i += match m - i {
                    4.. => channel_rows::<4>(isa, &xs, i, row, s, out),
                    2 | 3 => channel_rows::<2>(isa, &xs, i, row, s, out),
                    _ => channel_rows::<1>(isa, &xs, i, row, s, out),
                };
            }
        }
        return;
    }
    let mut j = rows.start;
    while j + 4 <= rows.end {
        let r = [w.row(j), w.row(j + 1), w.row(j + 2), w.row(j + 3)];
        let d = dot_i8(isa, x, &r);
        for (t, v) in d.into_iter().enumerate() {
            out[j - first + t] = v * w.scales[j + t];
        }
        j += 4;
    }
    for j in j..rows.end {
        out[j - first] = dot_i8(isa, x, &[w.row(j)])[0] * w.scales[j];
    }
}

/// Rows `i..i + M` of `x` against one channel (codes `row`, scale `s`),
/// written to `out[i..i + M]`; returns `M`.
fn channel_rows<const M: usize>(isa: Isa, xs: &[&[f32]], i: usize, row: &[i8], s: f32, out: &mut [f32]) -> usize {
    let x: [&[f32]; M] = std::array::from_fn(|t| xs[i + t]);
    let d = match isa {
        Isa::Portable => portable::dot_i8_rows(&x, row),
        // SAFETY: `Isa::Avx2` is only made after `x86::available()` found AVX2 and FMA.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { super::x86::dot_i8_rows(&x, row) },
    };
    for (o, v) in out[i..i + M].iter_mut().zip(d) {
        *o = v * s;
    }
    M
}

/// Channels `rows` for every row of `x` by an f32 tile of the block's
/// weights (in cache, reused per thread) and the matrix-product kernel.
fn tile(x: &[f32], m: usize, w: &Int8Weight<'_>, rows: Range<usize>, out: &mut [f32]) {
    let k = w.k;
    with_tile(rows.len() * k, |t| {
        for (r, j) in rows.clone().enumerate() {
            dequantize_row(w, j, &mut t[r * k..(r + 1) * k]);
        }
        gemm(&Gemm::new(1, rows.len(), k, m).trans_b(true), t, x, out);
    });
}

/// [`portable::dot_i8`] or its SIMD form.
fn dot_i8<const R: usize>(isa: Isa, x: &[f32], rows: &[&[i8]; R]) -> [f32; R] {
    match isa {
        Isa::Portable => portable::dot_i8(x, rows),
        // SAFETY: `Isa::Avx2` is only made after `x86::available()` found AVX2 and FMA.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { super::x86::dot_i8(x, rows) },
    }
}
