//! W8A8: int8 weights (per output channel, as [`int8`](super::int8)) and
//! int8 activations quantized per row of `x` when the product runs.
//!
//! Row `r` of `x` gets `sx_r = max|x_r| / 127` and codes `round(x / sx_r)`;
//! then `y[r, n] = (sx_r · s_n) · Σ_k xq[r, k] · q[n, k]`, the sum of
//! `i8·i8` products taken exactly in `i32`. Bytes times bytes is what SIMD
//! integer units do fastest (32 products per instruction on AVX2), and the
//! activations' bytes are four times fewer to re-read per output channel.
//! The activations' rounding adds at most `Σ_k (sx_r / 2) · |dequant(W)[n, k]|`
//! to the weight-only error. A row of `x` holding NaN or an infinity gives
//! non-finite outputs.

use super::driver::{for_output_blocks, Frame};
use super::int8::{quantize_row, Int8Weight};
use super::{check_out, check_x, portable, Isa};
use rayon::prelude::*;
use std::ops::Range;

/// The deepest product W8A8 takes: `127² · k` stays inside `i32` up to
/// `k = 133 144`; this is the power of two below.
pub const MAX_K: usize = 1 << 17;

/// Quantizes each of the `m` rows of `x` (`[m, k]`) into `xq` (`m·k`
/// codes) and `sx` (one scale per row).
pub fn quantize_rows(x: &[f32], m: usize, k: usize, xq: &mut [i8], sx: &mut [f32]) {
    check_x("w8a8::quantize_rows", x, m, k);
    assert_eq!(xq.len(), m * k, "w8a8::quantize_rows: xq must be m*k");
    assert_eq!(sx.len(), m, "w8a8::quantize_rows: one scale per row");
    if k == 0 {
        sx.fill(0.0);
        return;
    }
    for ((row, q), s) in x.chunks_exact(k).zip(xq.chunks_exact_mut(k)).zip(sx) {
        *s = quantize_row(row, q);
    }
}

/// `y = x · dequant(W)ᵀ (+ bias)` with `x` quantized per row: `x` is
/// `[m, k]` row-major f32 (`k` at most [`MAX_K`]), `y` is `[m, n]`, `bias`
/// has `n` values.
pub fn matmul(x: &[f32], m: usize, w: &Int8Weight<'_>, bias: Option<&[f32]>, y: &mut [f32]) {
    matmul_on(Isa::detect(), x, m, w, bias, y)
}

pub(crate) fn matmul_on(isa: Isa, x: &[f32], m: usize, w: &Int8Weight<'_>, bias: Option<&[f32]>, y: &mut [f32]) {
    const OP: &str = "w8a8::matmul";
    assert_eq!(w.q.len(), w.n * w.k, "{OP}: the codes must be n*k");
    assert_eq!(w.scales.len(), w.n, "{OP}: one scale per row");
    assert!(w.k <= MAX_K, "{OP}: k = {} exceeds {MAX_K}, where i32 sums could overflow", w.k);
    check_x(OP, x, m, w.k);
    check_out(OP, m, w.n, bias, y);
    let (mut xq, mut sx) = (vec![0i8; m * w.k], vec![0f32; m]);
    if m * w.k >= 1 << 16 {
        xq.par_chunks_mut(w.k.max(1)).zip(x.par_chunks(w.k.max(1))).zip(sx.par_iter_mut()).for_each(|((q, row), s)| *s = quantize_row(row, q));
    } else {
        quantize_rows(x, m, w.k, &mut xq, &mut sx);
    }
    let frame = Frame { m, n: w.n, k: w.k, row_bytes: w.k + 4, rows_multiple: 4 };
    if w.k == 0 {
        return for_output_blocks(frame, bias, y, |_, out| out.fill(0.0));
    }
    for_output_blocks(frame, bias, y, |rows, out| fused(isa, &xq, &sx, w, rows, out));
}

/// Channels `rows` for every row of the quantized `x`, four channels at a
/// time sharing each load of `x`.
fn fused(isa: Isa, xq: &[i8], sx: &[f32], w: &Int8Weight<'_>, rows: Range<usize>, out: &mut [f32]) {
    let (first, m) = (rows.start, sx.len());
    let mut j = rows.start;
    while j + 4 <= rows.end {
        let r = [w.row(j), w.row(j + 1), w.row(j + 2), w.row(j + 3)];
        for (i, xr) in xq.chunks_exact(w.k).enumerate() {
            let d = dot_i8i8(isa, xr, &r);
            for (t, v) in d.into_iter().enumerate() {
                out[(j - first + t) * m + i] = v as f32 * (sx[i] * w.scales[j + t]);
            }
        }
        j += 4;
    }
    for j in j..rows.end {
        for (i, xr) in xq.chunks_exact(w.k).enumerate() {
            out[(j - first) * m + i] = dot_i8i8(isa, xr, &[w.row(j)])[0] as f32 * (sx[i] * w.scales[j]);
        }
    }
}

/// [`portable::dot_i8i8`] or its SIMD form.
fn dot_i8i8<const R: usize>(isa: Isa, x: &[i8], rows: &[&[i8]; R]) -> [i32; R] {
    match isa {
        Isa::Portable => portable::dot_i8i8(x, rows),
        // SAFETY: `Isa::Avx2` is only made after `x86::available()` found AVX2 and FMA.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { super::x86::dot_i8i8(x, rows) },
    }
}
