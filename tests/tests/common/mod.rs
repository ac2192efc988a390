//! Shared helpers of the integration tests: deterministic inputs and a
//! finite-difference gradient checker that drives ops through the public API.
#![allow(dead_code)]

pub mod models;
pub mod training;

use tessera::prelude::*;

/// A fresh CPU device (its own memory accounting).
pub fn cpu() -> Device {
    Device::cpu()
}

/// Uniform values in `[-1, 1)`, deterministic per `seed`.
pub fn rand_vec(seed: u64, n: usize) -> Vec<f64> {
    let key = RngKey::new(seed, 99);
    (0..n).map(|i| key.uniform_at(i as u64) as f64 * 2.0 - 1.0).collect()
}

/// An f64 tensor of uniform values in `[-1, 1)`.
pub fn rand_t(seed: u64, shape: &[usize], dev: &Device) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_vec(rand_vec(seed, n), shape, dev).unwrap()
}

/// Asserts `|a - e| <= atol + rtol |e|` element-wise.
#[track_caller]
pub fn assert_close(actual: &[f64], expected: &[f64], atol: f64, rtol: f64, what: &str) {
    assert_eq!(actual.len(), expected.len(), "{what}: lengths differ");
    for (i, (a, e)) in actual.iter().zip(expected).enumerate() {
        let tol = atol + rtol * e.abs();
        assert!((a - e).abs() <= tol, "{what}[{i}]: got {a}, expected {e} (tolerance {tol})");
    }
}

/// Checks an op's backward against central finite differences in f64.
///
/// `forward` maps the inputs to one output tensor; `backward` gets the inputs
/// and the upstream gradient `dy` and returns the gradient of each input
/// listed in `wrt` (same order). The scalar differentiated is `<forward(x), dy>`
/// for a fixed random `dy`.
#[track_caller]
pub fn gradcheck(
    name: &str,
    inputs: &[Tensor],
    wrt: &[usize],
    forward: impl Fn(&[Tensor]) -> tessera::Result<Tensor>,
    backward: impl Fn(&[Tensor], &Tensor) -> tessera::Result<Vec<Tensor>>,
) {
    let dev = inputs[0].device().clone();
    let y = forward(inputs).unwrap();
    let dy_vals = rand_vec(0xD1, y.elem_count());
    let dy = Tensor::from_vec(dy_vals.clone(), y.shape().clone(), &dev).unwrap();
    let grads = backward(inputs, &dy).unwrap();
    assert_eq!(grads.len(), wrt.len(), "{name}: one gradient per checked input");
    let objective = |xs: &[Tensor]| -> f64 {
        let y = forward(xs).unwrap().to_f64_vec().unwrap();
        y.iter().zip(&dy_vals).map(|(a, b)| a * b).sum()
    };
    let eps = 1e-6;
    for (g, &i) in grads.iter().zip(wrt) {
        assert_eq!(g.shape(), inputs[i].shape(), "{name}: gradient of input {i} has the input's shape");
        let base = inputs[i].to_f64_vec().unwrap();
        let mut numeric = vec![0.0; base.len()];
        for (j, num) in numeric.iter_mut().enumerate() {
            let eval = |delta: f64| {
                let mut v = base.clone();
                v[j] += delta;
                let mut xs = inputs.to_vec();
                xs[i] = Tensor::from_vec(v, inputs[i].shape().clone(), &dev).unwrap();
                objective(&xs)
            };
            *num = (eval(eps) - eval(-eps)) / (2.0 * eps);
        }
        assert_close(&g.to_f64_vec().unwrap(), &numeric, 1e-6, 1e-5, &format!("{name}: d/d input {i}"));
    }
}
