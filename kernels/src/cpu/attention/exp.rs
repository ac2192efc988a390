//! Exponentials of whole score rows (see [`crate::cpu::exp`]).

use crate::cpu::exp::exp;
use crate::Real;

/// `x[i] = exp(x[i] - shift)`.
#[inline]
pub(super) fn exp_minus<T: Real>(x: &mut [T], shift: T) {
    for e in x {
        *e = exp(*e - shift);
    }
}

/// `x[i] = exp(x[i] - shift[i])`.
#[inline]
pub(super) fn exp_minus_each<T: Real>(x: &mut [T], shift: &[T]) {
    for (e, &s) in x.iter_mut().zip(shift) {
        *e = exp(*e - s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_shift_then_exponentiate() {
        let mut xs = vec![0.5f32, -1.0, f32::NEG_INFINITY, 2.0];
        exp_minus(&mut xs, 0.5);
        assert!((xs[1] - (-1.5f32).exp()).abs() < 1e-7 && xs[0] == 1.0 && xs[2] == 0.0);
        let mut ys = vec![1.0f64, 2.0];
        exp_minus_each(&mut ys, &[1.0, 0.0]);
        assert_eq!(ys, vec![1.0, 2f64.exp()]);
    }
}
