//! `Y = X·Wᵀ (+ b)` with every output computed alone, in one fixed order: a
//! row's result does not depend on how many other rows the product has.
//!
//! General matrix-product libraries pick their kernel, blocking and
//! summation order from the shape, so one row of `X` gets different bits
//! when it is multiplied alone (a matrix-vector path) or with 32 others.
//! Serving needs better: a request decoded alone or inside a batch must
//! produce the same tokens. Here every `Y[i, j]` is the dot product of row
//! `i` of `X` with row `j` of `W` in the canonical order [`dot_canonical`]
//! spells out, whatever tile of the kernel computes it, so the result is a
//! function of the two rows alone.
//!
//! It is also the decode-speed kernel: with few rows (a decode step) the
//! product is bound by streaming `W` once, which this does at memory speed,
//! where general kernels pack `W` first.

use crate::Real;
use rayon::prelude::*;

/// Lanes of the canonical order: 16 partial sums, lane `l` accumulating the
/// products at `k ≡ l (mod 16)` below the last multiple of 16.
const LANES: usize = 16;

/// The canonical dot product every path reproduces bit for bit: 16 partial
/// sums by fused multiply-add over `k < k16` (lane `l` takes `k ≡ l mod 16`,
/// in increasing `k`), reduced in a fixed tree (lane `l` plus lane `l + 8`,
/// then `+4`, `+2`, `+1`), then the last `k % 16` products added by fused
/// multiply-add in order.
pub fn dot_canonical<T: Real>(x: &[T], w: &[T]) -> T {
    let k = x.len().min(w.len());
    let k16 = k - k % LANES;
    let mut lanes = [T::zero(); LANES];
    for (xc, wc) in x[..k16].chunks_exact(LANES).zip(w[..k16].chunks_exact(LANES)) {
        for l in 0..LANES {
            lanes[l] = xc[l].mul_add(wc[l], lanes[l]);
        }
    }
    let mut s = reduce(&lanes);
    for i in k16..k {
        s = x[i].mul_add(w[i], s);
    }
    s
}

#[inline(always)]
fn reduce<T: Real>(a: &[T; LANES]) -> T {
    let mut s8 = [T::zero(); 8];
    for l in 0..8 {
        s8[l] = a[l] + a[l + 8];
    }
    let s4 = [s8[0] + s8[4], s8[1] + s8[5], s8[2] + s8[6], s8[3] + s8[7]];
    let s2 = [s4[0] + s4[2], s4[1] + s4[3]];
    s2[0] + s2[1]
}

/// Products below this many multiply-adds run on the calling thread.
const PAR_MIN_MACS: usize = 1 << 18;

/// `y[i, j] = dot(x[i], w[j]) (+ bias[j])` for `x` `[m, k]`, `w` `[n, k]`
/// (a linear layer's weight) and `y` `[m, n]`, all row-major; each element
/// is [`dot_canonical`] of its two rows (plus the bias, added last), so the
/// bits of a row depend on that row of `x` alone.
pub fn matmul_rows<T: Real>(m: usize, k: usize, n: usize, x: &[T], w: &[T], bias: Option<&[T]>, y: &mut [T]) {
    assert_eq!(x.len(), m * k, "matmul_rows: x must be [m, k]");
    assert_eq!(w.len(), n * k, "matmul_rows: w must be [n, k]");
    assert_eq!(y.len(), m * n, "matmul_rows: y must be [m, n]");
    if let Some(b) = bias {
        assert_eq!(b.len(), n, "matmul_rows: the bias must have n elements");
    }
    if m == 0 || n == 0 {
        return;
    }
    // Columns of Y per task: a block of W rows that stays in L2 while every row of X passes.
    let cols = (256 * 1024 / (k.max(1) * std::mem::size_of::<T>())).clamp(NR, 256) / NR * NR;
    let task = |j0: usize, out: &mut Vec<T>| {
        let j1 = (j0 + cols).min(n);
        out.clear();
        out.resize(m * (j1 - j0), T::zero());
        block(m, k, j1 - j0, x, &w[j0 * k..j1 * k], out);
    };
    let starts: Vec<usize> = (0..n).step_by(cols).collect();
    let parts: Vec<Vec<T>> = if m * n * k >= PAR_MIN_MACS {
        starts
            .par_iter()
            .map(|&j0| {
                let mut o = Vec::new();
                task(j0, &mut o);
                o
            })
            .collect()
    } else {
        starts
            .iter()
            .map(|&j0| {
                let mut o = Vec::new();
                task(j0, &mut o);
                o
            })
            .collect()
    };
    for (&j0, part) in starts.iter().zip(&parts) {
        let width = (j0 + cols).min(n) - j0;
        for i in 0..m {
            y[i * n + j0..i * n + j0 + width].copy_from_slice(&part[i * width..(i + 1) * width]);
        }
    }
    if let Some(b) = bias {
        for row in y.chunks_exact_mut(n) {
            for (v, &bj) in row.iter_mut().zip(b) {
                *v += bj;
            }
        }
    }
}

/// Rows of `W` per register tile.
const NR: usize = 3;

/// `out[i, j] = dot(x[i], w[j])` for one block of `W` rows (`out` `[m, nb]`).
fn block<T: Real>(m: usize, k: usize, nb: usize, x: &[T], w: &[T], out: &mut [T]) {
    #[cfg(target_arch = "x86_64")]
    if std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>() && avx2::available() {
        // SAFETY: T is f32 (checked), so the casts only rename the type; the CPU has AVX2
        // and FMA (checked); the slices have the lengths the sizes say (callers' asserts).
        unsafe {
            let cast = |s: &[T]| std::slice::from_raw_parts(s.as_ptr() as *const f32, s.len());
            let out = std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut f32, out.len());
            return avx2::block(m, k, nb, cast(x), cast(w), out);
        }
    }
    for i in 0..m {
        for j in 0..nb {
            out[i * nb + j] = dot_canonical(&x[i * k..(i + 1) * k], &w[j * k..(j + 1) * k]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{LANES, NR};
    use std::arch::x86_64::*;

    pub(super) fn available() -> bool {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
    }

    /// Tiles of up to 2 rows of X by [`NR`] rows of W, each output with two
    /// 8-lane accumulators (lanes 0..8 and 8..16 of the canonical order).
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; `x` is `[m, k]`, `w` `[nb, k]`, `out` `[m, nb]`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn block(m: usize, k: usize, nb: usize, x: &[f32], w: &[f32], out: &mut [f32]) {
        let mut i = 0;
        while i < m {
            let mr = (m - i).min(2);
            let mut j = 0;
            while j < nb {
                let nr = (nb - j).min(NR);
                match (mr, nr) {
                    (2, 3) => tile::<2, 3>(k, x, w, out, nb, i, j),
                    (2, 2) => tile::<2, 2>(k, x, w, out, nb, i, j),
                    (2, _) => tile::<2, 1>(k, x, w, out, nb, i, j),
                    (_, 3) => tile::<1, 3>(k, x, w, out, nb, i, j),
                    (_, 2) => tile::<1, 2>(k, x, w, out, nb, i, j),
                    _ => tile::<1, 1>(k, x, w, out, nb, i, j),
                }
                j += nr;
            }
            i += mr;
        }
    }

    /// Outputs `[i..i+MR, j..j+NR]` in the canonical order.
    ///
    /// # Safety
    /// As [`block`], and the tile lies inside `out`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile<const MR: usize, const NR_: usize>(k: usize, x: &[f32], w: &[f32], out: &mut [f32], nb: usize, i: usize, j: usize) {
        let k16 = k - k % LANES;
        let mut acc = [[[_mm256_setzero_ps(); 2]; NR_]; MR];
        let xp: [*const f32; MR] = std::array::from_fn(|a| x.as_ptr().add((i + a) * k));
        let wp: [*const f32; NR_] = std::array::from_fn(|b| w.as_ptr().add((j + b) * k));
        let mut kk = 0;
        while kk < k16 {
            let xv: [[__m256; 2]; MR] = std::array::from_fn(|a| [_mm256_loadu_ps(xp[a].add(kk)), _mm256_loadu_ps(xp[a].add(kk + 8))]);
            for b in 0..NR_ {
                let w0 = _mm256_loadu_ps(wp[b].add(kk));
                let w1 = _mm256_loadu_ps(wp[b].add(kk + 8));
                for a in 0..MR {
                    acc[a][b][0] = _mm256_fmadd_ps(xv[a][0], w0, acc[a][b][0]);
                    acc[a][b][1] = _mm256_fmadd_ps(xv[a][1], w1, acc[a][b][1]);
                }
            }
            kk += LANES;
        }
        for a in 0..MR {
            for b in 0..NR_ {
                // Lane l + lane l+8, then the fixed tree of `reduce`.
                let s8 = _mm256_add_ps(acc[a][b][0], acc[a][b][1]);
                let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
                let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
                let s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
                let mut s = _mm_cvtss_f32(s1);
                for t in k16..k {
                    s = (*xp[a].add(t)).mul_add(*wp[b].add(t), s);
                }
                out[(i + a) * nb + j + b] = s;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::testing::rand_vec;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        rand_vec(seed, n).into_iter().map(|v| v as f32).collect()
    }

    #[test]
    fn every_row_gets_the_bits_of_the_canonical_dot_whatever_the_shape() {
        for (seed, &(m, k, n)) in [(1, 1, 1), (1, 16, 3), (2, 17, 5), (3, 100, 7), (5, 768, 40), (7, 33, 1000), (33, 64, 9), (4, 4096, 130)].iter().enumerate()
        {
            let (x, w, b) = (values(m * k, seed as u64), values(n * k, seed as u64 + 100), values(n, seed as u64 + 200));
            let mut y = vec![0f32; m * n];
            matmul_rows(m, k, n, &x, &w, Some(&b), &mut y);
            for i in 0..m {
                for j in 0..n {
                    let want = dot_canonical(&x[i * k..(i + 1) * k], &w[j * k..(j + 1) * k]) + b[j];
                    assert_eq!(y[i * n + j].to_bits(), want.to_bits(), "{m}x{k}x{n} at ({i}, {j})");
                }
            }
            // The f64 product agrees to rounding.
            let exact: f64 = (0..k).map(|t| x[t] as f64 * w[t] as f64).sum::<f64>() + b[0] as f64;
            assert!((y[0] as f64 - exact).abs() <= 1e-5 * (1.0 + (0..k).map(|t| (x[t] * w[t]).abs() as f64).sum::<f64>()));
        }
    }

    #[test]
    fn a_row_alone_equals_the_same_row_in_a_batch() {
        let (k, n) = (300, 77);
        let x = values(40 * k, 5);
        let w = values(n * k, 6);
        let mut all = vec![0f32; 40 * n];
        matmul_rows(40, k, n, &x, &w, None, &mut all);
        for r in [0, 1, 17, 39] {
            let mut one = vec![0f32; n];
            matmul_rows(1, k, n, &x[r * k..(r + 1) * k], &w, None, &mut one);
            assert_eq!(one.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), all[r * n..(r + 1) * n].iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        }
    }

    #[test]
    fn f64_follows_the_same_order() {
        let (m, k, n) = (3, 37, 5);
        let x: Vec<f64> = values(m * k, 9).into_iter().map(f64::from).collect();
        let w: Vec<f64> = values(n * k, 10).into_iter().map(f64::from).collect();
        let mut y = vec![0f64; m * n];
        matmul_rows(m, k, n, &x, &w, None, &mut y);
        assert_eq!(y[n + 1], dot_canonical(&x[k..2 * k], &w[k..2 * k]));
    }
}
