//! The inner loops of the quantized products in plain Rust, for CPUs
//! without the SIMD loops (and as their reference in the tests).
//!
//! Each sum runs in eight interleaved partial sums, which the compiler can
//! keep in vector registers, then adds them up; the codes are widened to f32
//! exactly (every code is a small integer).

/// Partial sums per dot product.
const LANES: usize = 8;

/// `Σ_i x[i] · rows[r][i]` for each of the `R` rows (each at least `x.len()` long).
pub(super) fn dot_i8<const R: usize>(x: &[f32], rows: &[&[i8]; R]) -> [f32; R] {
    let k = x.len();
    let whole = k - k % LANES;
    let mut acc = [[0f32; LANES]; R];
    for i in (0..whole).step_by(LANES) {
        let xs = &x[i..i + LANES];
        for (a, row) in acc.iter_mut().zip(rows) {
            let qs = &row[i..i + LANES];
            for l in 0..LANES {
                a[l] += xs[l] * qs[l] as f32;
            }
        }
    }
    let mut out = [0f32; R];
    for ((o, a), row) in out.iter_mut().zip(&acc).zip(rows) {
        let mut s: f32 = a.iter().sum();
        for i in whole..k {
            s += x[i] * row[i] as f32;
        }
        *o = s;
    }
    out
}

/// `Σ_g scales[g] · Σ_{i in group g} x[i] · q[i]` for one int4 row
/// (`packed`, `x.len() / 2` bytes in the layout of [`super::int4`]).
pub(super) fn dot_i4(x: &[f32], packed: &[u8], scales: &[f32], group: usize) -> f32 {
    let half = group / 2;
    let mut total = 0f32;
    for ((xg, bg), &s) in x.chunks_exact(group).zip(packed.chunks_exact(half)).zip(scales) {
        let (x_lo, x_hi) = xg.split_at(half);
        let whole = half - half % LANES;
        let mut acc = [0f32; LANES];
        for i in (0..whole).step_by(LANES) {
            for l in 0..LANES {
                let b = bg[i + l];
                acc[l] += x_lo[i + l] * low(b) + x_hi[i + l] * high(b);
            }
        }
        let mut g: f32 = acc.iter().sum();
        for i in whole..half {
            g += x_lo[i] * low(bg[i]) + x_hi[i] * high(bg[i]);
        }
        total += s * g;
    }
    total
}

/// The weight in the low nibble of an int4 byte.
#[inline(always)]
pub(super) fn low(b: u8) -> f32 {
    ((b & 0x0F) as i32 - 8) as f32
}

/// The weight in the high nibble of an int4 byte.
#[inline(always)]
pub(super) fn high(b: u8) -> f32 {
    ((b >> 4) as i32 - 8) as f32
}

/// `Σ_i x[i] · rows[r][i]` in `i32` (exact: the caller bounds the depth so
/// no sum overflows) for each of the `R` rows.
pub(super) fn dot_i8i8<const R: usize>(x: &[i8], rows: &[&[i8]; R]) -> [i32; R] {
    let mut out = [0i32; R];
    for (o, row) in out.iter_mut().zip(rows) {
        *o = x.iter().zip(&row[..x.len()]).map(|(&a, &b)| a as i32 * b as i32).sum();
    }
    out
}

/// [`dot_i8`] of each of the `M` rows of x against one channel.
pub(super) fn dot_i8_rows<const M: usize>(xs: &[&[f32]; M], row: &[i8]) -> [f32; M] {
    std::array::from_fn(|r| dot_i8(xs[r], &[row])[0])
}
