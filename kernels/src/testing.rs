//! Helpers shared by the kernels' unit tests: deterministic inputs, central
//! finite differences in f64, and closeness assertions that name the element.

use crate::rng::RngKey;

/// `n` deterministic values uniform in `[-1, 1)`, different for each `seed`.
pub fn rand_vec(seed: u64, n: usize) -> Vec<f64> {
    let key = RngKey::new(seed, 0xC0FFEE);
    (0..n).map(|i| key.uniform_at(i as u64) as f64 * 2.0 - 1.0).collect()
}

/// Central finite-difference gradient of the scalar function `f` at `x`.
pub fn numeric_grad(f: impl Fn(&[f64]) -> f64, x: &[f64], eps: f64) -> Vec<f64> {
    let mut xp = x.to_vec();
    (0..x.len())
        .map(|i| {
            let orig = xp[i];
            xp[i] = orig + eps;
            let fp = f(&xp);
            xp[i] = orig - eps;
            let fm = f(&xp);
            xp[i] = orig;
            (fp - fm) / (2.0 * eps)
        })
        .collect()
}

/// `sum_i a[i] * b[i]`: turns a vector output into the scalar loss
/// `<output, upstream gradient>` whose gradient the backward kernels produce.
pub fn dot(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Asserts `|actual - expected| <= atol + rtol * |expected|` element-wise.
#[track_caller]
pub fn assert_close(actual: &[f64], expected: &[f64], atol: f64, rtol: f64, what: &str) {
    assert_eq!(actual.len(), expected.len(), "{what}: length differs");
    for (i, (a, e)) in actual.iter().zip(expected).enumerate() {
        let tol = atol + rtol * e.abs();
        assert!((a - e).abs() <= tol && a.is_finite() == e.is_finite(), "{what}: element {i}: got {a}, expected {e} (tolerance {tol})");
    }
}
