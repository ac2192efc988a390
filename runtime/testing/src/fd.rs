//! The single-rank gradients against central finite differences in f64.

use super::run::{weights, Rank};
use super::{Check, Report};
use tessera_core::tensor::{DType, Tensor};
use tessera_core::Device;
use tessera_core::Result;
use tessera_dist::mesh::{Coords, Degrees};
use tessera_nn::module::{self, Act, Cx, Module};

/// The check's loss of `model` on `x` (f64, single rank), and the output gradient.
fn loss<M: Module>(model: &M, cx: &mut Cx, x: &Tensor, seed: u64) -> Result<(f64, Tensor, M::Saved)> {
    let (y, saved) = model.forward(cx, Act::new(x.clone()))?;
    let rows = y.tensor().dims()[0] as f64;
    let r = weights(seed, y.tensor().dims(), DType::F64, cx.device())?;
    let l = y.tensor().to_f64_vec()?.iter().zip(r.to_f64_vec()?).map(|(a, b)| a * b).sum::<f64>() / rows;
    Ok((l, tessera_core::ops::scale(&r, 1.0 / rows)?, saved))
}

/// The five-point central difference of `f` at step `h`: its error is
/// O(h⁴), so models whose gradients span many orders of magnitude (products
/// of products) are still checked at 1e-5.
fn derivative(mut f: impl FnMut(f64) -> Result<f64>, h: f64) -> Result<f64> {
    let (p1, m1, p2, m2) = (f(h)?, f(-h)?, f(2.0 * h)?, f(-2.0 * h)?);
    Ok((8.0 * (p1 - m1) - (p2 - m2)) / (12.0 * h))
}

/// Compares up to `check.finite_differences` elements of every parameter's
/// gradient (and of a float input's) with a five-point central difference;
/// returns the disagreements.
pub(super) fn check<M: Module, F: Fn(&Rank) -> Result<M> + Sync>(make: &F, input: &Tensor, check: &Check, report: &mut Report) -> Result<Vec<String>> {
    let dev = Device::cpu();
    let mut cx = Cx::new(dev.clone()).with_dtype(DType::F64).with_seed(check.seed);
    let model = module::build(make(&Rank { rank: 0, coords: Coords::new(), degrees: Degrees::new() })?, &cx)?;
    let x = input.to_device(&dev)?;
    let x = if x.dtype().is_float() { x.to_dtype(DType::F64)? } else { x };
    let (_, dy, saved) = loss(&model, &mut cx, &x, check.seed)?;
    let dx = model.backward(&mut cx, saved, Act::new(dy))?;
    let params = module::distinct_params(&model)?;
    let eps = 1e-5;
    let mut problems = Vec::new();
    let mut worst = 0.0f64;
    let agrees = |analytic: f64, numeric: f64, scale: f64| (analytic - numeric).abs() <= 1e-7 * (1.0 + scale) + 1e-5 * numeric.abs();
    // `numeric(h)` is the difference quotient at step `h`. Two kinds of model
    // need a smaller step than 1e-5: one that routes (top-k experts) is only
    // piecewise smooth, and a stencil that straddles a switch of the routing
    // is off; one with a nearly constant row under a norm has derivatives
    // so large that the stencil's O(h⁴) error shows. Either way a smaller
    // step converges on the true derivative, while a wrong backward stays
    // wrong at every step, so the check retries at 1e-7, 1e-8, 1e-9 and
    // 1e-10, and for a derivative over 1e4 (whose size dwarfs the rounding
    // of a tinier step) at 1e-11 and 1e-12. (The DSL fuzzer drew a two-block
    // model of routed experts whose loss jumped at every step from 1e-3 to
    // 1e-8 and agreed with the backward to nine digits at 1e-9, and one whose
    // derivatives of 4e6 converged on the backward's only at 1e-11.)
    let mut compare = |problems: &mut Vec<String>, what: String, analytic: f64, scale: f64, numeric: &mut dyn FnMut(f64) -> Result<f64>| -> Result<()> {
        let mut n = numeric(eps)?;
        let steps: &[f64] = if analytic.abs() > 1e4 { &[1e-7, 1e-8, 1e-9, 1e-10, 1e-11, 1e-12] } else { &[1e-7, 1e-8, 1e-9, 1e-10] };
        for &h in steps {
            if agrees(analytic, n, scale) {
                break;
            }
            n = numeric(h)?;
        }
        worst = worst.max((analytic - n).abs() / n.abs().max(1e-2 * scale).max(1e-12));
        if !agrees(analytic, n, scale) {
            problems.push(format!("finite differences: d loss / d {what} is {n:.9e}, the backward gives {analytic:.9e}"));
        }
        Ok(())
    };
    for p in &params {
        let Some(g) = p.param.grad() else {
            problems.push(format!("finite differences: the single-rank backward gives no gradient for `{}`", p.name()));
            continue;
        };
        let g = g.to_f64_vec()?;
        let base = p.param.value()?;
        let (values, shape) = (base.to_f64_vec()?, base.shape().clone());
        let scale = g.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        let step = (values.len() / check.finite_differences).max(1);
        for j in (0..values.len()).step_by(step).take(check.finite_differences) {
            let mut numeric = |h: f64| {
                derivative(
                    |delta: f64| -> Result<f64> {
                        let mut v = values.clone();
                        v[j] += delta;
                        p.param.set_value(Tensor::from_vec(v, shape.clone(), &dev)?)?;
                        Ok(loss(&model, &mut cx, &x, check.seed)?.0)
                    },
                    h,
                )
            };
            compare(&mut problems, format!("`{}`[{j}]", p.name()), g[j], scale, &mut numeric)?;
        }
        p.param.set_value(base)?;
    }
    if x.dtype().is_float() {
        let g = dx.tensor().to_f64_vec()?;
        let values = x.to_f64_vec()?;
        let scale = g.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        let n = (check.finite_differences * 4).min(values.len());
        let step = (values.len() / n.max(1)).max(1);
        for j in (0..values.len()).step_by(step).take(n) {
            let mut numeric = |h: f64| {
                derivative(
                    |delta: f64| -> Result<f64> {
                        let mut v = values.clone();
                        v[j] += delta;
                        Ok(loss(&model, &mut cx, &Tensor::from_vec(v, x.shape().clone(), &dev)?, check.seed)?.0)
                    },
                    h,
                )
            };
            compare(&mut problems, format!("input[{j}]"), g[j], scale, &mut numeric)?;
        }
    }
    for p in &params {
        p.param.take_grad();
    }
    report.errors.push(("finite differences".to_string(), worst));
    Ok(problems)
}
