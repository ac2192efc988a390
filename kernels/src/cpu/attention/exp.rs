//! Exponentials of whole score rows, in a form that vectorises.
//!
//! Each score tile needs one `exp` per element; a call into the C library per
//! element costs as much as a fifth of the tile's multiply-adds. In `f32`
//! this module evaluates `exp` with a short polynomial the compiler turns into
//! vector code; `f64` (the gradient-check precision) keeps the library `exp`.

use crate::Real;

/// `x[i] = exp(x[i] - shift)`.
#[inline]
pub(super) fn exp_minus<T: Real>(x: &mut [T], shift: T) {
    for e in x {
        *e = exp_t(*e - shift);
    }
}

/// `x[i] = exp(x[i] - shift[i])`.
#[inline]
pub(super) fn exp_minus_each<T: Real>(x: &mut [T], shift: &[T]) {
    for (e, &s) in x.iter_mut().zip(shift) {
        *e = exp_t(*e - s);
    }
}

#[inline(always)]
fn exp_t<T: Real>(x: T) -> T {
    if std::mem::size_of::<T>() == 4 {
        // For T = f32 both conversions are exact round trips that the
        // compiler removes, leaving plain f32 code.
        T::lit(exp_f32(x.to_f64_lossless() as f32) as f64)
    } else {
        x.exp()
    }
}

/// `exp(x)` for `x <= 88`, within 2 ulp; flushes results below the smallest
/// normal `f32` (`x < -87.3`, including `-inf`) to zero, and keeps NaN.
///
/// `x = n·ln2 + r` with `|r| <= ln2/2` (ln2 split in two parts so `n·ln2_hi` is
/// exact), `exp(r)` from a degree-7 minimax polynomial, and `2^n` assembled
/// directly in the exponent bits.
#[inline(always)]
fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding and subtracting 1.5·2^23 rounds to the nearest integer without
    // a rounding instruction the x86-64 baseline lacks.
    const ROUND: f32 = 12_582_912.0;
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = ((((((1.987_569_2e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2)
        * r
        + 0.166_666_65)
        * r
        + 0.5)
        * r)
        * r
        + r
        + 1.0;
    let two_n = f32::from_bits(((n as i32 + 127) as u32) << 23);
    if x < -87.3 {
        0.0
    } else {
        p * two_n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f32_exp_is_accurate_and_handles_the_ends() {
        let mut worst = 0f64;
        for i in 0..=200_000 {
            let x = -87.0 + 88.0 * i as f32 / 200_000.0;
            let want = (x as f64).exp();
            let got = exp_f32(x) as f64;
            worst = worst.max((got - want).abs() / want);
        }
        // 2 ulp of f32 is 2.4e-7 relative.
        assert!(worst < 2.4e-7, "worst relative error {worst}");
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_f32(-1e30), 0.0);
        assert!(exp_f32(f32::NAN).is_nan());

        let mut xs = vec![0.5f32, -1.0, f32::NEG_INFINITY, 2.0];
        exp_minus(&mut xs, 0.5);
        assert!((xs[1] - (-1.5f32).exp()).abs() < 1e-7 && xs[0] == 1.0 && xs[2] == 0.0);
        let mut ys = vec![1.0f64, 2.0];
        exp_minus_each(&mut ys, &[1.0, 0.0]);
        assert_eq!(ys, vec![1.0, 2f64.exp()]);
    }
}
