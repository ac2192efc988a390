//! Layer normalisation and RMS normalisation over the last dimension.
//!
//! Every buffer is row-major with rows of length `row`: `x`, `y`, `dy` and
//! `dx` hold `rows * row` elements, `gamma`/`beta` (and their gradients) hold
//! `row`, and the saved statistics `mean`/`rstd` hold one value per row.
//! Statistics are computed in the compute type `T` with a two-pass variance
//! (mean first, then squared deviations), which avoids the cancellation of
//! the one-pass `E[x²] − E[x]²` formula; `eps` is added inside the square root.
//!
//! The parameter gradients are sums over rows. To keep them bit-identical
//! whatever the number of threads, rows are split into chunks whose size
//! depends only on the shape; each chunk produces a partial sum sequentially
//! and the partials are added in chunk order.

use super::mixed::{Dst, Src, BLOCK};
use crate::Real;
use rayon::prelude::*;

/// Below this many elements the work stays on the calling thread.
const PAR_MIN_ELEMS: usize = 32 * 1024;
/// Rough number of elements one parallel task should cover.
const TASK_ELEMS: usize = 16 * 1024;
/// Upper bound on the number of partial parameter-gradient vectors, so their
/// memory stays small for wide rows and long batches.
const MAX_PARTIALS: usize = 64;

/// Rows per parallel task for row-independent work.
fn rows_per_task(row: usize) -> usize {
    (TASK_ELEMS / row).max(1)
}

/// Rows per partial-sum chunk of the parameter gradients: a function of the
/// shape only, never of the thread count.
fn rows_per_partial(rows: usize, row: usize) -> usize {
    rows_per_task(row).max(rows.div_ceil(MAX_PARTIALS)).max(1)
}

/// `Σ f(a[j], b[j])` with eight independent accumulators combined in a fixed
/// order: the loop vectorises and the result does not depend on anything but
/// the inputs.
#[inline]
fn lane_sum<T: Real>(a: &[T], b: &[T], f: impl Fn(T, T) -> T) -> T {
    const L: usize = 8;
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [T::zero(); L];
    let (ac, bc) = (a.chunks_exact(L), b.chunks_exact(L));
    let mut tail = T::zero();
    for (&x, &y) in ac.remainder().iter().zip(bc.remainder()) {
        tail += f(x, y);
    }
    for (ca, cb) in ac.zip(bc) {
        for k in 0..L {
            acc[k] += f(ca[k], cb[k]);
        }
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// Shape checks shared by all kernels; returns the number of rows.
fn rows_of(len: usize, row: usize) -> usize {
    assert!(row > 0, "row length must be positive");
    assert_eq!(len % row, 0, "buffer length {len} is not a multiple of the row length {row}");
    len / row
}

/// Layer normalisation: `y = (x − mean) · rstd · gamma + beta` per row, with
/// `rstd = 1 / sqrt(var + eps)` and the biased (population) variance.
///
/// `x`, `y`: `rows × row`; `gamma`, `beta`: `row`; `mean`, `rstd`: `rows`
/// (overwritten, saved for [`layernorm_backward`]). `beta = None` means no bias.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_forward<T: Real>(x: &[T], gamma: &[T], beta: Option<&[T]>, eps: f64, row: usize, y: &mut [T], mean: &mut [T], rstd: &mut [T]) {
    let rows = rows_of(x.len(), row);
    assert_eq!(gamma.len(), row, "gamma length");
    if let Some(b) = beta {
        assert_eq!(b.len(), row, "beta length");
    }
    assert_eq!(y.len(), x.len(), "y length");
    assert_eq!(mean.len(), rows, "mean length");
    assert_eq!(rstd.len(), rows, "rstd length");
    let eps = T::lit(eps);
    let inv_n = T::one() / T::lit(row as f64);

    let one_row = |xr: &[T], yr: &mut [T], mu_out: &mut T, rs_out: &mut T| {
        let mu = lane_sum(xr, xr, |a, _| a) * inv_n;
        let var = lane_sum(xr, xr, |a, _| (a - mu) * (a - mu)) * inv_n;
        let rs = T::one() / (var + eps).sqrt();
        match beta {
            Some(b) => {
                for (((o, &xv), &g), &bv) in yr.iter_mut().zip(xr).zip(gamma).zip(b) {
                    *o = (xv - mu) * rs * g + bv;
                }
            }
            None => {
                for ((o, &xv), &g) in yr.iter_mut().zip(xr).zip(gamma) {
                    *o = (xv - mu) * rs * g;
                }
            }
        }
        *mu_out = mu;
        *rs_out = rs;
    };

    if x.len() < PAR_MIN_ELEMS {
        for (((xr, yr), mu), rs) in x.chunks(row).zip(y.chunks_mut(row)).zip(mean.iter_mut()).zip(rstd.iter_mut()) {
            one_row(xr, yr, mu, rs);
        }
    } else {
        x.par_chunks(row)
            .zip(y.par_chunks_mut(row))
            .zip(mean.par_iter_mut())
            .zip(rstd.par_iter_mut())
            .with_min_len(rows_per_task(row))
            .for_each(|(((xr, yr), mu), rs)| one_row(xr, yr, mu, rs));
    }
}

/// Runs `chunk` over fixed row chunks (in parallel when large) and returns the
/// per-chunk partial sums in chunk order. `chunk` gets the chunk's rows of
/// `x`, `dy`, `dx`, the matching slices of `stat_a`/`stat_b` (per-row
/// statistics) and must return its partial parameter gradients.
#[allow(clippy::type_complexity)]
fn chunked_partials<T: Real>(
    x: &[T],
    dy: &[T],
    dx: &mut [T],
    stat_a: &[T],
    stat_b: &[T],
    row: usize,
    chunk: impl Fn(&[T], &[T], &mut [T], &[T], &[T]) -> Vec<T> + Sync + Send,
) -> Vec<Vec<T>> {
    let rows = x.len() / row;
    let cr = rows_per_partial(rows, row);
    let run = |((((xc, dyc), dxc), ac), bc): ((((&[T], &[T]), &mut [T]), &[T]), &[T])| chunk(xc, dyc, dxc, ac, bc);
    if x.len() < PAR_MIN_ELEMS {
        x.chunks(cr * row).zip(dy.chunks(cr * row)).zip(dx.chunks_mut(cr * row)).zip(stat_a.chunks(cr)).zip(stat_b.chunks(cr)).map(run).collect()
    } else {
        x.par_chunks(cr * row)
            .zip(dy.par_chunks(cr * row))
            .zip(dx.par_chunks_mut(cr * row))
            .zip(stat_a.par_chunks(cr))
            .zip(stat_b.par_chunks(cr))
            .map(run)
            .collect()
    }
}

/// Backward of [`layernorm_forward`].
///
/// With `x̂ = (x − mean) · rstd` and `g = dy · gamma`:
/// `dx = rstd · (g − mean(g) − x̂ · mean(g · x̂))`, `dgamma = Σ_rows dy · x̂`,
/// `dbeta = Σ_rows dy`. `x`, `dy`, `dx`: `rows × row`; `gamma`, `dgamma`,
/// `dbeta`: `row`; `mean`, `rstd`: `rows` as saved by the forward. All
/// gradients are overwritten; the row sums are deterministic and independent
/// of the thread count.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward<T: Real>(
    x: &[T],
    gamma: &[T],
    mean: &[T],
    rstd: &[T],
    dy: &[T],
    row: usize,
    dx: &mut [T],
    dgamma: &mut [T],
    dbeta: Option<&mut [T]>,
) {
    let rows = rows_of(x.len(), row);
    assert_eq!(gamma.len(), row, "gamma length");
    assert_eq!(mean.len(), rows, "mean length");
    assert_eq!(rstd.len(), rows, "rstd length");
    assert_eq!(dy.len(), x.len(), "dy length");
    assert_eq!(dx.len(), x.len(), "dx length");
    assert_eq!(dgamma.len(), row, "dgamma length");
    let with_beta = dbeta.is_some();
    if let Some(b) = dbeta.as_deref() {
        assert_eq!(b.len(), row, "dbeta length");
    }
    let inv_n = T::one() / T::lit(row as f64);
    let chunk = |xc: &[T], dyc: &[T], dxc: &mut [T], mc: &[T], rc: &[T]| {
        // Partial dgamma in [0, row), partial dbeta in [row, 2 row).
        let mut part = vec![T::zero(); if with_beta { 2 * row } else { row }];
        layernorm_backward_rows(xc, dyc, dxc, mc, rc, gamma, inv_n, &mut part);
        part
    };
    let partials = chunked_partials(x, dy, dx, mean, rstd, row, chunk);
    sum_partials(&partials, dgamma, dbeta);
}

/// The rows `xc`, `dyc` of one chunk of [`layernorm_backward`] (statistics
/// `mc`, `rc`): writes their `dx` into `dxc` and adds their terms of
/// `dgamma` to `part[..row]` and, when `part` is longer, of `dbeta` to
/// `part[row..]`, row after row.
#[allow(clippy::too_many_arguments)]
#[inline]
fn layernorm_backward_rows<T: Real>(xc: &[T], dyc: &[T], dxc: &mut [T], mc: &[T], rc: &[T], gamma: &[T], inv_n: T, part: &mut [T]) {
    let row = gamma.len();
    let (pg, pb) = part.split_at_mut(row);
    let with_beta = !pb.is_empty();
    for ((((xr, dyr), dxr), &mu), &rs) in xc.chunks(row).zip(dyc.chunks(row)).zip(dxc.chunks_mut(row)).zip(mc).zip(rc) {
        // dx doubles as scratch for g = dy · gamma.
        for ((g, &d), &ga) in dxr.iter_mut().zip(dyr).zip(gamma) {
            *g = d * ga;
        }
        let mean_g = lane_sum(dxr, dxr, |g, _| g) * inv_n;
        let mean_gx = lane_sum(dxr, xr, |g, xv| g * (xv - mu)) * rs * inv_n;
        for (g, &xv) in dxr.iter_mut().zip(xr) {
            *g = rs * (*g - mean_g - (xv - mu) * rs * mean_gx);
        }
        for ((p, &d), &xv) in pg.iter_mut().zip(dyr).zip(xr) {
            *p += d * ((xv - mu) * rs);
        }
        if with_beta {
            for (p, &d) in pb.iter_mut().zip(dyr) {
                *p += d;
            }
        }
    }
}

/// Adds the per-chunk partial sums in chunk order: `dgamma` from each
/// partial's first `row` values, `dbeta` (when asked for) from the rest.
fn sum_partials<T: Real>(partials: &[Vec<T>], dgamma: &mut [T], dbeta: Option<&mut [T]>) {
    let row = dgamma.len();
    dgamma.fill(T::zero());
    for p in partials {
        for (o, &v) in dgamma.iter_mut().zip(&p[..row]) {
            *o += v;
        }
    }
    if let Some(db) = dbeta {
        db.fill(T::zero());
        for p in partials {
            for (o, &v) in db.iter_mut().zip(&p[row..]) {
                *o += v;
            }
        }
    }
}

/// RMS normalisation: `y = x · rstd · gamma` per row with
/// `rstd = 1 / sqrt(mean(x²) + eps)` (no centring, no bias).
///
/// `x`, `y`: `rows × row`; `gamma`: `row`; `rstd`: `rows` (overwritten, saved
/// for [`rmsnorm_backward`]).
pub fn rmsnorm_forward<T: Real>(x: &[T], gamma: &[T], eps: f64, row: usize, y: &mut [T], rstd: &mut [T]) {
    let rows = rows_of(x.len(), row);
    assert_eq!(gamma.len(), row, "gamma length");
    assert_eq!(y.len(), x.len(), "y length");
    assert_eq!(rstd.len(), rows, "rstd length");
    let eps = T::lit(eps);
    let inv_n = T::one() / T::lit(row as f64);

    let one_row = |((xr, yr), rs_out): ((&[T], &mut [T]), &mut T)| {
        let ms = lane_sum(xr, xr, |a, _| a * a) * inv_n;
        let rs = T::one() / (ms + eps).sqrt();
        for ((o, &xv), &g) in yr.iter_mut().zip(xr).zip(gamma) {
            *o = xv * rs * g;
        }
        *rs_out = rs;
    };

    if x.len() < PAR_MIN_ELEMS {
        x.chunks(row).zip(y.chunks_mut(row)).zip(rstd.iter_mut()).for_each(one_row);
    } else {
        x.par_chunks(row).zip(y.par_chunks_mut(row)).zip(rstd.par_iter_mut()).with_min_len(rows_per_task(row)).for_each(one_row);
    }
}

/// Backward of [`rmsnorm_forward`].
///
/// With `x̂ = x · rstd` and `g = dy · gamma`: `dx = rstd · (g − x̂ · mean(g · x̂))`
/// and `dgamma = Σ_rows dy · x̂`. `x`, `dy`, `dx`: `rows × row`; `gamma`,
/// `dgamma`: `row`; `rstd`: `rows` as saved by the forward. Both gradients are
/// overwritten; the row sum is deterministic and independent of the thread count.
pub fn rmsnorm_backward<T: Real>(x: &[T], gamma: &[T], rstd: &[T], dy: &[T], row: usize, dx: &mut [T], dgamma: &mut [T]) {
    let rows = rows_of(x.len(), row);
    assert_eq!(gamma.len(), row, "gamma length");
    assert_eq!(rstd.len(), rows, "rstd length");
    assert_eq!(dy.len(), x.len(), "dy length");
    assert_eq!(dx.len(), x.len(), "dx length");
    assert_eq!(dgamma.len(), row, "dgamma length");
    let inv_n = T::one() / T::lit(row as f64);
    let chunk = |xc: &[T], dyc: &[T], dxc: &mut [T], rc: &[T], _: &[T]| {
        let mut pg = vec![T::zero(); row];
        rmsnorm_backward_rows(xc, dyc, dxc, rc, gamma, inv_n, &mut pg);
        pg
    };
    let partials = chunked_partials(x, dy, dx, rstd, rstd, row, chunk);
    sum_partials(&partials, dgamma, None);
}

/// The rows `xc`, `dyc` of one chunk of [`rmsnorm_backward`] (statistics
/// `rc`): writes their `dx` into `dxc` and adds their terms of `dgamma` to
/// `pg`, row after row.
#[inline]
fn rmsnorm_backward_rows<T: Real>(xc: &[T], dyc: &[T], dxc: &mut [T], rc: &[T], gamma: &[T], inv_n: T, pg: &mut [T]) {
    let row = gamma.len();
    for (((xr, dyr), dxr), &rs) in xc.chunks(row).zip(dyc.chunks(row)).zip(dxc.chunks_mut(row)).zip(rc) {
        for ((g, &d), &ga) in dxr.iter_mut().zip(dyr).zip(gamma) {
            *g = d * ga;
        }
        let mean_gx = lane_sum(dxr, xr, |g, xv| g * xv) * rs * inv_n;
        for (g, &xv) in dxr.iter_mut().zip(xr) {
            *g = rs * (*g - xv * rs * mean_gx);
        }
        for ((p, &d), &xv) in pg.iter_mut().zip(dyr).zip(xr) {
            *p += d * (xv * rs);
        }
    }
}

/// [`chunked_partials`] on operands in their storage type: the same chunks,
/// each walked in blocks of whole rows widened into scratch (at most
/// [`BLOCK`] elements, or one row), so `rows` sees the rows of a chunk in
/// order and adds to the chunk's partial `part_len` sums exactly as the f32
/// kernel does; `dx` is rounded into its storage type a block at a time.
#[allow(clippy::too_many_arguments)]
fn mixed_partials(
    x: Src<'_>,
    dy: Src<'_>,
    dx: Dst<'_>,
    stat_a: &[f32],
    stat_b: &[f32],
    row: usize,
    part_len: usize,
    rows: impl Fn(&[f32], &[f32], &mut [f32], &[f32], &[f32], &mut [f32]) + Sync + Send,
) -> Vec<Vec<f32>> {
    let n_rows = x.len() / row;
    let cr = rows_per_partial(n_rows, row);
    let per_block = (BLOCK / row).max(1);
    let run = |(c, mut dxc): (usize, Dst<'_>)| {
        let mut part = vec![0f32; part_len];
        let (mut xs, mut dys, mut dxs) = (vec![0f32; per_block * row], vec![0f32; per_block * row], vec![0f32; per_block * row]);
        let chunk_rows = dxc.len() / row;
        for b0 in (0..chunk_rows).step_by(per_block) {
            let nb = per_block.min(chunk_rows - b0);
            let (r0, r1) = (c * cr + b0, c * cr + b0 + nb);
            let xb = x.slice(r0 * row..r1 * row).read(&mut xs);
            let dyb = dy.slice(r0 * row..r1 * row).read(&mut dys);
            let dxb = &mut dxs[..nb * row];
            rows(xb, dyb, dxb, &stat_a[r0..r1], &stat_b[r0..r1], &mut part);
            dxc.slice_mut(b0 * row..(b0 + nb) * row).store(dxb);
        }
        part
    };
    let chunks = dx.into_chunks(cr * row).into_iter().enumerate();
    if x.len() < PAR_MIN_ELEMS {
        chunks.map(run).collect()
    } else {
        chunks.collect::<Vec<_>>().into_par_iter().map(run).collect()
    }
}

/// [`layernorm_backward`] on `x`, `dy` and `dx` stored as f32, bf16 or f16,
/// computed in f32 a block of rows at a time: the same bits as
/// [`layernorm_backward`] on the operands widened to f32, with `dx` then
/// rounded to its type, without the widened copies. `gamma`, the statistics
/// and the parameter gradients are f32.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward_mixed(
    x: Src<'_>,
    gamma: &[f32],
    mean: &[f32],
    rstd: &[f32],
    dy: Src<'_>,
    row: usize,
    dx: Dst<'_>,
    dgamma: &mut [f32],
    dbeta: Option<&mut [f32]>,
) {
    let rows = rows_of(x.len(), row);
    assert_eq!(gamma.len(), row, "gamma length");
    assert_eq!(mean.len(), rows, "mean length");
    assert_eq!(rstd.len(), rows, "rstd length");
    assert_eq!(dy.len(), x.len(), "dy length");
    assert_eq!(dx.len(), x.len(), "dx length");
    assert_eq!(dgamma.len(), row, "dgamma length");
    let inv_n = 1.0 / row as f32;
    let part_len = if dbeta.is_some() { 2 * row } else { row };
    let partials =
        mixed_partials(x, dy, dx, mean, rstd, row, part_len, |xc, dyc, dxc, mc, rc, part| layernorm_backward_rows(xc, dyc, dxc, mc, rc, gamma, inv_n, part));
    sum_partials(&partials, dgamma, dbeta);
}

/// [`rmsnorm_backward`] on `x`, `dy` and `dx` stored as f32, bf16 or f16
/// (see [`layernorm_backward_mixed`]): the same bits as the f32 kernel on
/// the widened operands.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_backward_mixed(x: Src<'_>, gamma: &[f32], rstd: &[f32], dy: Src<'_>, row: usize, dx: Dst<'_>, dgamma: &mut [f32]) {
    let rows = rows_of(x.len(), row);
    assert_eq!(gamma.len(), row, "gamma length");
    assert_eq!(rstd.len(), rows, "rstd length");
    assert_eq!(dy.len(), x.len(), "dy length");
    assert_eq!(dx.len(), x.len(), "dx length");
    assert_eq!(dgamma.len(), row, "dgamma length");
    let inv_n = 1.0 / row as f32;
    let partials = mixed_partials(x, dy, dx, rstd, rstd, row, row, |xc, dyc, dxc, rc, _, part| rmsnorm_backward_rows(xc, dyc, dxc, rc, gamma, inv_n, part));
    sum_partials(&partials, dgamma, None);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{assert_close, dot, numeric_grad, rand_vec};

    const EPS: f64 = 1e-5;
    const FD: f64 = 1e-6;

    fn ln_fwd(x: &[f64], g: &[f64], b: Option<&[f64]>, row: usize) -> Vec<f64> {
        let rows = x.len() / row;
        let (mut y, mut m, mut r) = (vec![0.0; x.len()], vec![0.0; rows], vec![0.0; rows]);
        layernorm_forward(x, g, b, EPS, row, &mut y, &mut m, &mut r);
        y
    }

    fn rms_fwd(x: &[f64], g: &[f64], row: usize) -> Vec<f64> {
        let (mut y, mut r) = (vec![0.0; x.len()], vec![0.0; x.len() / row]);
        rmsnorm_forward(x, g, EPS, row, &mut y, &mut r);
        y
    }

    fn check_layernorm(rows: usize, row: usize, with_beta: bool, seed: u64) {
        let n = rows * row;
        let x = rand_vec(seed, n);
        let g: Vec<f64> = rand_vec(seed + 1, row).iter().map(|v| 1.0 + 0.5 * v).collect();
        let b = rand_vec(seed + 2, row);
        let w = rand_vec(seed + 3, n);
        let beta = with_beta.then_some(&b[..]);

        let (mut y, mut mean, mut rstd) = (vec![0.0; n], vec![0.0; rows], vec![0.0; rows]);
        layernorm_forward(&x, &g, beta, EPS, row, &mut y, &mut mean, &mut rstd);
        let (mut dx, mut dg, mut db) = (vec![7.0; n], vec![7.0; row], vec![7.0; row]);
        layernorm_backward(&x, &g, &mean, &rstd, &w, row, &mut dx, &mut dg, with_beta.then_some(&mut db[..]));

        let ctx = format!("layernorm rows={rows} row={row} beta={with_beta}");
        let ndx = numeric_grad(|x| dot(&ln_fwd(x, &g, beta, row), &w), &x, FD);
        assert_close(&dx, &ndx, 1e-6, 1e-5, &format!("{ctx} dx"));
        let ndg = numeric_grad(|g| dot(&ln_fwd(&x, g, beta, row), &w), &g, FD);
        assert_close(&dg, &ndg, 1e-6, 1e-5, &format!("{ctx} dgamma"));
        if with_beta {
            let ndb = numeric_grad(|b| dot(&ln_fwd(&x, &g, Some(b), row), &w), &b, FD);
            assert_close(&db, &ndb, 1e-6, 1e-5, &format!("{ctx} dbeta"));
        } else {
            assert!(db.iter().all(|&v| v == 7.0), "dbeta touched although None");
        }
    }

    #[test]
    fn layernorm_gradients_match_finite_differences() {
        for (i, &(rows, row)) in [(1, 3), (3, 17), (5, 1), (2, 129), (17, 4)].iter().enumerate() {
            check_layernorm(rows, row, true, 10 * i as u64);
            check_layernorm(rows, row, false, 10 * i as u64 + 5);
        }
    }

    #[test]
    fn rmsnorm_gradients_match_finite_differences() {
        for (i, &(rows, row)) in [(1, 3), (3, 17), (5, 1), (2, 129), (17, 4)].iter().enumerate() {
            let n = rows * row;
            let seed = 100 + 10 * i as u64;
            let x = rand_vec(seed, n);
            let g: Vec<f64> = rand_vec(seed + 1, row).iter().map(|v| 1.0 + 0.5 * v).collect();
            let w = rand_vec(seed + 3, n);
            let (mut y, mut rstd) = (vec![0.0; n], vec![0.0; rows]);
            rmsnorm_forward(&x, &g, EPS, row, &mut y, &mut rstd);
            let (mut dx, mut dg) = (vec![7.0; n], vec![7.0; row]);
            rmsnorm_backward(&x, &g, &rstd, &w, row, &mut dx, &mut dg);
            let ndx = numeric_grad(|x| dot(&rms_fwd(x, &g, row), &w), &x, FD);
            assert_close(&dx, &ndx, 1e-6, 1e-5, &format!("rmsnorm {rows}x{row} dx"));
            let ndg = numeric_grad(|g| dot(&rms_fwd(&x, g, row), &w), &g, FD);
            assert_close(&dg, &ndg, 1e-6, 1e-5, &format!("rmsnorm {rows}x{row} dgamma"));
        }
    }

    #[test]
    fn forward_statistics_are_right() {
        // Row [1, 2, 3, 4]: mean 2.5, population variance 1.25.
        let x = [1.0, 2.0, 3.0, 4.0, -1.0, -1.0, -1.0, -1.0];
        let g = [1.0; 4];
        let b = [0.5; 4];
        let (mut y, mut m, mut r) = ([0.0; 8], [0.0; 2], [0.0; 2]);
        layernorm_forward(&x, &g, Some(&b), 0.0, 4, &mut y, &mut m, &mut r);
        assert_eq!(m, [2.5, -1.0]);
        assert!((r[0] - 1.0 / 1.25f64.sqrt()).abs() < 1e-15);
        assert!((y[0] - (0.5 - 1.5 / 1.25f64.sqrt())).abs() < 1e-15);
        // A constant row normalises to beta, with rstd = 1/sqrt(eps).
        layernorm_forward(&x, &g, Some(&b), 1e-4, 4, &mut y, &mut m, &mut r);
        assert_eq!(&y[4..], &[0.5; 4]);
        assert!((r[1] - 100.0).abs() < 1e-9);

        let (mut y, mut r) = ([0.0; 8], [0.0; 2]);
        rmsnorm_forward(&x, &g, 0.0, 4, &mut y, &mut r);
        assert!((r[0] - 1.0 / 7.5f64.sqrt()).abs() < 1e-15);
        assert!((y[3] - 4.0 / 7.5f64.sqrt()).abs() < 1e-15);
        assert_eq!(r[1], 1.0);
    }

    #[test]
    fn f32_matches_f64() {
        let (rows, row) = (33, 129);
        let n = rows * row;
        let x = rand_vec(1, n).iter().map(|v| 3.0 * v + 2.0).collect::<Vec<_>>();
        let g = rand_vec(2, row);
        let b = rand_vec(3, row);
        let dy = rand_vec(4, n);
        let f = |v: &[f64]| v.iter().map(|&a| a as f32).collect::<Vec<f32>>();
        let up = |v: &[f32]| v.iter().map(|&a| a as f64).collect::<Vec<f64>>();

        let (mut y, mut m, mut r) = (vec![0.0; n], vec![0.0; rows], vec![0.0; rows]);
        layernorm_forward(&x, &g, Some(&b), EPS, row, &mut y, &mut m, &mut r);
        let (mut dx, mut dg, mut db) = (vec![0.0; n], vec![0.0; row], vec![0.0; row]);
        layernorm_backward(&x, &g, &m, &r, &dy, row, &mut dx, &mut dg, Some(&mut db));

        let (xf, gf, bf, dyf) = (f(&x), f(&g), f(&b), f(&dy));
        let (mut y32, mut m32, mut r32) = (vec![0f32; n], vec![0f32; rows], vec![0f32; rows]);
        layernorm_forward(&xf, &gf, Some(&bf), EPS, row, &mut y32, &mut m32, &mut r32);
        let (mut dx32, mut dg32, mut db32) = (vec![0f32; n], vec![0f32; row], vec![0f32; row]);
        layernorm_backward(&xf, &gf, &m32, &r32, &dyf, row, &mut dx32, &mut dg32, Some(&mut db32));
        assert_close(&up(&y32), &y, 1e-5, 1e-5, "layernorm y f32");
        assert_close(&up(&r32), &r, 1e-5, 1e-5, "layernorm rstd f32");
        assert_close(&up(&dx32), &dx, 1e-4, 1e-4, "layernorm dx f32");
        assert_close(&up(&dg32), &dg, 1e-4, 1e-4, "layernorm dgamma f32");
        assert_close(&up(&db32), &db, 1e-4, 1e-4, "layernorm dbeta f32");

        let (mut y, mut r) = (vec![0.0; n], vec![0.0; rows]);
        rmsnorm_forward(&x, &g, EPS, row, &mut y, &mut r);
        let (mut dx, mut dg) = (vec![0.0; n], vec![0.0; row]);
        rmsnorm_backward(&x, &g, &r, &dy, row, &mut dx, &mut dg);
        let (mut y32, mut r32) = (vec![0f32; n], vec![0f32; rows]);
        rmsnorm_forward(&xf, &gf, EPS, row, &mut y32, &mut r32);
        let (mut dx32, mut dg32) = (vec![0f32; n], vec![0f32; row]);
        rmsnorm_backward(&xf, &gf, &r32, &dyf, row, &mut dx32, &mut dg32);
        assert_close(&up(&y32), &y, 1e-5, 1e-5, "rmsnorm y f32");
        assert_close(&up(&dx32), &dx, 1e-4, 1e-4, "rmsnorm dx f32");
        assert_close(&up(&dg32), &dg, 1e-4, 1e-4, "rmsnorm dgamma f32");
    }

    /// Runs the f32 kernels on an input large enough to go parallel, in a pool
    /// of `threads` threads, and returns every output.
    fn run_large(threads: usize) -> Vec<Vec<f32>> {
        let (rows, row) = (1000, 257);
        let n = rows * row;
        let to32 = |v: Vec<f64>| v.into_iter().map(|a| a as f32).collect::<Vec<f32>>();
        let (x, g, b, dy) = (to32(rand_vec(5, n)), to32(rand_vec(6, row)), to32(rand_vec(7, row)), to32(rand_vec(8, n)));
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| {
            let (mut y, mut m, mut r) = (vec![0f32; n], vec![0f32; rows], vec![0f32; rows]);
            layernorm_forward(&x, &g, Some(&b), EPS, row, &mut y, &mut m, &mut r);
            let (mut dx, mut dg, mut db) = (vec![0f32; n], vec![0f32; row], vec![0f32; row]);
            layernorm_backward(&x, &g, &m, &r, &dy, row, &mut dx, &mut dg, Some(&mut db));
            let (mut ry, mut rr) = (vec![0f32; n], vec![0f32; rows]);
            rmsnorm_forward(&x, &g, EPS, row, &mut ry, &mut rr);
            let (mut rdx, mut rdg) = (vec![0f32; n], vec![0f32; row]);
            rmsnorm_backward(&x, &g, &rr, &dy, row, &mut rdx, &mut rdg);
            vec![y, m, r, dx, dg, db, ry, rr, rdx, rdg]
        })
    }

    #[test]
    fn parameter_gradients_are_thread_count_independent() {
        let one = run_large(1);
        let two = run_large(2);
        for (k, (a, b)) in one.iter().zip(&two).enumerate() {
            let same = a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits());
            assert!(same, "output {k} differs between 1 and 2 threads");
        }
        // The reduction really spans many rows: dbeta is the column sum of dy.
        let dy = rand_vec(8, 1000 * 257);
        let col0: f64 = (0..1000).map(|r| dy[r * 257] as f32 as f64).sum();
        assert!((one[5][0] as f64 - col0).abs() < 1e-3, "dbeta[0] {} vs {col0}", one[5][0]);
    }

    /// The half-precision backward kernels against the f32 ones on the
    /// widened operands: the same bits for dx (rounded) and the parameter
    /// gradients, for any thread count, with chunks that do not line up
    /// with the blocks.
    #[test]
    fn mixed_backward_gives_the_bits_of_the_widening_path() {
        use crate::cpu::mixed::{Dst, Src};
        use half::{bf16, f16};
        for (rows, row) in [(1000, 257), (5, 3000), (3, 7)] {
            let n = rows * row;
            let f = |seed, k: usize, scale: f64| rand_vec(seed, k).iter().map(|&v| (scale * v) as f32).collect::<Vec<f32>>();
            let (x, dy, g) = (f(11, n, 3.0), f(12, n, 1.0), f(13, row, 1.0));
            // bf16 and f16 storage of the same values.
            let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
            let dyb: Vec<bf16> = dy.iter().map(|&v| bf16::from_f32(v)).collect();
            let xh: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
            let dyh: Vec<f16> = dy.iter().map(|&v| f16::from_f32(v)).collect();
            for (xs, dys, name) in [(Src::BF16(&xb), Src::BF16(&dyb), "bf16"), (Src::F16(&xh), Src::F16(&dyh), "f16")] {
                let (xw, dyw) = (xs.to_f32().into_owned(), dys.to_f32().into_owned());
                let (mut y, mut mean, mut rstd) = (vec![0f32; n], vec![0f32; rows], vec![0f32; rows]);
                layernorm_forward(&xw, &g, None, EPS, row, &mut y, &mut mean, &mut rstd);
                let (mut dx, mut dg, mut db) = (vec![0f32; n], vec![0f32; row], vec![0f32; row]);
                layernorm_backward(&xw, &g, &mean, &rstd, &dyw, row, &mut dx, &mut dg, Some(&mut db));
                let (mut rdx, mut rdg) = (vec![0f32; n], vec![0f32; row]);
                rmsnorm_backward(&xw, &g, &rstd, &dyw, row, &mut rdx, &mut rdg);
                let round = |v: &[f32]| -> Vec<u16> {
                    match xs {
                        Src::F16(_) => v.iter().map(|&x| f16::from_f32(x).to_bits()).collect(),
                        _ => v.iter().map(|&x| bf16::from_f32(x).to_bits()).collect(),
                    }
                };
                for threads in [1, 2, 3] {
                    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                    pool.install(|| {
                        let what = format!("{name} {rows}x{row}, {threads} threads");
                        let (mut gdx_b, mut gdx_h) = (vec![bf16::ZERO; n], vec![f16::ZERO; n]);
                        let (mut gdg, mut gdb) = (vec![0f32; row], vec![0f32; row]);
                        let out = match xs {
                            Src::F16(_) => Dst::F16(&mut gdx_h),
                            _ => Dst::BF16(&mut gdx_b),
                        };
                        layernorm_backward_mixed(xs, &g, &mean, &rstd, dys, row, out, &mut gdg, Some(&mut gdb));
                        let got: Vec<u16> = match xs {
                            Src::F16(_) => gdx_h.iter().map(|v| v.to_bits()).collect(),
                            _ => gdx_b.iter().map(|v| v.to_bits()).collect(),
                        };
                        assert_eq!(got, round(&dx), "layernorm dx {what}");
                        assert_eq!(gdg, dg, "layernorm dgamma {what}");
                        assert_eq!(gdb, db, "layernorm dbeta {what}");
                        let mut rg = vec![0f32; row];
                        let out = match xs {
                            Src::F16(_) => Dst::F16(&mut gdx_h),
                            _ => Dst::BF16(&mut gdx_b),
                        };
                        rmsnorm_backward_mixed(xs, &g, &rstd, dys, row, out, &mut rg);
                        let got: Vec<u16> = match xs {
                            Src::F16(_) => gdx_h.iter().map(|v| v.to_bits()).collect(),
                            _ => gdx_b.iter().map(|v| v.to_bits()).collect(),
                        };
                        assert_eq!(got, round(&rdx), "rmsnorm dx {what}");
                        assert_eq!(rg, rdg, "rmsnorm dgamma {what}");
                    });
                }
            }
        }
    }
}
