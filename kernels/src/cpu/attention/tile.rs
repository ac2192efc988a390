//! Small dense products on cache-sized tiles: the inner loops of the fused
//! attention kernels.
//!
//! Attention blocks are at most a few dozen rows on a side, so a general
//! matrix-multiply library would spend more on packing and dispatch than on
//! arithmetic. Instead, one register-tiled loop nest handles every product the
//! kernels need (`Q·Kᵀ`, `P·V`, `Pᵀ·dO`, ...), with operands laid out so the
//! innermost loop runs over contiguous memory and auto-vectorises.

use crate::cpu::mixed::Stored;
use crate::Real;

/// `c[m×n] = a[m×k] · b[k×n]` (or `+=` when `accumulate`), all row-major with
/// leading dimensions `lda`, `ldb`, `ldc`.
///
/// Every element of `c` starts from zero (or its old value) and adds its `k`
/// products in index order, whatever its position in the register tiling. The
/// result of an element therefore depends only on its own row of `a` and
/// column of `b`, which lets the backward pass recompute score tiles that are
/// bit-identical to the forward's even when it forms them transposed.
#[allow(clippy::too_many_arguments)]
pub(super) fn matmul_tile<T: Real>(m: usize, n: usize, k: usize, a: &[T], lda: usize, b: &[T], ldb: usize, c: &mut [T], ldc: usize, accumulate: bool) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(k == 0 || a.len() >= (m - 1) * lda + k, "a too short");
    assert!(k == 0 || b.len() >= (k - 1) * ldb + n, "b too short");
    assert!(c.len() >= (m - 1) * ldc + n, "c too short");
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: `tiled_avx` only requires the AVX instruction set, which
        // the running CPU was just found to support.
        unsafe { tiled_avx(m, n, k, a, lda, b, ldb, c, ldc, accumulate) };
        return;
    }
    tiled_baseline(m, n, k, a, lda, b, ldb, c, ldc, accumulate);
}

/// The loop nest for the x86-64 baseline (SSE2, 16 vector registers of 16
/// bytes): eight accumulator registers (4×8 f32 or 4×4 f64) leave room for
/// the `b` row and the broadcast `a` values without spills.
#[allow(clippy::too_many_arguments)]
fn tiled_baseline<T: Real>(m: usize, n: usize, k: usize, a: &[T], lda: usize, b: &[T], ldb: usize, c: &mut [T], ldc: usize, accumulate: bool) {
    if std::mem::size_of::<T>() <= 4 {
        tiled::<T, 4, 8>(m, n, k, a, lda, b, ldb, c, ldc, accumulate);
    } else {
        tiled::<T, 4, 4>(m, n, k, a, lda, b, ldb, c, ldc, accumulate);
    }
}

/// The same loop nest compiled for 32-byte vectors, which doubles the width
/// of every multiply and add. The build targets the x86-64 baseline, so this
/// is selected at run time. Products and sums stay separate instructions (no
/// fused multiply-add), and each element's sum keeps its order, so results are
/// bit-identical to [`tiled_baseline`]'s: the choice of path never shows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
#[allow(clippy::too_many_arguments)]
fn tiled_avx<T: Real>(m: usize, n: usize, k: usize, a: &[T], lda: usize, b: &[T], ldb: usize, c: &mut [T], ldc: usize, accumulate: bool) {
    if std::mem::size_of::<T>() <= 4 {
        tiled::<T, 4, 16>(m, n, k, a, lda, b, ldb, c, ldc, accumulate);
    } else {
        tiled::<T, 4, 8>(m, n, k, a, lda, b, ldb, c, ldc, accumulate);
    }
}

#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn tiled<T: Real, const MR: usize, const NR: usize>(
    m: usize,
    n: usize,
    k: usize,
    a: &[T],
    lda: usize,
    b: &[T],
    ldb: usize,
    c: &mut [T],
    ldc: usize,
    accumulate: bool,
) {
    let m_full = m - m % MR;
    let n_full = n - n % NR;
    for i0 in (0..m_full).step_by(MR) {
        for j0 in (0..n_full).step_by(NR) {
            micro::<T, MR, NR>(k, &a[i0 * lda..], lda, &b[j0..], ldb, &mut c[i0 * ldc + j0..], ldc, accumulate);
        }
        if n_full < n {
            for i in i0..i0 + MR {
                edge_row(i, n_full, n, k, a, lda, b, ldb, c, ldc, accumulate);
            }
        }
    }
    for i in m_full..m {
        edge_row(i, 0, n, k, a, lda, b, ldb, c, ldc, accumulate);
    }
}

/// One `MR×NR` block of `c`, kept in registers across the whole `k` loop.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn micro<T: Real, const MR: usize, const NR: usize>(k: usize, a: &[T], lda: usize, b: &[T], ldb: usize, c: &mut [T], ldc: usize, accumulate: bool) {
    let mut acc = [[T::zero(); NR]; MR];
    if accumulate {
        for (r, row) in acc.iter_mut().enumerate() {
            row.copy_from_slice(&c[r * ldc..r * ldc + NR]);
        }
    }
    let a_rows: [&[T]; MR] = std::array::from_fn(|r| &a[r * lda..r * lda + k]);
    for p in 0..k {
        let bp: &[T; NR] = b[p * ldb..p * ldb + NR].try_into().unwrap();
        for r in 0..MR {
            let ar = a_rows[r][p];
            for j in 0..NR {
                acc[r][j] += ar * bp[j];
            }
        }
    }
    for (r, row) in acc.iter().enumerate() {
        c[r * ldc..r * ldc + NR].copy_from_slice(row);
    }
}

/// Columns `j_lo..n` of row `i`, for the parts of `c` that do not fill a
/// register block. Same per-element summation order as [`micro`].
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn edge_row<T: Real>(i: usize, j_lo: usize, n: usize, k: usize, a: &[T], lda: usize, b: &[T], ldb: usize, c: &mut [T], ldc: usize, accumulate: bool) {
    let c_row = &mut c[i * ldc + j_lo..i * ldc + n];
    if !accumulate {
        c_row.fill(T::zero());
    }
    let a_row = &a[i * lda..i * lda + k];
    for (p, &ap) in a_row.iter().enumerate() {
        axpy(c_row, ap, &b[p * ldb + j_lo..p * ldb + n]);
    }
}

/// `y += alpha * x`.
#[inline(always)]
pub(super) fn axpy<T: Real>(y: &mut [T], alpha: T, x: &[T]) {
    for (yi, &xi) in y.iter_mut().zip(x) {
        *yi += alpha * xi;
    }
}

/// `dst[c×r] = scale * srcᵀ` for `src[r×c]` row-major with row stride `ld`
/// (`dst` has leading dimension `r`). Puts a block of keys (or queries) in
/// the layout whose rows [`matmul_tile`] streams contiguously.
#[inline(always)]
pub(super) fn transpose_scaled<T: Real, S: Stored<T>>(src: &[S], rows: usize, cols: usize, ld: usize, scale: T, dst: &mut [T]) {
    if rows == 0 {
        return;
    }
    assert!(src.len() >= (rows - 1) * ld + cols && dst.len() >= rows * cols);
    for r in 0..rows {
        for (c, &x) in src[r * ld..r * ld + cols].iter().enumerate() {
            dst[c * rows + r] = x.load() * scale;
        }
    }
}

/// `sum_i a[i] * b[i]` with eight independent partial sums (so it vectorises)
/// combined in a fixed order (so it is deterministic).
#[inline]
pub(super) fn dot<T: Real, S: Stored<T>>(a: &[S], b: &[S]) -> T {
    assert_eq!(a.len(), b.len());
    let mut lanes = [T::zero(); 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (xa, xb) in ca.zip(cb) {
        for l in 0..8 {
            lanes[l] += xa[l].load() * xb[l].load();
        }
    }
    let mut tail = T::zero();
    for (&x, &y) in ra.iter().zip(rb) {
        tail += x.load() * y.load();
    }
    ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7])) + tail
}

/// `sum_i x[i]` with eight partial sums combined in a fixed order.
#[inline]
pub(super) fn sum_of<T: Real>(x: &[T]) -> T {
    let mut lanes = [T::zero(); 8];
    let chunks = x.chunks_exact(8);
    let mut tail = T::zero();
    for &e in chunks.remainder() {
        tail += e;
    }
    for c in chunks {
        for l in 0..8 {
            lanes[l] += c[l];
        }
    }
    ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7])) + tail
}

/// `max_i x[i]`, `-inf` for an empty slice (NaN entries are skipped).
#[inline]
pub(super) fn max_of<T: Real>(x: &[T]) -> T {
    let mut lanes = [T::neg_infinity(); 8];
    let chunks = x.chunks_exact(8);
    let mut tail = T::neg_infinity();
    for &e in chunks.remainder() {
        tail = tail.max(e);
    }
    for c in chunks {
        for l in 0..8 {
            lanes[l] = lanes[l].max(c[l]);
        }
    }
    lanes.iter().fold(tail, |a, &b| a.max(b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{assert_close, rand_vec};

    fn naive(m: usize, n: usize, k: usize, a: &[f64], lda: usize, b: &[f64], ldb: usize) -> Vec<f64> {
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k).map(|p| a[i * lda + p] * b[p * ldb + j]).sum();
            }
        }
        c
    }

    #[test]
    fn matmul_tile_matches_naive_on_odd_shapes_and_strides() {
        for &(m, n, k) in &[(1, 1, 1), (3, 17, 5), (4, 8, 16), (17, 9, 3), (13, 33, 7), (8, 4, 0)] {
            let (lda, ldb, ldc) = (k + 2, n + 3, n + 1);
            let a = rand_vec(1, m * lda);
            let b = rand_vec(2, k.max(1) * ldb);
            let c0 = rand_vec(3, m * ldc);
            let want = naive(m, n, k, &a, lda, &b, ldb);
            for accumulate in [false, true] {
                let mut c = c0.clone();
                matmul_tile(m, n, k, &a, lda, &b, ldb, &mut c, ldc, accumulate);
                let mut got = Vec::new();
                let mut exp = Vec::new();
                for i in 0..m {
                    for j in 0..n {
                        got.push(c[i * ldc + j]);
                        exp.push(want[i * n + j] + if accumulate { c0[i * ldc + j] } else { 0.0 });
                    }
                    // Padding columns between rows are untouched.
                    for j in n..ldc {
                        assert_eq!(c[i * ldc + j], c0[i * ldc + j]);
                    }
                }
                assert_close(&got, &exp, 1e-12, 1e-12, &format!("matmul {m}x{n}x{k} acc={accumulate}"));
            }
            // f32 goes through the wider register tile.
            let af: Vec<f32> = a.iter().map(|&x| x as f32).collect();
            let bf: Vec<f32> = b.iter().map(|&x| x as f32).collect();
            let mut cf = vec![0f32; m * ldc];
            matmul_tile(m, n, k, &af, lda, &bf, ldb, &mut cf, ldc, false);
            let got: Vec<f64> = (0..m * n).map(|e| cf[(e / n) * ldc + e % n] as f64).collect();
            assert_close(&got, &want, 1e-5, 1e-5, "matmul f32");
        }
    }

    #[test]
    fn every_code_path_gives_the_same_bits() {
        let (m, n, k) = (13, 37, 19);
        let a = rand_vec(8, m * k);
        let b = rand_vec(9, k * n);
        let mut fast = vec![0.0; m * n];
        let mut base = vec![0.0; m * n];
        matmul_tile(m, n, k, &a, k, &b, n, &mut fast, n, false);
        tiled_baseline(m, n, k, &a, k, &b, n, &mut base, n, false);
        assert_eq!(fast, base);
        let (af, bf): (Vec<f32>, Vec<f32>) = (a.iter().map(|&x| x as f32).collect(), b.iter().map(|&x| x as f32).collect());
        let mut fast = vec![0f32; m * n];
        let mut base = vec![0f32; m * n];
        matmul_tile(m, n, k, &af, k, &bf, n, &mut fast, n, false);
        tiled_baseline(m, n, k, &af, k, &bf, n, &mut base, n, false);
        assert_eq!(fast, base);
    }

    #[test]
    fn dot_sum_max_and_transpose() {
        for n in [0, 1, 7, 8, 9, 33] {
            let a = rand_vec(4, n);
            let b = rand_vec(5, n);
            let want: f64 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
            assert!((dot(&a, &b) - want).abs() < 1e-12);
        }
        for n in [0, 1, 7, 8, 9, 33] {
            let a = rand_vec(7, n);
            assert!((sum_of(&a) - a.iter().sum::<f64>()).abs() < 1e-12);
            assert_eq!(max_of(&a), a.iter().cloned().fold(f64::NEG_INFINITY, f64::max));
        }
        let src = rand_vec(6, 3 * 5);
        let mut dst = vec![0.0; 15];
        transpose_scaled(&src, 3, 5, 5, 2.0, &mut dst);
        for r in 0..3 {
            for c in 0..5 {
                assert_eq!(dst[c * 3 + r], 2.0 * src[r * 5 + c]);
            }
        }
        // Rows 7 apart (a block of a fused buffer): the gaps are never read.
        let src = rand_vec(8, 2 * 7 + 5);
        transpose_scaled(&src, 3, 5, 7, 1.0, &mut dst);
        for r in 0..3 {
            for c in 0..5 {
                assert_eq!(dst[c * 3 + r], src[r * 7 + c]);
            }
        }
    }
}
