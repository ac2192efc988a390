//! Whole-buffer and per-row reductions: sums, squared norms, maximum magnitude.
//!
//! Sums are defined by a fixed decomposition, not by how the work happens to
//! be scheduled: the buffer (or row) is cut into chunks of [`CHUNK`] elements,
//! each chunk is summed in `f64` over `LANES` interleaved accumulators that
//! are combined in a fixed tree, and the chunk sums are added in index order.
//! Sequential and parallel code paths evaluate exactly that expression, so
//! results are bit-identical whatever the number of threads. Accumulating in
//! `f64` keeps an `f32` gradient norm over billions of elements accurate.

use crate::Real;
use rayon::prelude::*;

/// Elements per chunk; part of the definition of every sum's rounding.
pub const CHUNK: usize = 1 << 14;
/// Independent accumulators inside a chunk: breaks the add dependency chain
/// so the loop vectorises, and cuts the rounding error's growth.
const LANES: usize = 8;
/// Below this many elements a reduction stays on the calling thread.
const PAR_MIN: usize = 1 << 15;

/// Sum of `f(x[i])` in `f64` over one chunk, lanes combined pairwise.
#[inline]
fn chunk_sum<T: Real>(x: &[T], f: impl Fn(f64) -> f64) -> f64 {
    let mut acc = [0f64; LANES];
    let mut groups = x.chunks_exact(LANES);
    for g in &mut groups {
        for (a, &v) in acc.iter_mut().zip(g) {
            *a += f(v.to_f64_lossless());
        }
    }
    for (a, &v) in acc.iter_mut().zip(groups.remainder()) {
        *a += f(v.to_f64_lossless());
    }
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

/// The defining sum, on the calling thread.
fn sum_seq<T: Real>(x: &[T], f: impl Fn(f64) -> f64 + Copy) -> f64 {
    x.chunks(CHUNK).fold(0.0, |s, c| s + chunk_sum(c, f))
}

/// The same sum as [`sum_seq`], chunks reduced in parallel and their results
/// combined in index order.
fn sum_par<T: Real>(x: &[T], f: impl Fn(f64) -> f64 + Copy + Sync) -> f64 {
    if x.len() <= PAR_MIN {
        return sum_seq(x, f);
    }
    let partials: Vec<f64> = x.par_chunks(CHUNK).map(|c| chunk_sum(c, f)).collect();
    partials.iter().fold(0.0, |s, &p| s + p)
}

/// Sum of all elements, accumulated in `f64` and rounded once to `T`.
/// Zero for an empty buffer.
pub fn sum<T: Real>(x: &[T]) -> T {
    T::lit(sum_par(x, |v| v))
}

/// Sum of squares (the squared L2 norm), accumulated in `f64` and rounded
/// once to `T`. Used by gradient-norm clipping; overflows to infinity only if
/// the true value exceeds `T`'s range.
pub fn sum_squares<T: Real>(x: &[T]) -> T {
    T::lit(sum_par(x, |v| v * v))
}

/// Per-row sums: `out[r] = sum_j x[r, j]` for `x` row-major `[rows, row]`
/// and `out` of length `rows`. Each row is summed exactly as [`sum`] would
/// sum it on its own. `row` must be positive.
pub fn sum_rows<T: Real>(x: &[T], row: usize, out: &mut [T]) {
    assert!(row > 0, "row length must be positive");
    assert_eq!(x.len() % row, 0, "buffer length is not a multiple of the row length");
    assert_eq!(out.len(), x.len() / row, "output length differs from the row count");
    if row >= PAR_MIN {
        // Few long rows: the parallelism is inside each row.
        for (o, r) in out.iter_mut().zip(x.chunks_exact(row)) {
            *o = T::lit(sum_par(r, |v| v));
        }
    } else if x.len() <= PAR_MIN {
        for (o, r) in out.iter_mut().zip(x.chunks_exact(row)) {
            *o = T::lit(sum_seq(r, |v| v));
        }
    } else {
        let rows_per_task = (PAR_MIN / row).max(1);
        out.par_chunks_mut(rows_per_task).zip(x.par_chunks(rows_per_task * row)).for_each(|(o, x)| {
            for (o, r) in o.iter_mut().zip(x.chunks_exact(row)) {
                *o = T::lit(sum_seq(r, |v| v));
            }
        });
    }
}

/// Largest magnitude over one chunk, and whether the chunk holds a NaN.
#[inline]
fn chunk_max_abs<T: Real>(x: &[T]) -> (T, bool) {
    let mut m = [T::zero(); LANES];
    let mut nan = false;
    let mut groups = x.chunks_exact(LANES);
    for g in &mut groups {
        for (m, &v) in m.iter_mut().zip(g) {
            let a = v.abs();
            // A comparison-select (not `max`) so the loop vectorises; NaNs
            // are tracked separately because no comparison sees them.
            *m = if a > *m { a } else { *m };
            nan |= v.is_nan();
        }
    }
    for (m, &v) in m.iter_mut().zip(groups.remainder()) {
        let a = v.abs();
        *m = if a > *m { a } else { *m };
        nan |= v.is_nan();
    }
    (m.iter().fold(T::zero(), |a, &b| if b > a { b } else { a }), nan)
}

/// Largest absolute value: `max_i |x[i]|`, zero for an empty buffer, and NaN
/// if any element is NaN (loss scaling's overflow check relies on seeing
/// both infinities and NaNs).
pub fn max_abs<T: Real>(x: &[T]) -> T {
    let combine = |(a, na): (T, bool), (b, nb): (T, bool)| (if b > a { b } else { a }, na || nb);
    let (m, nan) = if x.len() <= PAR_MIN {
        x.chunks(CHUNK).map(chunk_max_abs).fold((T::zero(), false), combine)
    } else {
        // The maximum is exact, so any combination order gives the same value.
        x.par_chunks(CHUNK).map(chunk_max_abs).reduce(|| (T::zero(), false), combine)
    };
    if nan {
        T::nan()
    } else {
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::rand_vec;

    fn in_pool<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
        rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap().install(f)
    }

    #[test]
    fn sums_are_exact_on_integer_values() {
        for n in [0, 1, 3, 17, 129, CHUNK + 1, 3 * PAR_MIN + 7] {
            let x: Vec<f32> = (0..n).map(|i| ((i * 31) % 11) as f32 - 5.0).collect();
            let exact: i64 = (0..n).map(|i| ((i * 31) % 11) as i64 - 5).sum();
            let exact_sq: i64 = (0..n).map(|i| (((i * 31) % 11) as i64 - 5).pow(2)).sum();
            assert_eq!(sum(&x), exact as f32, "sum, n = {n}");
            assert_eq!(sum_squares(&x), exact_sq as f32, "sum_squares, n = {n}");
            let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
            assert_eq!(sum(&x64), exact as f64);
            assert_eq!(sum_squares(&x64), exact_sq as f64);
        }
    }

    #[test]
    fn f32_sums_accumulate_in_f64() {
        // 2^24 + 1 + 1 + ... is lost entirely by an f32 accumulator.
        let mut x = vec![1f32; 4001];
        x[0] = 16_777_216.0;
        assert_eq!(sum(&x), 16_781_216.0);
        let y: Vec<f32> = rand_vec(1, 100_003).iter().map(|&v| v as f32).collect();
        let reference: f64 = y.iter().map(|&v| v as f64).sum();
        assert!((sum(&y) as f64 - reference).abs() <= 1e-6 * reference.abs().max(1.0));
        let reference_sq: f64 = y.iter().map(|&v| (v as f64) * (v as f64)).sum();
        assert!((sum_squares(&y) as f64 - reference_sq).abs() <= 1e-6 * reference_sq);
    }

    #[test]
    fn sums_do_not_depend_on_the_thread_count() {
        let n = (1 << 20) + 12_345;
        let x: Vec<f32> = rand_vec(2, n).iter().map(|&v| v as f32 * 1e3).collect();
        let (s1, q1) = in_pool(1, || (sum(&x), sum_squares(&x)));
        let (s2, q2) = in_pool(2, || (sum(&x), sum_squares(&x)));
        let (s3, q3) = in_pool(3, || (sum(&x), sum_squares(&x)));
        assert_eq!(s1.to_bits(), s2.to_bits());
        assert_eq!(s1.to_bits(), s3.to_bits());
        assert_eq!(q1.to_bits(), q2.to_bits());
        assert_eq!(q1.to_bits(), q3.to_bits());
        // The parallel path computes the same expression as the sequential one.
        assert_eq!(sum_par(&x, |v| v).to_bits(), sum_seq(&x, |v| v).to_bits());
        let (row, rows) = (1000, n / 1000);
        let r1 = in_pool(1, || {
            let mut o = vec![0f32; rows];
            sum_rows(&x[..rows * row], row, &mut o);
            o
        });
        let r2 = in_pool(2, || {
            let mut o = vec![0f32; rows];
            sum_rows(&x[..rows * row], row, &mut o);
            o
        });
        assert!(r1.iter().zip(&r2).all(|(a, b)| a.to_bits() == b.to_bits()));
    }

    #[test]
    fn sum_rows_sums_each_row_like_sum() {
        for (rows, row) in [(1, 1), (3, 17), (17, 3), (129, 5), (5, 129), (40, 2000), (2, PAR_MIN + 3)] {
            let x = rand_vec(3, rows * row);
            let mut out = vec![f64::NAN; rows];
            sum_rows(&x, row, &mut out);
            for (r, &o) in out.iter().enumerate() {
                assert_eq!(o.to_bits(), sum(&x[r * row..(r + 1) * row]).to_bits());
                let naive: f64 = x[r * row..(r + 1) * row].iter().sum();
                assert!((o - naive).abs() < 1e-12 * row as f64, "row {r}");
            }
        }
        let x: Vec<f32> = (0..12).map(|i| i as f32).collect();
        let mut out = [0f32; 3];
        sum_rows(&x, 4, &mut out);
        assert_eq!(out, [6.0, 22.0, 38.0]);
    }

    #[test]
    fn max_abs_finds_magnitudes_infinities_and_nans() {
        assert_eq!(max_abs::<f32>(&[]), 0.0);
        assert_eq!(max_abs(&[1.0f32, -3.5, 2.0]), 3.5);
        for n in [5, 129, 3 * PAR_MIN + 1] {
            let mut x: Vec<f32> = rand_vec(4, n).iter().map(|&v| v as f32).collect();
            let pos = n * 2 / 3;
            x[pos] = -7.25;
            assert_eq!(max_abs(&x), 7.25);
            x[pos / 2] = f32::NEG_INFINITY;
            assert_eq!(max_abs(&x), f32::INFINITY);
            x[n - 1] = f32::NAN;
            assert!(max_abs(&x).is_nan(), "n = {n}");
            x[n - 1] = 0.0;
            x[0] = f32::NAN;
            assert!(max_abs(&x).is_nan(), "n = {n}");
        }
        assert!(max_abs(&[f64::NAN]).is_nan());
    }
}
