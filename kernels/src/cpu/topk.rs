//! Per-row top-k selection (mixture-of-experts routing, vocabulary sampling)
//! and its gradient.
//!
//! `k` is small while rows can be long, so each row is scanned once against a
//! sorted buffer of the `k` best entries kept directly in the output row: an
//! element costs one comparison with the current k-th best and is inserted
//! (an `O(k)` shift) only when it beats it. No row is ever sorted.
//!
//! Order: larger values first; equal values by lower index; NaN sorts below
//! every number, including `-inf` (NaNs among themselves again by index).

use super::elementwise::PAR_CHUNK;
use crate::Real;
use rayon::prelude::*;

/// Whether `a` ranks strictly above `b` by value, NaN lowest. Equal values
/// (and two NaNs) do not: the scan visits indices in increasing order, so an
/// entry already held always wins the tie.
#[inline(always)]
fn beats<T: Real>(a: T, b: T) -> bool {
    if b.is_nan() {
        !a.is_nan()
    } else {
        a > b
    }
}

/// Selects the top `vals.len()` entries of one row into `vals`/`idx`, best first.
fn select_row<T: Real>(x: &[T], vals: &mut [T], idx: &mut [u32]) {
    let k = vals.len();
    if k == 0 {
        return;
    }
    // Inserts (v, i) into the sorted prefix of length `len`, dropping the last
    // entry when the buffer is full.
    let insert = |vals: &mut [T], idx: &mut [u32], len: usize, v: T, i: usize| {
        let mut p = len.min(k - 1);
        while p > 0 && beats(v, vals[p - 1]) {
            vals[p] = vals[p - 1];
            idx[p] = idx[p - 1];
            p -= 1;
        }
        vals[p] = v;
        idx[p] = i as u32;
    };
    for (i, &v) in x[..k].iter().enumerate() {
        insert(vals, idx, i, v, i);
    }
    let mut worst = vals[k - 1];
    for (i, &v) in x.iter().enumerate().skip(k) {
        if beats(v, worst) {
            insert(vals, idx, k, v, i);
            worst = vals[k - 1];
        }
    }
}

/// The `k` largest entries of each row, in descending order.
///
/// `x` is row-major `[rows, row]`; `values` and `indices` are row-major
/// `[rows, k]` and receive, for each row, the selected values and their
/// column indices. Ties go to the lower index and NaN ranks below every
/// number. Requires `k <= row` and `row <= u32::MAX`.
pub fn topk<T: Real>(x: &[T], row: usize, k: usize, values: &mut [T], indices: &mut [u32]) {
    assert!(row > 0, "row length must be positive");
    assert!(k <= row, "k = {k} exceeds the row length {row}");
    assert!(row <= u32::MAX as usize, "row too long for u32 indices");
    assert_eq!(x.len() % row, 0, "input length is not a multiple of the row length");
    let rows = x.len() / row;
    assert_eq!(values.len(), rows * k, "values length differs from rows * k");
    assert_eq!(indices.len(), rows * k, "indices length differs from rows * k");
    if k == 0 {
        return;
    }
    let run = |x: &[T], values: &mut [T], indices: &mut [u32]| {
        for ((x, v), i) in x.chunks_exact(row).zip(values.chunks_exact_mut(k)).zip(indices.chunks_exact_mut(k)) {
            select_row(x, v, i);
        }
    };
    if x.len() <= PAR_CHUNK || rows == 1 {
        run(x, values, indices);
    } else {
        let rows_per_task = (PAR_CHUNK / row).max(1);
        values
            .par_chunks_mut(rows_per_task * k)
            .zip(indices.par_chunks_mut(rows_per_task * k))
            .zip(x.par_chunks(rows_per_task * row))
            .for_each(|((v, i), x)| run(x, v, i));
    }
}

/// Gradient of [`topk`]'s values: `dx` (row-major `[rows, row]`) is zeroed,
/// then `dvalues[r, j]` is added at `dx[r, indices[r, j]]`.
///
/// `indices` and `dvalues` are row-major `[rows, k]` as produced by [`topk`];
/// every index must be below `row`.
pub fn topk_backward<T: Real>(indices: &[u32], dvalues: &[T], row: usize, k: usize, dx: &mut [T]) {
    assert!(row > 0, "row length must be positive");
    assert!(k <= row, "k = {k} exceeds the row length {row}");
    assert_eq!(dx.len() % row, 0, "gradient length is not a multiple of the row length");
    let rows = dx.len() / row;
    assert_eq!(indices.len(), rows * k, "indices length differs from rows * k");
    assert_eq!(dvalues.len(), rows * k, "dvalues length differs from rows * k");
    if k == 0 {
        dx.fill(T::zero());
        return;
    }
    let run = |dx: &mut [T], indices: &[u32], dvalues: &[T]| {
        dx.fill(T::zero());
        for ((dx, idx), dv) in dx.chunks_exact_mut(row).zip(indices.chunks_exact(k)).zip(dvalues.chunks_exact(k)) {
            for (&i, &g) in idx.iter().zip(dv) {
                dx[i as usize] += g;
            }
        }
    };
    if dx.len() <= PAR_CHUNK || rows == 1 {
        run(dx, indices, dvalues);
    } else {
        let rows_per_task = (PAR_CHUNK / row).max(1);
        dx.par_chunks_mut(rows_per_task * row)
            .zip(indices.par_chunks(rows_per_task * k))
            .zip(dvalues.par_chunks(rows_per_task * k))
            .for_each(|((dx, i), dv)| run(dx, i, dv));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{assert_close, dot, numeric_grad, rand_vec};

    /// Reference: a full stable sort of (value, index) pairs in the documented order.
    fn reference(x: &[f64], k: usize) -> (Vec<f64>, Vec<u32>) {
        let mut order: Vec<usize> = (0..x.len()).collect();
        order.sort_by(|&a, &b| {
            let key = |v: f64| if v.is_nan() { f64::NEG_INFINITY } else { v };
            let rank = |v: f64| if v.is_nan() { 0 } else { 1 };
            rank(x[b]).cmp(&rank(x[a])).then(key(x[b]).partial_cmp(&key(x[a])).unwrap()).then(a.cmp(&b))
        });
        order.truncate(k);
        (order.iter().map(|&i| x[i]).collect(), order.iter().map(|&i| i as u32).collect())
    }

    fn check_against_reference(x: &[f64], row: usize, k: usize) {
        let rows = x.len() / row;
        let mut vals = vec![0.0; rows * k];
        let mut idx = vec![u32::MAX; rows * k];
        topk(x, row, k, &mut vals, &mut idx);
        for r in 0..rows {
            let (rv, ri) = reference(&x[r * row..(r + 1) * row], k);
            assert_eq!(&idx[r * k..(r + 1) * k], &ri[..], "indices of row {r}");
            for (a, b) in vals[r * k..(r + 1) * k].iter().zip(&rv) {
                assert!(a.to_bits() == b.to_bits(), "values of row {r}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn small_example() {
        let x = [0.5f32, 2.0, -1.0, 2.0, 7.0, f32::NAN, f32::NEG_INFINITY, 0.5];
        let mut v = [0f32; 3];
        let mut i = [0u32; 3];
        topk(&x, 8, 3, &mut v, &mut i);
        assert_eq!(v, [7.0, 2.0, 2.0]);
        assert_eq!(i, [4, 1, 3]);
        let mut v = [0f32; 8];
        let mut i = [0u32; 8];
        topk(&x, 8, 8, &mut v, &mut i);
        assert_eq!(i, [4, 1, 3, 0, 7, 2, 6, 5]);
        assert!(v[7].is_nan() && v[6] == f32::NEG_INFINITY);
    }

    #[test]
    fn ties_and_nans_follow_the_documented_order() {
        // Few distinct values force many ties; NaNs sprinkled in, including at
        // the front of rows where they seed the buffer.
        for (rows, row, k) in [(1, 1, 1), (3, 17, 4), (17, 3, 3), (5, 129, 8), (2, 1000, 1), (4, 9, 0)] {
            let mut x: Vec<f64> = rand_vec(row as u64, rows * row).iter().map(|v| (v * 3.0).round()).collect();
            for (j, v) in x.iter_mut().enumerate() {
                if j % 7 == 0 {
                    *v = f64::NAN;
                }
            }
            check_against_reference(&x, row, k);
        }
        let all_nan = vec![f64::NAN; 6];
        let mut v = [0.0; 3];
        let mut i = [0u32; 3];
        topk(&all_nan, 6, 3, &mut v, &mut i);
        assert_eq!(i, [0, 1, 2]);
        // Equal values arriving after the buffer is full never displace earlier ones.
        let x = [1.0, 1.0, 1.0, 1.0, 1.0];
        topk(&x, 5, 3, &mut v, &mut i);
        assert_eq!(i, [0, 1, 2]);
    }

    #[test]
    fn random_rows_match_a_full_sort_in_parallel_too() {
        for (rows, row, k) in [(64, 1024, 8), (3, 50_000, 5), (1000, 64, 2)] {
            let x = rand_vec(rows as u64 + row as u64, rows * row);
            check_against_reference(&x, row, k);
        }
        // Ascending input: every element beats the buffer's worst (the worst case).
        let x: Vec<f64> = (0..5000).map(|i| i as f64).collect();
        check_against_reference(&x, 5000, 8);
    }

    #[test]
    fn gradient_matches_finite_differences() {
        for (rows, row, k) in [(1, 1, 1), (1, 3, 2), (3, 17, 4), (17, 3, 1), (2, 129, 8)] {
            let n = rows * row;
            let x = rand_vec(40 + n as u64, n);
            let dv = rand_vec(50 + n as u64, rows * k);
            let mut vals = vec![0.0; rows * k];
            let mut idx = vec![0u32; rows * k];
            topk(&x, row, k, &mut vals, &mut idx);
            let mut dx = vec![f64::NAN; n];
            topk_backward(&idx, &dv, row, k, &mut dx);
            let num = numeric_grad(
                |x| {
                    let mut v = vec![0.0; rows * k];
                    let mut i = vec![0u32; rows * k];
                    topk(x, row, k, &mut v, &mut i);
                    dot(&v, &dv)
                },
                &x,
                1e-7,
            );
            assert_close(&dx, &num, 1e-8, 1e-7, "topk dx");
        }
    }

    #[test]
    fn backward_scatters_on_parallel_sizes_and_f32_matches_f64() {
        let (rows, row, k) = (200, 400, 3);
        let x = rand_vec(60, rows * row);
        let x32: Vec<f32> = x.iter().map(|&v| v as f32).collect();
        let (mut v, mut i) = (vec![0.0; rows * k], vec![0u32; rows * k]);
        let (mut v32, mut i32_) = (vec![0f32; rows * k], vec![0u32; rows * k]);
        topk(&x, row, k, &mut v, &mut i);
        topk(&x32, row, k, &mut v32, &mut i32_);
        // rand_vec values have 24 bits, so the f32 copy is exact and the picks agree.
        assert_eq!(i, i32_);
        assert!(v.iter().zip(&v32).all(|(&a, &b)| a == b as f64));
        let dv: Vec<f32> = rand_vec(61, rows * k).iter().map(|&g| g as f32).collect();
        let mut dx = vec![f32::NAN; rows * row];
        topk_backward(&i32_, &dv, row, k, &mut dx);
        for r in 0..rows {
            let picked = &i32_[r * k..(r + 1) * k];
            for j in 0..row {
                let expected = picked.iter().position(|&p| p as usize == j).map_or(0.0, |s| dv[r * k + s]);
                assert_eq!(dx[r * row + j], expected);
            }
        }
    }
}
