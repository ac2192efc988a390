//! Softmax and log-softmax over the last dimension, with their gradients.
//!
//! Both subtract the row maximum before exponentiating, so inputs of any
//! magnitude give finite results (the largest exponent is exactly zero). A
//! row is processed by one task; rows are grouped into tasks of roughly
//! `PAR_CHUNK` elements, so results never depend on the thread count.

use super::elementwise::PAR_CHUNK;
use super::exp::exp;
use crate::Real;
use rayon::prelude::*;

/// Independent accumulators in a row's sums: lets the loop vectorise.
const LANES: usize = 8;

/// Largest element of a non-empty row (NaN-free rows assumed; a NaN input
/// propagates to the output through the arithmetic anyway).
#[inline]
fn row_max<T: Real>(x: &[T]) -> T {
    let mut m = [T::neg_infinity(); LANES];
    let mut groups = x.chunks_exact(LANES);
    for g in &mut groups {
        for (m, &v) in m.iter_mut().zip(g) {
            *m = if v > *m { v } else { *m };
        }
    }
    for (m, &v) in m.iter_mut().zip(groups.remainder()) {
        *m = if v > *m { v } else { *m };
    }
    m.iter().fold(T::neg_infinity(), |a, &b| if b > a { b } else { a })
}

/// `sum_i a[i] * b[i]` over a row, in a fixed lane order.
#[inline]
fn row_dot<T: Real>(a: &[T], b: &[T]) -> T {
    let mut acc = [T::zero(); LANES];
    let mut ga = a.chunks_exact(LANES);
    let mut gb = b.chunks_exact(LANES);
    for (ga, gb) in (&mut ga).zip(&mut gb) {
        for ((s, &x), &y) in acc.iter_mut().zip(ga).zip(gb) {
            *s += x * y;
        }
    }
    for ((s, &x), &y) in acc.iter_mut().zip(ga.remainder()).zip(gb.remainder()) {
        *s += x * y;
    }
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

/// `sum_i a[i]` over a row, in a fixed lane order.
#[inline]
fn row_sum<T: Real>(a: &[T]) -> T {
    let mut acc = [T::zero(); LANES];
    let mut g = a.chunks_exact(LANES);
    for g in &mut g {
        for (s, &x) in acc.iter_mut().zip(g) {
            *s += x;
        }
    }
    for (s, &x) in acc.iter_mut().zip(g.remainder()) {
        *s += x;
    }
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

/// Checks the shapes shared by every kernel here.
fn check(a: usize, b: usize, row: usize) {
    assert!(row > 0, "row length must be positive");
    assert_eq!(a, b, "buffer lengths differ");
    assert_eq!(a % row, 0, "buffer length is not a multiple of the row length");
}

/// Applies `f(x_row, out_row)` to every row, in parallel tasks of whole rows.
fn for_rows<T: Real>(x: &[T], out: &mut [T], row: usize, f: impl Fn(&[T], &mut [T]) + Sync) {
    let run = |x: &[T], out: &mut [T]| {
        for (x, o) in x.chunks_exact(row).zip(out.chunks_exact_mut(row)) {
            f(x, o);
        }
    };
    if x.len() <= PAR_CHUNK || x.len() == row {
        run(x, out);
    } else {
        let span = row * (PAR_CHUNK / row).max(1);
        out.par_chunks_mut(span).zip(x.par_chunks(span)).for_each(|(o, x)| run(x, o));
    }
}

/// Applies `f(y_row, dy_row, dx_row)` to every row, in parallel tasks of whole rows.
fn for_rows2<T: Real>(y: &[T], dy: &[T], dx: &mut [T], row: usize, f: impl Fn(&[T], &[T], &mut [T]) + Sync) {
    let run = |y: &[T], dy: &[T], dx: &mut [T]| {
        for ((y, dy), dx) in y.chunks_exact(row).zip(dy.chunks_exact(row)).zip(dx.chunks_exact_mut(row)) {
            f(y, dy, dx);
        }
    };
    if y.len() <= PAR_CHUNK || y.len() == row {
        run(y, dy, dx);
    } else {
        let span = row * (PAR_CHUNK / row).max(1);
        dx.par_chunks_mut(span).zip(y.par_chunks(span)).zip(dy.par_chunks(span)).for_each(|((dx, y), dy)| run(y, dy, dx));
    }
}

/// Softmax of each row: `y[r, j] = exp(x[r, j] - m_r) / sum_k exp(x[r, k] - m_r)`
/// with `m_r` the row maximum.
///
/// `x` and `y` are row-major `[rows, row]`. Entries of `-inf` get probability
/// zero; a row that is entirely `-inf` (or holds a NaN) yields NaN.
pub fn softmax_forward<T: Real>(x: &[T], row: usize, y: &mut [T]) {
    check(x.len(), y.len(), row);
    for_rows(x, y, row, |x, y| {
        let m = row_max(x);
        for (o, &v) in y.iter_mut().zip(x) {
            *o = exp(v - m);
        }
        let inv = T::one() / row_sum(y);
        for o in y.iter_mut() {
            *o *= inv;
        }
    });
}

/// Gradient of [`softmax_forward`] from its output `y`:
/// `dx[r, j] = y[r, j] (dy[r, j] - sum_k y[r, k] dy[r, k])`.
///
/// `y`, `dy` and `dx` are row-major `[rows, row]`; `dx` is overwritten.
pub fn softmax_backward<T: Real>(y: &[T], dy: &[T], row: usize, dx: &mut [T]) {
    check(y.len(), dy.len(), row);
    check(y.len(), dx.len(), row);
    for_rows2(y, dy, dx, row, |y, dy, dx| {
        let s = row_dot(y, dy);
        for ((o, &p), &g) in dx.iter_mut().zip(y).zip(dy) {
            *o = p * (g - s);
        }
    });
}

/// Log-softmax of each row: `y[r, j] = (x[r, j] - m_r) - log(sum_k exp(x[r, k] - m_r))`
/// with `m_r` the row maximum.
///
/// `x` and `y` are row-major `[rows, row]`. The exponentials are written into
/// `y` first and overwritten, so no scratch memory is needed.
pub fn log_softmax_forward<T: Real>(x: &[T], row: usize, y: &mut [T]) {
    check(x.len(), y.len(), row);
    for_rows(x, y, row, |x, y| {
        let m = row_max(x);
        for (o, &v) in y.iter_mut().zip(x) {
            *o = exp(v - m);
        }
        // `(x - m) - lse`, not `x - (m + lse)`: the difference to the maximum
        // is exact for nearby values, so large logits lose no precision.
        let lse = row_sum(y).ln();
        for (o, &v) in y.iter_mut().zip(x) {
            *o = (v - m) - lse;
        }
    });
}

/// Gradient of [`log_softmax_forward`] from its output `y`:
/// `dx[r, j] = dy[r, j] - exp(y[r, j]) sum_k dy[r, k]`.
///
/// `y`, `dy` and `dx` are row-major `[rows, row]`; `dx` is overwritten.
pub fn log_softmax_backward<T: Real>(y: &[T], dy: &[T], row: usize, dx: &mut [T]) {
    check(y.len(), dy.len(), row);
    check(y.len(), dx.len(), row);
    for_rows2(y, dy, dx, row, |y, dy, dx| {
        let s = row_sum(dy);
        for ((o, &l), &g) in dx.iter_mut().zip(y).zip(dy) {
            *o = g - exp(l) * s;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{assert_close, dot, numeric_grad, rand_vec};

    const SHAPES: [(usize, usize); 6] = [(1, 1), (1, 3), (3, 17), (17, 3), (2, 129), (5, 8)];

    fn inputs(seed: u64, n: usize) -> Vec<f64> {
        rand_vec(seed, n).iter().map(|v| 3.0 * v).collect()
    }

    #[test]
    fn softmax_rows_sum_to_one_and_survive_large_inputs() {
        let x = [1.0, 2.0, 3.0, 1e4, 1e4 - 1.0, -1e4, -1e4, -1e4, f64::NEG_INFINITY];
        let mut y = [0.0; 9];
        softmax_forward(&x, 3, &mut y);
        let e = 1.0 / (1.0 + (-1.0f64).exp() + (-2.0f64).exp());
        let f = 1.0 / (1.0 + (-1.0f64).exp());
        let expected = [e * (-2.0f64).exp(), e * (-1.0f64).exp(), e, f, f * (-1.0f64).exp(), 0.0, 0.5, 0.5, 0.0];
        assert_close(&y, &expected, 1e-15, 1e-14, "softmax values");
        let mut l = [0.0; 9];
        log_softmax_forward(&x, 3, &mut l);
        assert!(l[5] < -1.9e4 && l[8] == f64::NEG_INFINITY);
        assert_close(&l[6..8], &[-(2.0f64.ln()); 2], 1e-15, 1e-14, "log_softmax values");
        let mut y32 = vec![0f32; 6];
        softmax_forward(&[3e38f32, 1e4, -1e4, 1e4, 1e4, 1e4], 3, &mut y32);
        assert!(y32.iter().all(|v| v.is_finite()));
        assert_eq!(&y32[..3], &[1.0, 0.0, 0.0]);
        assert!(y32[3..].iter().all(|&v| (v - 1.0 / 3.0).abs() < 1e-7));
        for (rows, row) in [(3, 17), (40, 1000), (2, 100_003)] {
            let x = inputs(rows as u64, rows * row);
            let mut y = vec![0.0; rows * row];
            softmax_forward(&x, row, &mut y);
            for r in y.chunks(row) {
                assert!((r.iter().sum::<f64>() - 1.0).abs() < 1e-12);
                assert!(r.iter().all(|&p| p > 0.0));
            }
            let mut l = vec![0.0; rows * row];
            log_softmax_forward(&x, row, &mut l);
            let exp_l: Vec<f64> = l.iter().map(|v| v.exp()).collect();
            assert_close(&exp_l, &y, 1e-15, 1e-12, "exp(log_softmax) = softmax");
        }
    }

    #[test]
    fn softmax_gradient_matches_finite_differences() {
        for (rows, row) in SHAPES {
            let n = rows * row;
            let x = inputs(n as u64, n);
            let dy = rand_vec(1000 + n as u64, n);
            let mut y = vec![0.0; n];
            softmax_forward(&x, row, &mut y);
            let mut dx = vec![f64::NAN; n];
            softmax_backward(&y, &dy, row, &mut dx);
            let num = numeric_grad(
                |x| {
                    let mut y = vec![0.0; n];
                    softmax_forward(x, row, &mut y);
                    dot(&y, &dy)
                },
                &x,
                1e-5,
            );
            assert_close(&dx, &num, 1e-9, 1e-6, "softmax dx");
        }
    }

    #[test]
    fn log_softmax_gradient_matches_finite_differences() {
        for (rows, row) in SHAPES {
            let n = rows * row;
            let x = inputs(2 * n as u64, n);
            let dy = rand_vec(2000 + n as u64, n);
            let mut y = vec![0.0; n];
            log_softmax_forward(&x, row, &mut y);
            let mut dx = vec![f64::NAN; n];
            log_softmax_backward(&y, &dy, row, &mut dx);
            let num = numeric_grad(
                |x| {
                    let mut y = vec![0.0; n];
                    log_softmax_forward(x, row, &mut y);
                    dot(&y, &dy)
                },
                &x,
                1e-5,
            );
            assert_close(&dx, &num, 1e-9, 1e-6, "log_softmax dx");
        }
    }

    #[test]
    fn f32_path_matches_f64_path_and_is_deterministic() {
        let (rows, row) = (300, 257);
        let n = rows * row;
        let x32: Vec<f32> = inputs(5, n).iter().map(|&v| v as f32).collect();
        let dy32: Vec<f32> = rand_vec(6, n).iter().map(|&v| v as f32).collect();
        let x: Vec<f64> = x32.iter().map(|&v| v as f64).collect();
        let dy: Vec<f64> = dy32.iter().map(|&v| v as f64).collect();
        let widen = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
        let (mut y32, mut y) = (vec![0f32; n], vec![0f64; n]);
        let (mut d32, mut d) = (vec![0f32; n], vec![0f64; n]);
        softmax_forward(&x32, row, &mut y32);
        softmax_forward(&x, row, &mut y);
        assert_close(&widen(&y32), &y, 1e-8, 1e-5, "softmax f32");
        softmax_backward(&y32, &dy32, row, &mut d32);
        softmax_backward(&y, &dy, row, &mut d);
        assert_close(&widen(&d32), &d, 1e-7, 1e-4, "softmax backward f32");
        log_softmax_forward(&x32, row, &mut y32);
        log_softmax_forward(&x, row, &mut y);
        assert_close(&widen(&y32), &y, 1e-5, 1e-6, "log_softmax f32");
        log_softmax_backward(&y32, &dy32, row, &mut d32);
        log_softmax_backward(&y, &dy, row, &mut d);
        assert_close(&widen(&d32), &d, 1e-5, 1e-4, "log_softmax backward f32");

        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let mut out = vec![0f32; n];
            pool.install(|| softmax_forward(&x32, row, &mut out));
            out
        };
        let (a, b) = (run(1), run(2));
        assert!(a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()));
    }
}
