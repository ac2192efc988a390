//! Element-wise arithmetic on flat buffers: sums, products, scaling, AXPY,
//! bias addition and its gradient.
//!
//! Every kernel here is memory-bound, so each makes exactly one pass over its
//! inputs. The generic maps also carry the point-wise activations, which are
//! compute-bound: their loops run in the widest vector copy the CPU supports
//! (see `wide`), bit-identical to the baseline. Large buffers are cut into fixed chunks processed by `rayon`; since
//! no element depends on another (except in [`bias_grad`], whose reduction
//! order is fixed by the shape alone), results never depend on the number of
//! threads.

use super::mixed::{self, Dst, Src};
use super::wide::widest;
use crate::Real;
use half::bf16;
use rayon::prelude::*;

/// Elements per parallel task: large enough to amortise scheduling, small
/// enough to spread a few megabytes over every core.
pub(crate) const PAR_CHUNK: usize = 1 << 15;

/// `out[i] = f(x[i])`, in parallel chunks once the buffer is large.
#[inline]
pub(crate) fn map1<T, U, F>(x: &[T], out: &mut [U], f: F)
where
    T: Copy + Sync,
    U: Send,
    F: Fn(T) -> U + Sync,
{
    assert_eq!(x.len(), out.len(), "input and output lengths differ");
    let run = |x: &[T], out: &mut [U]| {
        widest(
            #[inline(always)]
            || {
                for (o, &v) in out.iter_mut().zip(x) {
                    *o = f(v);
                }
            },
        )
    };
    if out.len() <= PAR_CHUNK {
        run(x, out);
    } else {
        out.par_chunks_mut(PAR_CHUNK).zip(x.par_chunks(PAR_CHUNK)).for_each(|(o, x)| run(x, o));
    }
}

/// `out[i] = f(a[i], b[i])`, in parallel chunks once the buffers are large.
#[inline]
pub(crate) fn map2<T, F>(a: &[T], b: &[T], out: &mut [T], f: F)
where
    T: Copy + Send + Sync,
    F: Fn(T, T) -> T + Sync,
{
    assert_eq!(a.len(), out.len(), "first input and output lengths differ");
    assert_eq!(b.len(), out.len(), "second input and output lengths differ");
    let run = |a: &[T], b: &[T], out: &mut [T]| {
        widest(
            #[inline(always)]
            || {
                for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
                    *o = f(x, y);
                }
            },
        )
    };
    if out.len() <= PAR_CHUNK {
        run(a, b, out);
    } else {
        out.par_chunks_mut(PAR_CHUNK).zip(a.par_chunks(PAR_CHUNK)).zip(b.par_chunks(PAR_CHUNK)).for_each(|((o, a), b)| run(a, b, o));
    }
}

/// `acc[i] = f(acc[i], x[i])` in place, in parallel chunks once large.
#[inline]
fn update<T, F>(acc: &mut [T], x: &[T], f: F)
where
    T: Real,
    F: Fn(T, T) -> T + Sync,
{
    assert_eq!(acc.len(), x.len(), "accumulator and input lengths differ");
    let run = |acc: &mut [T], x: &[T]| {
        widest(
            #[inline(always)]
            || {
                for (a, &v) in acc.iter_mut().zip(x) {
                    *a = f(*a, v);
                }
            },
        )
    };
    if acc.len() <= PAR_CHUNK {
        run(acc, x);
    } else {
        acc.par_chunks_mut(PAR_CHUNK).zip(x.par_chunks(PAR_CHUNK)).for_each(|(a, x)| run(a, x));
    }
}

/// `out[i] = a[i] + b[i]`; all three buffers have the same length.
pub fn add<T: Real>(a: &[T], b: &[T], out: &mut [T]) {
    map2(a, b, out, |x, y| x + y);
}

/// `out[i] = a[i] - b[i]`; all three buffers have the same length.
pub fn sub<T: Real>(a: &[T], b: &[T], out: &mut [T]) {
    map2(a, b, out, |x, y| x - y);
}

/// `out[i] = a[i] * b[i]`; all three buffers have the same length.
///
/// Its gradient needs no kernel of its own: `da = dy * b` and `db = dy * a`
/// are two more calls to `mul`.
pub fn mul<T: Real>(a: &[T], b: &[T], out: &mut [T]) {
    map2(a, b, out, |x, y| x * y);
}

/// `out[i] = s * x[i]`; `x` and `out` have the same length.
///
/// The gradient is `dx = s * dy`, i.e. `scale` again.
pub fn scale<T: Real>(x: &[T], s: T, out: &mut [T]) {
    map1(x, out, move |v| s * v);
}

/// [`add`] on operands stored as f32, bf16 or f16 (see [`mixed::map2`]):
/// the f32 sum of the widened values, rounded once to the output's type.
pub fn add_mixed(a: Src<'_>, b: Src<'_>, out: Dst<'_>) {
    mixed::map2(a, b, out, |x, y| x + y);
}

/// [`sub`] on operands stored as f32, bf16 or f16 (see [`add_mixed`]).
pub fn sub_mixed(a: Src<'_>, b: Src<'_>, out: Dst<'_>) {
    mixed::map2(a, b, out, |x, y| x - y);
}

/// [`mul`] on operands stored as f32, bf16 or f16 (see [`add_mixed`]).
pub fn mul_mixed(a: Src<'_>, b: Src<'_>, out: Dst<'_>) {
    mixed::map2(a, b, out, |x, y| x * y);
}

/// [`scale`] on operands stored as f32, bf16 or f16 (see [`add_mixed`]).
pub fn scale_mixed(x: Src<'_>, s: f32, out: Dst<'_>) {
    mixed::map1(x, out, move |v| s * v);
}

/// `acc[i] += x[i]`: accumulates a gradient contribution in place.
pub fn add_assign<T: Real>(acc: &mut [T], x: &[T]) {
    update(acc, x, |a, v| a + v);
}

/// `y[i] += alpha * x[i]` (BLAS AXPY); `x` and `y` have the same length.
pub fn axpy<T: Real>(alpha: T, x: &[T], y: &mut [T]) {
    update(y, x, move |a, v| a + alpha * v);
}

/// Adds a bias to every row: `out[r, j] = x[r, j] + bias[j]`.
///
/// `x` and `out` are row-major `[rows, bias.len()]`; `x.len()` must be a
/// multiple of `bias.len()` (an empty bias only goes with an empty `x`).
pub fn add_bias<T: Real>(x: &[T], bias: &[T], out: &mut [T]) {
    let cols = bias.len();
    assert_eq!(x.len(), out.len(), "input and output lengths differ");
    if cols == 0 {
        assert!(x.is_empty(), "empty bias with a non-empty input");
        return;
    }
    assert_eq!(x.len() % cols, 0, "input length is not a multiple of the bias length");
    let run = |x: &[T], out: &mut [T]| {
        for (o, xr) in out.chunks_exact_mut(cols).zip(x.chunks_exact(cols)) {
            for ((o, &v), &b) in o.iter_mut().zip(xr).zip(bias) {
                *o = v + b;
            }
        }
    };
    if x.len() <= PAR_CHUNK {
        run(x, out);
    } else {
        // Whole rows per task so that each task walks the bias from its start.
        let span = cols * (PAR_CHUNK / cols).max(1);
        out.par_chunks_mut(span).zip(x.par_chunks(span)).for_each(|(o, x)| run(x, o));
    }
}

/// Rows summed sequentially into one partial sum in [`bias_grad`]. Fixed, so
/// the rounding of the result depends on the shape only.
const BIAS_ROW_BLOCK: usize = 64;
/// Columns per task in [`bias_grad`] (a multiple of the SIMD width).
const BIAS_COL_BLOCK: usize = 2048;

/// Gradient of [`add_bias`] with respect to the bias: `dbias[j] = sum_r dy[r, j]`.
///
/// `dy` is row-major `[rows, dbias.len()]`; `dbias` is overwritten. Rows are
/// summed in blocks of fixed height whose partial sums are then added in
/// block order, so the result is bit-identical whatever the thread count.
pub fn bias_grad<T: Real>(dy: &[T], dbias: &mut [T]) {
    bias_grad_by(dy, dbias, |v| v)
}

/// [`bias_grad`] of a bf16 gradient, summed in f32: the same sums in the same
/// order as [`bias_grad`] on the gradient widened to f32 (widening is exact),
/// so the same bits, without the widened copy.
pub fn bias_grad_bf16(dy: &[bf16], dbias: &mut [f32]) {
    bias_grad_by(dy, dbias, |v| f32::from_bits((v.to_bits() as u32) << 16))
}

/// [`bias_grad`] reading `dy` through `widen`, which must be exact.
fn bias_grad_by<S: Copy + Sync, T: Real>(dy: &[S], dbias: &mut [T], widen: impl Fn(S) -> T + Sync) {
    let cols = dbias.len();
    if cols == 0 {
        assert!(dy.is_empty(), "empty bias with a non-empty gradient");
        return;
    }
    assert_eq!(dy.len() % cols, 0, "gradient length is not a multiple of the bias length");
    let rows = dy.len() / cols;

    // Sums rows `r0..r0 + h` of columns `c0..c0 + acc.len()` into `acc`.
    let block_sum = |acc: &mut [T], r0: usize, h: usize, c0: usize| {
        acc.fill(T::zero());
        for r in r0..r0 + h {
            let src = &dy[r * cols + c0..r * cols + c0 + acc.len()];
            for (a, &v) in acc.iter_mut().zip(src) {
                *a += widen(v);
            }
        }
    };

    if rows <= BIAS_ROW_BLOCK {
        // One block: every column is a plain top-to-bottom sum.
        if dy.len() <= PAR_CHUNK {
            block_sum(dbias, 0, rows, 0);
        } else {
            dbias.par_chunks_mut(BIAS_COL_BLOCK).enumerate().for_each(|(c, acc)| block_sum(acc, 0, rows, c * BIAS_COL_BLOCK));
        }
        return;
    }

    let blocks = rows.div_ceil(BIAS_ROW_BLOCK);
    let height = |b: usize| BIAS_ROW_BLOCK.min(rows - b * BIAS_ROW_BLOCK);
    let mut partials = vec![T::zero(); blocks * cols];
    let sequential = dy.len() <= PAR_CHUNK;
    if sequential {
        for (b, p) in partials.chunks_exact_mut(cols).enumerate() {
            block_sum(p, b * BIAS_ROW_BLOCK, height(b), 0);
        }
    } else {
        partials.par_chunks_mut(cols).enumerate().for_each(|(b, p)| {
            p.par_chunks_mut(BIAS_COL_BLOCK).enumerate().for_each(|(c, acc)| block_sum(acc, b * BIAS_ROW_BLOCK, height(b), c * BIAS_COL_BLOCK));
        });
    }
    let combine = |c0: usize, out: &mut [T]| {
        let width = out.len();
        out.copy_from_slice(&partials[c0..c0 + width]);
        for p in partials.chunks_exact(cols).skip(1) {
            for (o, &v) in out.iter_mut().zip(&p[c0..c0 + width]) {
                *o += v;
            }
        }
    };
    if sequential {
        combine(0, dbias);
    } else {
        dbias.par_chunks_mut(BIAS_COL_BLOCK).enumerate().for_each(|(c, out)| combine(c * BIAS_COL_BLOCK, out));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{assert_close, dot, numeric_grad, rand_vec};

    #[test]
    fn binary_ops_match_scalar_arithmetic() {
        for n in [0, 1, 3, 17, 129, PAR_CHUNK * 2 + 5] {
            let a = rand_vec(1, n);
            let b = rand_vec(2, n);
            let mut out = vec![0.0; n];
            add(&a, &b, &mut out);
            assert!(out.iter().enumerate().all(|(i, &o)| o == a[i] + b[i]));
            sub(&a, &b, &mut out);
            assert!(out.iter().enumerate().all(|(i, &o)| o == a[i] - b[i]));
            mul(&a, &b, &mut out);
            assert!(out.iter().enumerate().all(|(i, &o)| o == a[i] * b[i]));
            scale(&a, -2.5, &mut out);
            assert!(out.iter().enumerate().all(|(i, &o)| o == -2.5 * a[i]));
            let mut acc = b.clone();
            add_assign(&mut acc, &a);
            assert!(acc.iter().enumerate().all(|(i, &o)| o == b[i] + a[i]));
            let mut y = b.clone();
            axpy(0.75, &a, &mut y);
            assert!(y.iter().enumerate().all(|(i, &o)| o == b[i] + 0.75 * a[i]));
        }
    }

    #[test]
    fn mul_and_scale_gradients_match_finite_differences() {
        for n in [1, 3, 17, 129] {
            let a = rand_vec(3, n);
            let b = rand_vec(4, n);
            let dy = rand_vec(5, n);
            // d<a*b, dy>/da = dy * b, computed with the forward kernel itself.
            let mut da = vec![0.0; n];
            mul(&dy, &b, &mut da);
            let num = numeric_grad(
                |a| {
                    let mut y = vec![0.0; n];
                    mul(a, &b, &mut y);
                    dot(&y, &dy)
                },
                &a,
                1e-6,
            );
            assert_close(&da, &num, 1e-8, 1e-7, "mul da");
            let mut dx = vec![0.0; n];
            scale(&dy, 1.7, &mut dx);
            let num = numeric_grad(
                |x| {
                    let mut y = vec![0.0; n];
                    scale(x, 1.7, &mut y);
                    dot(&y, &dy)
                },
                &a,
                1e-6,
            );
            assert_close(&dx, &num, 1e-8, 1e-7, "scale dx");
        }
    }

    #[test]
    fn add_bias_broadcasts_over_rows() {
        let x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let mut out = [0.0; 6];
        add_bias(&x, &[10.0, 20.0, 30.0], &mut out);
        assert_eq!(out, [11.0, 22.0, 33.0, 14.0, 25.0, 36.0]);
        // Large enough to take the parallel path, with a row length that does
        // not divide the task size.
        let cols = 1000;
        let rows = 77;
        let x = rand_vec(6, rows * cols);
        let bias = rand_vec(7, cols);
        let mut out = vec![0.0; rows * cols];
        add_bias(&x, &bias, &mut out);
        for (i, &o) in out.iter().enumerate() {
            assert_eq!(o, x[i] + bias[i % cols]);
        }
    }

    #[test]
    fn bias_grad_matches_finite_differences_of_add_bias() {
        for (rows, cols) in [(1, 1), (3, 17), (17, 3), (129, 5), (2, 129), (200, 7)] {
            let x = rand_vec(8, rows * cols);
            let bias = rand_vec(9, cols);
            let dy = rand_vec(10, rows * cols);
            let mut db = vec![f64::NAN; cols];
            bias_grad(&dy, &mut db);
            let num = numeric_grad(
                |b| {
                    let mut y = vec![0.0; rows * cols];
                    add_bias(&x, b, &mut y);
                    dot(&y, &dy)
                },
                &bias,
                1e-6,
            );
            assert_close(&db, &num, 1e-7, 1e-7, "bias_grad");
        }
    }

    #[test]
    fn bias_grad_is_exact_on_integers_and_thread_count_independent() {
        let (rows, cols) = (1031, 300);
        let dy: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919) % 13) as f32 - 6.0).collect();
        let mut expected = vec![0f32; cols];
        for r in 0..rows {
            for j in 0..cols {
                expected[j] += dy[r * cols + j];
            }
        }
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let mut db = vec![0f32; cols];
            pool.install(|| bias_grad(&dy, &mut db));
            db
        };
        let one = run(1);
        assert_eq!(one, expected);
        // Non-integer values so rounding matters: the bits must not move.
        let dy: Vec<f32> = rand_vec(11, rows * cols).iter().map(|&v| v as f32).collect();
        let grad = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let mut db = vec![0f32; cols];
            pool.install(|| bias_grad(&dy, &mut db));
            db
        };
        let (a, b) = (grad(1), grad(3));
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
    }

    #[test]
    fn f32_path_matches_f64_path() {
        let (rows, cols) = (70, 33);
        let dy = rand_vec(12, rows * cols);
        let dy32: Vec<f32> = dy.iter().map(|&v| v as f32).collect();
        let mut d64 = vec![0.0; cols];
        bias_grad(&dy, &mut d64);
        let mut d32 = vec![0f32; cols];
        bias_grad(&dy32, &mut d32);
        let d32: Vec<f64> = d32.iter().map(|&v| v as f64).collect();
        assert_close(&d32, &d64, 1e-4, 1e-5, "bias_grad f32 vs f64");
    }

    #[test]
    fn bias_grad_of_bf16_gives_the_bits_of_the_widened_gradient() {
        for (rows, cols) in [(1031, 300), (5, 7), (64, 2049), (2048, 384)] {
            let dy: Vec<bf16> = rand_vec(13, rows * cols).iter().map(|&v| bf16::from_f64(v)).collect();
            let wide: Vec<f32> = dy.iter().map(|v| v.to_f32()).collect();
            let mut want = vec![0f32; cols];
            bias_grad(&wide, &mut want);
            for threads in [1, 3] {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                let mut got = vec![f32::NAN; cols];
                pool.install(|| bias_grad_bf16(&dy, &mut got));
                assert!(got.iter().zip(&want).all(|(g, w)| g.to_bits() == w.to_bits()), "{rows}x{cols}, {threads} threads");
            }
        }
    }
}
