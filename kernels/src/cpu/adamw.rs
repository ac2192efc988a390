//! AdamW: Adam with decoupled weight decay (Loshchilov & Hutter) and
//! bias-corrected moments, as one fused element-wise pass.
//!
//! The update for each element, with `g = grad · grad_scale` and `t = step`:
//!
//! ```text
//! m ← β1 m + (1 − β1) g
//! v ← β2 v + (1 − β2) g²
//! p ← p − lr · ( m̂ / (√v̂ + ε) + wd · p ),   m̂ = m / (1 − β1ᵗ),  v̂ = v / (1 − β2ᵗ)
//! ```
//!
//! The decay term uses the pre-update `p`, which is algebraically the same as
//! PyTorch's `torch.optim.AdamW`: `p ← p · (1 − lr · wd) − lr · m̂ / (√v̂ + ε)`.
//! The decay is decoupled: it is not part of the gradient and so never enters
//! the moments. Parameters and moments are kept in the compute type (`f32`
//! master weights in training).

use crate::desc::AdamWStep;
use crate::Real;
use rayon::prelude::*;

/// Below this many elements the update stays on the calling thread.
const PAR_MIN_ELEMS: usize = 32 * 1024;
/// Elements per parallel chunk.
const CHUNK: usize = 16 * 1024;

/// One fused pass: m = b1 m + (1-b1) g; v = b2 v + (1-b2) g²; p -= lr * (m̂ / (sqrt(v̂) + eps) + wd * p).
///
/// `g = grad · grad_scale`; `m̂`, `v̂` are the bias-corrected moments for
/// `s.step` (≥ 1, asserted); the decay uses the pre-update `p` (see the module
/// doc for the equivalence with PyTorch's form). `param`, `m`, `v` are updated
/// in place; all four slices have the same length. Purely element-wise, so the
/// result does not depend on the thread count.
pub fn adamw_update<T: Real>(s: &AdamWStep, param: &mut [T], grad: &[T], m: &mut [T], v: &mut [T]) {
    assert!(s.step >= 1, "AdamW step counts from 1");
    let n = param.len();
    assert_eq!(grad.len(), n, "grad length");
    assert_eq!(m.len(), n, "m length");
    assert_eq!(v.len(), n, "v length");

    // Bias corrections in f64: for β2 close to 1 and small t, 1 − β2ᵗ is tiny
    // and would lose digits if formed in f32.
    let t = s.step as f64;
    let inv_bc1 = T::lit(1.0 / (1.0 - s.beta1.powf(t)));
    let inv_bc2 = T::lit(1.0 / (1.0 - s.beta2.powf(t)));
    let (b1, b2) = (T::lit(s.beta1), T::lit(s.beta2));
    let (omb1, omb2) = (T::lit(1.0 - s.beta1), T::lit(1.0 - s.beta2));
    let (lr, eps, wd, gs) = (T::lit(s.lr), T::lit(s.eps), T::lit(s.weight_decay), T::lit(s.grad_scale));

    let chunk = |pc: &mut [T], gc: &[T], mc: &mut [T], vc: &mut [T]| {
        for (((p, &g), mm), vv) in pc.iter_mut().zip(gc).zip(mc.iter_mut()).zip(vc.iter_mut()) {
            let g = g * gs;
            *mm = b1 * *mm + omb1 * g;
            *vv = b2 * *vv + omb2 * g * g;
            let m_hat = *mm * inv_bc1;
            let v_hat = *vv * inv_bc2;
            *p -= lr * (m_hat / (v_hat.sqrt() + eps) + wd * *p);
        }
    };
    if n < PAR_MIN_ELEMS {
        chunk(param, grad, m, v);
    } else {
        param
            .par_chunks_mut(CHUNK)
            .zip(grad.par_chunks(CHUNK))
            .zip(m.par_chunks_mut(CHUNK))
            .zip(v.par_chunks_mut(CHUNK))
            .for_each(|(((pc, gc), mc), vc)| chunk(pc, gc, mc, vc));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{assert_close, rand_vec};

    /// Textbook AdamW on one scalar, written independently of the kernel.
    fn reference(s: &AdamWStep, p: &mut f64, g: f64, m: &mut f64, v: &mut f64) {
        let g = g * s.grad_scale;
        *p *= 1.0 - s.lr * s.weight_decay;
        *m = s.beta1 * *m + (1.0 - s.beta1) * g;
        *v = s.beta2 * *v + (1.0 - s.beta2) * g * g;
        let m_hat = *m / (1.0 - s.beta1.powi(s.step as i32));
        let v_hat = *v / (1.0 - s.beta2.powi(s.step as i32));
        *p -= s.lr * m_hat / (v_hat.sqrt() + s.eps);
    }

    fn hp(step: u64) -> AdamWStep {
        AdamWStep { lr: 3e-3, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, step, grad_scale: 0.5 }
    }

    #[test]
    fn matches_scalar_reference_over_several_steps() {
        let n = 129;
        let mut p = rand_vec(1, n);
        let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
        let (mut rp, mut rm, mut rv) = (p.clone(), m.clone(), v.clone());
        let mut p32: Vec<f32> = p.iter().map(|&x| x as f32).collect();
        let (mut m32, mut v32) = (vec![0f32; n], vec![0f32; n]);
        for step in 1..=6 {
            let s = hp(step);
            let g = rand_vec(100 + step, n);
            adamw_update(&s, &mut p, &g, &mut m, &mut v);
            for i in 0..n {
                reference(&s, &mut rp[i], g[i], &mut rm[i], &mut rv[i]);
            }
            let g32: Vec<f32> = g.iter().map(|&x| x as f32).collect();
            adamw_update(&s, &mut p32, &g32, &mut m32, &mut v32);
        }
        assert_close(&p, &rp, 1e-14, 1e-12, "adamw param");
        assert_close(&m, &rm, 1e-15, 1e-12, "adamw m");
        assert_close(&v, &rv, 1e-15, 1e-12, "adamw v");
        let up: Vec<f64> = p32.iter().map(|&x| x as f64).collect();
        assert_close(&up, &rp, 1e-6, 1e-6, "adamw param f32");
        // The parameters really moved (by up to ~6 lr).
        let moved = p.iter().zip(rand_vec(1, n)).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(moved > 5e-3, "max movement {moved}");
    }

    #[test]
    fn first_step_moves_each_weight_by_lr() {
        // With m = v = 0 and t = 1: m̂ = g, v̂ = g², so Δp = −lr · g / (|g| + ε) ≈ −lr · sign(g).
        let s = AdamWStep { lr: 1e-2, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, step: 1, grad_scale: 1.0 };
        let g: Vec<f64> = rand_vec(2, 17).iter().map(|x| x * 3.0).collect();
        let p0 = rand_vec(3, 17);
        let mut p = p0.clone();
        let (mut m, mut v) = (vec![0.0; 17], vec![0.0; 17]);
        adamw_update(&s, &mut p, &g, &mut m, &mut v);
        for i in 0..17 {
            let want = -s.lr * g[i] / (g[i].abs() + s.eps);
            assert!((p[i] - p0[i] - want).abs() < 1e-15, "element {i}: Δp {} vs {want}", p[i] - p0[i]);
            assert!(((p[i] - p0[i]).abs() - s.lr).abs() < 1e-8);
        }
    }

    #[test]
    fn zero_gradient_only_decays() {
        let s = AdamWStep { lr: 0.1, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, step: 3, grad_scale: 1.0 };
        let mut p = vec![2.0f32, -4.0, 0.0];
        let (mut m, mut v) = (vec![0f32; 3], vec![0f32; 3]);
        adamw_update(&s, &mut p, &[0.0; 3], &mut m, &mut v);
        // p · (1 − lr · wd), and m = v = 0 contribute exactly nothing.
        let want = [2.0 * (1.0 - 0.001), -4.0 * (1.0 - 0.001), 0.0];
        let got: Vec<f64> = p.iter().map(|&x| x as f64).collect();
        assert_close(&got, &want, 1e-7, 1e-6, "decay only");
        assert_eq!(p[2], 0.0);
    }

    #[test]
    fn large_update_is_thread_count_independent_and_matches_small() {
        let n = 100_003;
        let p0: Vec<f32> = rand_vec(4, n).iter().map(|&x| x as f32).collect();
        let g: Vec<f32> = rand_vec(5, n).iter().map(|&x| x as f32).collect();
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let (mut p, mut m, mut v) = (p0.clone(), vec![0.01f32; n], vec![0.02f32; n]);
                adamw_update(&hp(7), &mut p, &g, &mut m, &mut v);
                (p, m, v)
            })
        };
        let (a, b) = (run(1), run(2));
        assert_eq!(a, b);
        // The parallel path computes exactly what the sequential one does on a prefix.
        let k = 1000;
        let (mut p, mut m, mut v) = (p0[..k].to_vec(), vec![0.01f32; k], vec![0.02f32; k]);
        adamw_update(&hp(7), &mut p, &g[..k], &mut m, &mut v);
        assert_eq!(&a.0[..k], &p[..]);
    }
}
