//! Precision conversions between `f32` and `bf16`/`f16`/`f64` buffers.
//!
//! Mixed-precision training converts every weight and activation at least
//! once per step, so these run in parallel chunks. f16 uses `half`'s slice
//! conversions, which use the CPU's conversion instructions (F16C) when
//! present; bf16 is a shift one way and an integer rounding the other, in
//! loops that vectorise (`half`'s bf16 slice conversions run an element at
//! a time), with the same results. Narrowing rounds to nearest, ties to
//! even; NaN stays NaN and values beyond the narrow type's range become
//! infinities.

use super::elementwise::{map1, PAR_CHUNK};
use super::mixed::{narrow_bf16, widen_bf16};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rayon::prelude::*;

/// Runs a slice-to-slice conversion over matching chunks, in parallel once
/// the buffers are large.
fn convert<S: Sync, D: Send>(src: &[S], dst: &mut [D], f: impl Fn(&[S], &mut [D]) + Sync) {
    assert_eq!(src.len(), dst.len(), "source and destination lengths differ");
    if src.len() <= PAR_CHUNK {
        f(src, dst);
    } else {
        dst.par_chunks_mut(PAR_CHUNK).zip(src.par_chunks(PAR_CHUNK)).for_each(|(d, s)| f(s, d));
    }
}

/// Narrows `src` to bfloat16 element-wise (round to nearest even); both
/// buffers have the same length.
pub fn f32_to_bf16(src: &[f32], dst: &mut [bf16]) {
    convert(src, dst, narrow_bf16);
}

/// Widens bfloat16 to `f32` element-wise (exact); both buffers have the same length.
pub fn bf16_to_f32(src: &[bf16], dst: &mut [f32]) {
    convert(src, dst, widen_bf16);
}

/// Narrows `src` to IEEE half precision element-wise (round to nearest even,
/// overflow to infinity, gradual underflow); both buffers have the same length.
pub fn f32_to_f16(src: &[f32], dst: &mut [f16]) {
    convert(src, dst, |s, d| d.convert_from_f32_slice(s));
}

/// Widens IEEE half precision to `f32` element-wise (exact); both buffers
/// have the same length.
pub fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
    convert(src, dst, |s, d| s.convert_to_f32_slice(d));
}

/// Widens `f32` to `f64` element-wise (exact); both buffers have the same length.
pub fn f32_to_f64(src: &[f32], dst: &mut [f64]) {
    map1(src, dst, |v| v as f64);
}

/// Narrows `f64` to `f32` element-wise (round to nearest even); both buffers
/// have the same length.
pub fn f64_to_f32(src: &[f64], dst: &mut [f32]) {
    map1(src, dst, |v| v as f32);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::rand_vec;

    #[test]
    fn bf16_rounds_to_nearest_even() {
        // bf16 keeps the top 16 bits of an f32; the low 16 decide the rounding.
        let cases: [(u32, u16); 8] = [
            (0x3F80_0000, 0x3F80), // 1.0 exactly
            (0x3F80_7FFF, 0x3F80), // below half an ulp: down
            (0x3F80_8000, 0x3F80), // tie, even mantissa stays
            (0x3F81_8000, 0x3F82), // tie, odd mantissa rounds up to even
            (0x3F80_8001, 0x3F81), // above half: up
            (0xBF80_8000, 0xBF80), // negative tie to even
            (0x7F7F_FFFF, 0x7F80), // f32::MAX overflows to infinity
            (0x0000_0001, 0x0000), // smallest subnormal rounds to zero
        ];
        let src: Vec<f32> = cases.iter().map(|&(b, _)| f32::from_bits(b)).collect();
        let mut dst = vec![bf16::ZERO; cases.len()];
        f32_to_bf16(&src, &mut dst);
        for (&(from, to), d) in cases.iter().zip(&dst) {
            assert_eq!(d.to_bits(), to, "bf16 of {from:#010x}");
        }
        let mut nan = [bf16::ZERO];
        f32_to_bf16(&[f32::NAN], &mut nan);
        assert!(nan[0].is_nan());
    }

    #[test]
    fn f16_rounds_to_nearest_even() {
        // f16 has 10 mantissa bits: 13 of f32's 23 are dropped.
        let one_plus = |m: u32| f32::from_bits(0x3F80_0000 | m);
        let cases: [(f32, u16); 8] = [
            (1.0, 0x3C00),
            (one_plus(0x0FFF), 0x3C00),            // below half an ulp: down
            (one_plus(0x1000), 0x3C00),            // tie, even mantissa stays
            (one_plus(0x3000), 0x3C02),            // tie, odd mantissa rounds up to even
            (one_plus(0x1001), 0x3C01),            // above half: up
            (65504.0, 0x7BFF),                     // largest finite f16
            (65520.0, 0x7C00),                     // tie at the top rounds to infinity
            (f32::from_bits(0x3380_0000), 0x0001), // 2^-24: smallest subnormal
        ];
        let src: Vec<f32> = cases.iter().map(|&(v, _)| v).collect();
        let mut dst = vec![f16::ZERO; cases.len()];
        f32_to_f16(&src, &mut dst);
        for (&(from, to), d) in cases.iter().zip(&dst) {
            assert_eq!(d.to_bits(), to, "f16 of {from:e}");
        }
    }

    #[test]
    fn f64_to_f32_rounds_to_nearest_even() {
        let one_plus = |m: u64| f64::from_bits(0x3FF0_0000_0000_0000 | m);
        // f32 keeps 23 of f64's 52 mantissa bits: 29 are dropped.
        let src = [one_plus(1 << 28), one_plus(3 << 28), one_plus((1 << 28) + 1)];
        let mut dst = [0f32; 3];
        f64_to_f32(&src, &mut dst);
        assert_eq!(dst.map(f32::to_bits), [0x3F80_0000, 0x3F80_0002, 0x3F80_0001]);
    }

    #[test]
    fn representable_values_round_trip_exactly() {
        // Every finite bf16 and f16 bit pattern, plus a parallel-sized buffer.
        let bf: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).filter(|v| v.is_finite()).collect();
        let mut wide = vec![0f32; bf.len()];
        bf16_to_f32(&bf, &mut wide);
        let mut back = vec![bf16::ZERO; bf.len()];
        f32_to_bf16(&wide, &mut back);
        assert!(bf.iter().zip(&back).all(|(a, b)| a.to_bits() == b.to_bits()));

        let hf: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).filter(|v| v.is_finite()).collect();
        let mut wide = vec![0f32; hf.len()];
        f16_to_f32(&hf, &mut wide);
        let mut back = vec![f16::ZERO; hf.len()];
        f32_to_f16(&wide, &mut back);
        assert!(hf.iter().zip(&back).all(|(a, b)| a.to_bits() == b.to_bits()));

        let x: Vec<f32> = rand_vec(1, 3 * PAR_CHUNK + 5).iter().map(|&v| v as f32 * 100.0).collect();
        let mut d = vec![0f64; x.len()];
        f32_to_f64(&x, &mut d);
        let mut back = vec![0f32; x.len()];
        f64_to_f32(&d, &mut back);
        assert!(x.iter().zip(&back).all(|(a, b)| a.to_bits() == b.to_bits()));
        assert!(x.iter().zip(&d).all(|(&a, &b)| a as f64 == b));
    }

    #[test]
    fn parallel_conversion_matches_scalar_conversion() {
        let x: Vec<f32> = rand_vec(2, 2 * PAR_CHUNK + 3).iter().map(|&v| v as f32 * 1e3).collect();
        let mut b = vec![bf16::ZERO; x.len()];
        f32_to_bf16(&x, &mut b);
        assert!(x.iter().zip(&b).all(|(&v, h)| bf16::from_f32(v).to_bits() == h.to_bits()));
        let mut h = vec![f16::ZERO; x.len()];
        f32_to_f16(&x, &mut h);
        assert!(x.iter().zip(&h).all(|(&v, h)| f16::from_f32(v).to_bits() == h.to_bits()));
        let mut w = vec![0f32; x.len()];
        f16_to_f32(&h, &mut w);
        assert!(h.iter().zip(&w).all(|(h, &v)| h.to_f32() == v));
        bf16_to_f32(&b, &mut w);
        assert!(b.iter().zip(&w).all(|(h, &v)| h.to_f32() == v));
    }
}
