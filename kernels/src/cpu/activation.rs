//! Point-wise activations and their gradients: GELU (tanh form), SiLU and
//! SwiGLU.
//!
//! Backward kernels recompute what they need from the forward's input instead
//! of reading saved intermediates: the recomputation is a few flops per
//! element, cheaper than the memory traffic of storing them.

use super::elementwise::{map1, map2, PAR_CHUNK};
use super::exp::exp;
use super::mixed::{self, Cut, Dst, Src};
use super::wide::widest;
use crate::Real;
use rayon::prelude::*;

/// `sqrt(2 / pi)`, the slope of GELU's tanh argument.
const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
/// Coefficient of the cubic term in GELU's tanh argument.
const GELU_CUBIC: f64 = 0.044_715;

/// GELU of one value, tanh form, evaluated as `x * sigmoid(2u)` with
/// `u = sqrt(2/pi) (x + 0.044715 x^3)`: the identity
/// `0.5 (1 + tanh(u)) = sigmoid(2u)` costs one `exp` instead of a slower
/// `tanh`, and avoids the cancellation in `1 + tanh(u)` for negative `x`.
#[inline(always)]
fn gelu<T: Real>(x: T) -> T {
    x * sigmoid(gelu_arg2(x))
}

/// `2u`, twice GELU's tanh argument.
#[inline(always)]
fn gelu_arg2<T: Real>(x: T) -> T {
    T::lit(2.0 * SQRT_2_OVER_PI) * (x + T::lit(GELU_CUBIC) * x * x * x)
}

/// Derivative of [`gelu`] at `x`: with `s = sigmoid(2u)`,
/// `d/dx [x s] = s + x s (1 - s) 2u'(x)`.
#[inline(always)]
fn gelu_grad<T: Real>(x: T) -> T {
    let s = sigmoid(gelu_arg2(x));
    let du2 = T::lit(2.0 * SQRT_2_OVER_PI) * (T::one() + T::lit(3.0 * GELU_CUBIC) * x * x);
    s + x * s * (T::one() - s) * du2
}

/// The logistic function. For very negative `x`, `exp(-x)` overflows to
/// infinity and the result is a clean zero, never NaN.
#[inline(always)]
fn sigmoid<T: Real>(x: T) -> T {
    T::one() / (T::one() + exp(-x))
}

/// Derivative of `silu(x) = x * sigmoid(x)`, given `s = sigmoid(x)`.
#[inline(always)]
fn silu_grad_from<T: Real>(x: T, s: T) -> T {
    s * (T::one() + x * (T::one() - s))
}

/// GELU, tanh approximation: `y[i] = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
///
/// `x` and `y` are flat buffers of the same length.
pub fn gelu_forward<T: Real>(x: &[T], y: &mut [T]) {
    map1(x, y, gelu);
}

/// Gradient of [`gelu_forward`]: `dx[i] = dy[i] * gelu'(x[i])`, from the
/// forward's input `x`. All three buffers have the same length.
pub fn gelu_backward<T: Real>(x: &[T], dy: &[T], dx: &mut [T]) {
    map2(x, dy, dx, |x, g| g * gelu_grad(x));
}

/// SiLU (swish): `y[i] = x[i] * sigmoid(x[i])`; `x` and `y` have the same length.
pub fn silu_forward<T: Real>(x: &[T], y: &mut [T]) {
    map1(x, y, |x| x * sigmoid(x));
}

/// Gradient of [`silu_forward`]: `dx = dy * s (1 + x (1 - s))` with
/// `s = sigmoid(x)`, from the forward's input. All buffers have the same length.
pub fn silu_backward<T: Real>(x: &[T], dy: &[T], dx: &mut [T]) {
    map2(x, dy, dx, |x, g| g * silu_grad_from(x, sigmoid(x)));
}

/// SwiGLU gating: `y[i] = silu(gate[i]) * up[i]`.
///
/// `gate`, `up` and `y` are flat buffers of the same length (the two halves
/// of the MLP's first projection, already split by the caller).
pub fn swiglu_forward<T: Real>(gate: &[T], up: &[T], y: &mut [T]) {
    map2(gate, up, y, |g, u| g * sigmoid(g) * u);
}

/// Gradient of [`swiglu_forward`]: `dgate = dy * up * silu'(gate)` and
/// `dup = dy * silu(gate)`, both overwritten. All buffers have the same length.
pub fn swiglu_backward<T: Real>(gate: &[T], up: &[T], dy: &[T], dgate: &mut [T], dup: &mut [T]) {
    let n = gate.len();
    assert_eq!(up.len(), n, "up and gate lengths differ");
    assert_eq!(dy.len(), n, "dy and gate lengths differ");
    assert_eq!(dgate.len(), n, "dgate and gate lengths differ");
    assert_eq!(dup.len(), n, "dup and gate lengths differ");
    let run = |gate: &[T], up: &[T], dy: &[T], dgate: &mut [T], dup: &mut [T]| {
        widest(
            #[inline(always)]
            || {
                let outs = dgate.iter_mut().zip(dup.iter_mut());
                for ((dg, du), ((&g, &u), &d)) in outs.zip(gate.iter().zip(up).zip(dy)) {
                    let s = sigmoid(g);
                    *dg = d * u * silu_grad_from(g, s);
                    *du = d * g * s;
                }
            },
        )
    };
    if n <= PAR_CHUNK {
        run(gate, up, dy, dgate, dup);
    } else {
        dgate
            .par_chunks_mut(PAR_CHUNK)
            .zip(dup.par_chunks_mut(PAR_CHUNK))
            .zip(gate.par_chunks(PAR_CHUNK))
            .zip(up.par_chunks(PAR_CHUNK))
            .zip(dy.par_chunks(PAR_CHUNK))
            .for_each(|((((dg, du), g), u), d)| run(g, u, d, dg, du));
    }
}

/// [`gelu_forward`] on operands stored as f32, bf16 or f16: each value
/// widened, mapped in f32 and rounded once to the output's type, in
/// registers on bf16 (see [`mixed::map1`]).
pub fn gelu_forward_mixed(x: Src<'_>, y: Dst<'_>) {
    mixed::map1(x, y, gelu);
}

/// [`gelu_backward`] on operands stored as f32, bf16 or f16 (see [`gelu_forward_mixed`]).
pub fn gelu_backward_mixed(x: Src<'_>, dy: Src<'_>, dx: Dst<'_>) {
    mixed::map2(x, dy, dx, |x, g| g * gelu_grad(x));
}

/// [`silu_forward`] on operands stored as f32, bf16 or f16 (see [`gelu_forward_mixed`]).
pub fn silu_forward_mixed(x: Src<'_>, y: Dst<'_>) {
    mixed::map1(x, y, |x| x * sigmoid(x));
}

/// [`silu_backward`] on operands stored as f32, bf16 or f16 (see [`gelu_forward_mixed`]).
pub fn silu_backward_mixed(x: Src<'_>, dy: Src<'_>, dx: Dst<'_>) {
    mixed::map2(x, dy, dx, |x, g| g * silu_grad_from(x, sigmoid(x)));
}

/// [`swiglu_forward`] on operands stored as f32, bf16 or f16 (see [`gelu_forward_mixed`]).
pub fn swiglu_forward_mixed(gate: Src<'_>, up: Src<'_>, y: Dst<'_>) {
    mixed::map2(gate, up, y, |g, u| g * sigmoid(g) * u);
}

/// [`swiglu_backward`] on operands stored as f32, bf16 or f16, computed in
/// f32 a block at a time (see [`mixed::blocked`]).
pub fn swiglu_backward_mixed(gate: Src<'_>, up: Src<'_>, dy: Src<'_>, dgate: Dst<'_>, dup: Dst<'_>) {
    let n = gate.len();
    let ins = [(gate, Cut::Units(1)), (up, Cut::Units(1)), (dy, Cut::Units(1))];
    mixed::blocked(n, &ins, vec![(dgate, 1), (dup, 1)], |_, x, y| {
        let (dg, du) = y.split_at_mut(1);
        swiglu_backward(x[0], x[1], x[2], dg[0], du[0])
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{assert_close, dot, numeric_grad, rand_vec};

    /// Random inputs spread over [-4, 4) so both tails of each curve are hit.
    fn inputs(seed: u64, n: usize) -> Vec<f64> {
        rand_vec(seed, n).iter().map(|v| 4.0 * v).collect()
    }

    #[test]
    fn gelu_reference_values() {
        let x = [0.0, 1.0, -1.0, 2.0, -3.0, 10.0, -10.0];
        let mut y = [0.0; 7];
        gelu_forward(&x, &mut y);
        // Tanh-form GELU evaluated independently at high precision.
        let expected = [0.0, 0.8411919906082768, -0.1588080093917233, 1.954597694087775, -0.003637392081773019, 10.0, 0.0];
        assert_close(&y, &expected, 1e-16, 1e-14, "gelu reference");
        let mut y32 = [0f32; 2];
        gelu_forward(&[1.0f32, -1.0], &mut y32);
        assert!((y32[0] - 0.841_192).abs() < 1e-6 && (y32[1] + 0.158_808).abs() < 1e-6);
    }

    #[test]
    fn silu_and_swiglu_reference_values() {
        let x = [0.0, 1.0, -2.0, -1000.0, 1000.0];
        let mut y = [0.0; 5];
        silu_forward(&x, &mut y);
        let expected = [0.0, 0.7310585786300049, -0.23840584404423515, 0.0, 1000.0];
        assert_close(&y, &expected, 1e-15, 1e-14, "silu reference");
        let mut z = [0.0; 5];
        swiglu_forward(&x, &[2.0; 5], &mut z);
        let doubled: Vec<f64> = expected.iter().map(|v| 2.0 * v).collect();
        assert_close(&z, &doubled, 1e-15, 1e-14, "swiglu reference");
        // Saturated tails stay finite in both directions and both precisions.
        let mut dx = [0.0; 5];
        silu_backward(&x, &[1.0; 5], &mut dx);
        assert!(dx.iter().all(|v| v.is_finite()));
        let mut y32 = [0f32; 2];
        silu_forward(&[-200.0f32, 200.0], &mut y32);
        assert_eq!(y32, [0.0, 200.0]);
    }

    fn check_unary(fwd: fn(&[f64], &mut [f64]), bwd: fn(&[f64], &[f64], &mut [f64]), what: &str) {
        for n in [1, 3, 17, 129] {
            let x = inputs(n as u64, n);
            let dy = rand_vec(100 + n as u64, n);
            let mut dx = vec![f64::NAN; n];
            bwd(&x, &dy, &mut dx);
            let num = numeric_grad(
                |x| {
                    let mut y = vec![0.0; n];
                    fwd(x, &mut y);
                    dot(&y, &dy)
                },
                &x,
                1e-5,
            );
            assert_close(&dx, &num, 1e-8, 1e-6, what);
        }
    }

    #[test]
    fn gelu_gradient_matches_finite_differences() {
        check_unary(gelu_forward, gelu_backward, "gelu dx");
    }

    #[test]
    fn silu_gradient_matches_finite_differences() {
        check_unary(silu_forward, silu_backward, "silu dx");
    }

    #[test]
    fn swiglu_gradients_match_finite_differences() {
        for n in [1, 3, 17, 129] {
            let gate = inputs(200 + n as u64, n);
            let up = inputs(300 + n as u64, n);
            let dy = rand_vec(400 + n as u64, n);
            let (mut dgate, mut dup) = (vec![f64::NAN; n], vec![f64::NAN; n]);
            swiglu_backward(&gate, &up, &dy, &mut dgate, &mut dup);
            let loss = |g: &[f64], u: &[f64]| {
                let mut y = vec![0.0; n];
                swiglu_forward(g, u, &mut y);
                dot(&y, &dy)
            };
            let num_g = numeric_grad(|g| loss(g, &up), &gate, 1e-5);
            let num_u = numeric_grad(|u| loss(&gate, u), &up, 1e-5);
            assert_close(&dgate, &num_g, 1e-8, 1e-6, "swiglu dgate");
            assert_close(&dup, &num_u, 1e-8, 1e-6, "swiglu dup");
        }
    }

    #[test]
    fn f32_kernels_match_one_value_at_a_time_bit_for_bit() {
        // The buffers run through whichever vector copy the CPU selects; a
        // plain per-element evaluation must round identically, tails and
        // special values included.
        let n = 2 * PAR_CHUNK + 13;
        let mut x: Vec<f32> = inputs(20, n).iter().map(|&v| 30.0 * v as f32).collect();
        x[..6].copy_from_slice(&[0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, -1e30, 1e30]);
        let u: Vec<f32> = inputs(21, n).iter().map(|&v| v as f32).collect();
        let dy: Vec<f32> = rand_vec(22, n).iter().map(|&v| v as f32).collect();
        let same = |got: &[f32], want: &dyn Fn(usize) -> f32, what: &str| {
            for (i, &g) in got.iter().enumerate() {
                let w = want(i);
                assert!(g.to_bits() == w.to_bits(), "{what}[{i}] at x = {}: {g} != {w}", x[i]);
            }
        };
        let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
        gelu_forward(&x, &mut a);
        same(&a, &|i| gelu(std::hint::black_box(x[i])), "gelu");
        gelu_backward(&x, &dy, &mut a);
        same(&a, &|i| dy[i] * gelu_grad(std::hint::black_box(x[i])), "gelu backward");
        silu_forward(&x, &mut a);
        same(&a, &|i| x[i] * sigmoid(std::hint::black_box(x[i])), "silu");
        swiglu_backward(&x, &u, &dy, &mut a, &mut b);
        let s = |i: usize| sigmoid(std::hint::black_box(x[i]));
        same(&a, &|i| dy[i] * u[i] * silu_grad_from(x[i], s(i)), "swiglu dgate");
        same(&b, &|i| dy[i] * x[i] * s(i), "swiglu dup");
    }

    #[test]
    fn f32_path_matches_f64_path_on_parallel_sizes() {
        let n = 3 * PAR_CHUNK + 11;
        let x = inputs(7, n);
        let u = inputs(8, n);
        let dy = rand_vec(9, n);
        let to32 = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<f32>>();
        let (x32, u32_, dy32) = (to32(&x), to32(&u), to32(&dy));
        let widen = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
        // Compare at the f32-rounded inputs so only arithmetic error remains.
        let (xr, ur, dyr) = (widen(&x32), widen(&u32_), widen(&dy32));

        let (mut a32, mut a64) = (vec![0f32; n], vec![0f64; n]);
        gelu_forward(&x32, &mut a32);
        gelu_forward(&xr, &mut a64);
        assert_close(&widen(&a32), &a64, 1e-6, 1e-5, "gelu f32");
        gelu_backward(&x32, &dy32, &mut a32);
        gelu_backward(&xr, &dyr, &mut a64);
        assert_close(&widen(&a32), &a64, 1e-6, 1e-5, "gelu backward f32");
        silu_forward(&x32, &mut a32);
        silu_forward(&xr, &mut a64);
        assert_close(&widen(&a32), &a64, 1e-6, 1e-5, "silu f32");
        silu_backward(&x32, &dy32, &mut a32);
        silu_backward(&xr, &dyr, &mut a64);
        assert_close(&widen(&a32), &a64, 1e-6, 1e-5, "silu backward f32");
        swiglu_forward(&x32, &u32_, &mut a32);
        swiglu_forward(&xr, &ur, &mut a64);
        assert_close(&widen(&a32), &a64, 1e-6, 1e-5, "swiglu f32");
        let (mut b32, mut b64) = (vec![0f32; n], vec![0f64; n]);
        swiglu_backward(&x32, &u32_, &dy32, &mut a32, &mut b32);
        swiglu_backward(&xr, &ur, &dyr, &mut a64, &mut b64);
        assert_close(&widen(&a32), &a64, 1e-6, 1e-5, "swiglu dgate f32");
        assert_close(&widen(&b32), &b64, 1e-6, 1e-5, "swiglu dup f32");
    }
}
