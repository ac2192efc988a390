//! `exp` in a form that vectorises.
//!
//! A call into the C library per element costs more than the arithmetic
//! around it in softmax rows, attention tiles and activations. In `f32` this
//! module evaluates `exp` with a short polynomial the compiler turns into
//! vector code; `f64` (the gradient-check precision) keeps the library `exp`.

use crate::Real;

/// `exp(x)`: the polynomial below for `f32`, the library's for `f64` (the
/// gradient-check precision).
#[inline(always)]
pub(crate) fn exp<T: Real>(x: T) -> T {
    if std::mem::size_of::<T>() == 4 {
        // For T = f32 both conversions are exact round trips that the
        // compiler removes, leaving plain f32 code.
        T::lit(exp_f32(x.to_f64_lossless() as f32) as f64)
    } else {
        x.exp()
    }
}

/// `exp(x)` within 2 ulp; flushes results below the smallest normal `f32`
/// (`x < -87.3`, including `-inf`) to zero, overflows to `+inf` above about
/// 88.7 (as the library does), and keeps NaN.
///
/// `x = n·ln2 + r` with `|r| <= ln2/2` (ln2 split in two parts so `n·ln2_hi` is
/// exact), `exp(r)` from a degree-7 minimax polynomial, and `2^n` assembled
/// directly in the exponent bits. Every step is plain lane-wise arithmetic, so
/// loops calling this vectorise completely.
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding and subtracting 1.5·2^23 rounds to the nearest integer without
    // a rounding instruction the x86-64 baseline lacks.
    const ROUND: f32 = 12_582_912.0;
    // Above 89 the result is infinite anyway; clamping keeps `n` in the
    // exponent's range (`2^128` assembles as infinity); NaN passes through.
    let x = if x > 89.0 { 89.0 } else { x };
    let t = x * LOG2E + ROUND;
    let n = t - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = ((((((1.987_569_2e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r + 0.166_666_65) * r + 0.5) * r) * r + r + 1.0;
    // `t` is `ROUND + n` exactly (|n| < 2^22), so its bits are ROUND's plus
    // `n`: integer arithmetic on them yields 2^n's exponent field with no
    // float-to-int conversion, whose saturating semantics the compiler
    // cannot vectorise. Outside the range the bits are garbage that the
    // final select discards (or NaN swallows).
    let biased = t.to_bits().wrapping_sub(ROUND.to_bits()).wrapping_add(127);
    let two_n = f32::from_bits(biased << 23);
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
        assert_eq!(exp_f32(89.0), f32::INFINITY);
        assert_eq!(exp_f32(1e30), f32::INFINITY);
        assert_eq!(exp(1.0f64), 1f64.exp());
    }
}
