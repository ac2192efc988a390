//! The two 8-bit float formats of FP8 training (the OCP 8-bit floating
//! point specification, as Hopper's tensor cores take them) and the
//! conversions between them and f32.
//!
//! - **E4M3** (`e4m3fn`): 4 exponent bits (bias 7), 3 mantissa bits, no
//!   infinities; `S.1111.111` is NaN, so the largest finite value is
//!   `1.75 · 2⁸ = 448` and the smallest subnormal `2⁻⁹`. Forward operands
//!   (activations and weights): more precision, less range.
//! - **E5M2**: 5 exponent bits (bias 15), 2 mantissa bits, IEEE-like
//!   (`S.11111.00` infinite, other `S.11111.xx` NaN); largest finite
//!   `1.75 · 2¹⁵ = 57344`, smallest subnormal `2⁻¹⁶`. Gradients: more range.
//!
//! Encoding rounds to the nearest code, ties to the even mantissa, and
//! saturates: a magnitude past the largest finite value (infinity
//! included) becomes that value, as CUDA's `__NV_SATFINITE` conversion
//! does, so that a scale a little too large clips instead of overflowing;
//! NaN stays NaN (`0x7F`, with the sign). Every code's value is exact in
//! f32, and so is a product of two of them (at most 4 × 4 significant bits),
//! so a product of FP8 matrices summed in f32 is what a tensor core computes
//! up to the order and width of its sums.

use crate::Real;

/// An 8-bit float format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8Format {
    /// 4 exponent bits, 3 mantissa bits, max 448 (forward operands).
    E4M3,
    /// 5 exponent bits, 2 mantissa bits, max 57344 (gradients).
    E5M2,
}

impl Fp8Format {
    /// Mantissa bits.
    pub const fn mantissa_bits(self) -> u32 {
        match self {
            Fp8Format::E4M3 => 3,
            Fp8Format::E5M2 => 2,
        }
    }

    /// The exponent bias.
    pub const fn bias(self) -> i32 {
        match self {
            Fp8Format::E4M3 => 7,
            Fp8Format::E5M2 => 15,
        }
    }

    /// The code of the largest finite magnitude.
    pub const fn max_code(self) -> u8 {
        match self {
            Fp8Format::E4M3 => 0x7E,
            Fp8Format::E5M2 => 0x7B,
        }
    }

    /// The largest finite value: 448 or 57344.
    pub const fn max(self) -> f32 {
        match self {
            Fp8Format::E4M3 => 448.0,
            Fp8Format::E5M2 => 57344.0,
        }
    }

    /// The value of `code`.
    pub fn decode(self, code: u8) -> f32 {
        let sign = if code & 0x80 != 0 { -1.0f32 } else { 1.0 };
        let m_bits = self.mantissa_bits();
        let e = i32::from((code & 0x7F) >> m_bits);
        let m = u32::from(code) & ((1 << m_bits) - 1);
        let e_max = (1i32 << (7 - m_bits)) - 1;
        match self {
            Fp8Format::E4M3 if e == e_max && m == (1 << m_bits) - 1 => return f32::NAN,
            Fp8Format::E5M2 if e == e_max => return if m == 0 { sign * f32::INFINITY } else { f32::NAN },
            _ => {}
        }
        let scale = (1u32 << m_bits) as f32;
        let magnitude = if e == 0 {
            // Subnormal: m / 2^M · 2^(1 − bias).
            m as f32 / scale * pow2(1 - self.bias())
        } else {
            (1.0 + m as f32 / scale) * pow2(e - self.bias())
        };
        sign * magnitude
    }

    /// The code nearest `x` (ties to the even mantissa), saturating at the
    /// largest finite value; NaN encodes as NaN.
    pub fn encode(self, x: f32) -> u8 {
        let sign: u8 = if x.is_sign_negative() { 0x80 } else { 0 };
        if x.is_nan() {
            return sign | 0x7F;
        }
        let a = f64::from(x.abs());
        let m_bits = self.mantissa_bits() as i32;
        let min_normal_exp = 1 - self.bias();
        let code = if a < pow2_f64(min_normal_exp) {
            // Subnormals are multiples of 2^(1 − bias − M); rounding up to
            // 2^M of them is the smallest normal, whose code is the same number.
            let q = (a / pow2_f64(min_normal_exp - m_bits)).round_ties_even();
            q as u32
        } else {
            let mut e = exponent(a);
            let mut m = ((a / pow2_f64(e) - 1.0) * pow2_f64(m_bits)).round_ties_even() as u32;
            if m == 1 << m_bits {
                e += 1;
                m = 0;
            }
            let biased = e + self.bias();
            // Past the code space: saturate below.
            if biased >= 1 << (7 - m_bits) {
                u32::from(self.max_code())
            } else {
                ((biased as u32) << m_bits) | m
            }
        };
        sign | code.min(u32::from(self.max_code())) as u8
    }
}

/// `⌊log₂ a⌋` of a positive finite `a`, exactly.
fn exponent(a: f64) -> i32 {
    ((a.to_bits() >> 52) & 0x7FF) as i32 - 1023
}

fn pow2(e: i32) -> f32 {
    pow2_f64(e) as f32
}

fn pow2_f64(e: i32) -> f64 {
    2f64.powi(e)
}

/// The largest magnitude in `x` (0 for an empty slice; NaN when any is NaN).
pub fn amax(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |m, &v| if v.is_nan() || m.is_nan() { f32::NAN } else { m.max(v.abs()) })
}

/// `dst[i] = encode(src[i] · scale)`.
pub fn quantize(format: Fp8Format, src: &[f32], scale: f32, dst: &mut [u8]) {
    assert_eq!(src.len(), dst.len(), "fp8 quantize: source and codes differ in length");
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = format.encode(s * scale);
    }
}

/// `dst[i] = decode(codes[i]) / scale`.
pub fn dequantize(format: Fp8Format, codes: &[u8], scale: f32, dst: &mut [f32]) {
    assert_eq!(codes.len(), dst.len(), "fp8 dequantize: codes and output differ in length");
    let table = table(format);
    for (d, &c) in dst.iter_mut().zip(codes) {
        *d = table[usize::from(c)] / scale;
    }
}

/// `x[i] ← decode(encode(x[i] · scale)) / scale`: the value an FP8 operand
/// stands for, in f32, so that an f32 product of such operands is the
/// FP8 product (the CPU emulation).
pub fn round_trip(format: Fp8Format, x: &mut [f32], scale: f32) {
    let table = table(format);
    for v in x.iter_mut() {
        *v = table[usize::from(format.encode(*v * scale))] / scale;
    }
}

/// `out[i] = decode(encode(x[i] · scale))`: the value of each element's
/// code, unscaled. Such values are exact in every float dtype (at most 4
/// significant bits, exponents within f16's range), so a product of them
/// computed in f32 and multiplied by `1 / (scale_a · scale_b)` is the FP8
/// product. The scaling and rounding are in f32 whatever `T` is.
pub fn values<T: Real>(format: Fp8Format, x: &[T], scale: f32, out: &mut [T]) {
    assert_eq!(x.len(), out.len(), "fp8 values: input and output differ in length");
    let table = table(format);
    for (o, &v) in out.iter_mut().zip(x) {
        *o = T::lit(f64::from(table[usize::from(format.encode(v.to_f64_lossless() as f32 * scale))]));
    }
}

/// Every code's value, by code.
pub fn table(format: Fp8Format) -> &'static [f32; 256] {
    use std::sync::OnceLock;
    static E4M3: OnceLock<[f32; 256]> = OnceLock::new();
    static E5M2: OnceLock<[f32; 256]> = OnceLock::new();
    let cell = match format {
        Fp8Format::E4M3 => &E4M3,
        Fp8Format::E5M2 => &E5M2,
    };
    cell.get_or_init(|| std::array::from_fn(|c| format.decode(c as u8)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const FORMATS: [Fp8Format; 2] = [Fp8Format::E4M3, Fp8Format::E5M2];

    /// The finite codes of a format with their values, ascending by value
    /// (positive and negative zero both present).
    fn finite(format: Fp8Format) -> Vec<(u8, f32)> {
        let mut v: Vec<(u8, f32)> = (0..=255u8).map(|c| (c, format.decode(c))).filter(|(_, x)| x.is_finite()).collect();
        v.sort_by(|a, b| a.1.total_cmp(&b.1));
        v
    }

    #[test]
    fn the_formats_have_their_published_landmarks() {
        let e4 = Fp8Format::E4M3;
        assert_eq!((e4.decode(0x7E), e4.decode(0x01), e4.decode(0x08), e4.decode(0x38)), (448.0, 2f32.powi(-9), 2f32.powi(-6), 1.0));
        assert!(e4.decode(0x7F).is_nan() && e4.decode(0xFF).is_nan());
        // No infinity in E4M3: 0x78..0x7E are finite.
        assert_eq!(e4.decode(0x78), 256.0);
        let e5 = Fp8Format::E5M2;
        assert_eq!((e5.decode(0x7B), e5.decode(0x01), e5.decode(0x04), e5.decode(0x3C)), (57344.0, 2f32.powi(-16), 2f32.powi(-14), 1.0));
        assert_eq!((e5.decode(0x7C), e5.decode(0xFC)), (f32::INFINITY, f32::NEG_INFINITY));
        assert!(e5.decode(0x7D).is_nan());
        // 254 finite codes in E4M3 (two NaNs), 248 in E5M2 (two infinities, six NaNs).
        assert_eq!((finite(e4).len(), finite(e5).len()), (254, 248));
        for f in FORMATS {
            assert_eq!(f.max(), f.decode(f.max_code()));
        }
    }

    #[test]
    fn every_finite_code_round_trips() {
        for f in FORMATS {
            for (c, x) in finite(f) {
                assert_eq!(f.encode(x), c, "{f:?} code {c:#04x} ({x})");
            }
        }
    }

    /// Against a brute force over the whole code table: the nearest finite
    /// value, ties to the even code (even mantissa), saturating beyond the
    /// largest; for inputs at, between and around every pair of neighbours.
    #[test]
    fn encoding_is_the_nearest_code_ties_to_even_and_saturates() {
        for f in FORMATS {
            let codes = finite(f);
            let positives: Vec<(u8, f32)> = codes.iter().copied().filter(|&(c, x)| x >= 0.0 && c & 0x80 == 0).collect();
            let nearest = |x: f32| -> u8 {
                let a = x.abs().min(f.max());
                let mut best = positives[0];
                for &(c, v) in &positives {
                    let (d, bd) = ((v - a).abs(), (best.1 - a).abs());
                    if d < bd || (d == bd && c % 2 == 0 && best.0 % 2 == 1) {
                        best = (c, v);
                    }
                }
                best.0 | if x.is_sign_negative() { 0x80 } else { 0 }
            };
            let mut probes = vec![0.0f32, 1e-30, f.max() * 1.01, f.max() * 4.0, f32::MAX, f32::INFINITY];
            for w in positives.windows(2) {
                let (a, b) = (w[0].1, w[1].1);
                let mid = (a + b) / 2.0;
                probes.extend([a, mid, f32::from_bits(mid.to_bits() - 1), f32::from_bits(mid.to_bits() + 1), a + (b - a) * 0.3, a + (b - a) * 0.7]);
            }
            for x in probes.into_iter().flat_map(|x| [x, -x]) {
                assert_eq!(f.encode(x), nearest(x), "{f:?}: {x:e}");
            }
            assert!(f.decode(f.encode(f32::NAN)).is_nan());
        }
    }

    #[test]
    fn quantize_and_dequantize_undo_each_other_to_within_half_a_step() {
        let src: Vec<f32> = (0..1000).map(|i| ((i as f32 * 0.37).sin() * 3.0).powi(3)).collect();
        for f in FORMATS {
            let scale = f.max() / amax(&src);
            let mut codes = vec![0u8; src.len()];
            quantize(f, &src, scale, &mut codes);
            let mut back = vec![0.0f32; src.len()];
            dequantize(f, &codes, scale, &mut back);
            let mut trip = src.clone();
            round_trip(f, &mut trip, scale);
            assert_eq!(back, trip);
            for (x, y) in src.iter().zip(&back) {
                // Relative half-step of the mantissa, or half the smallest subnormal step.
                let bound = x.abs() * 2f32.powi(-(f.mantissa_bits() as i32) - 1) + 2f32.powi(-f.bias() - f.mantissa_bits() as i32) / scale;
                assert!((x - y).abs() <= bound * 1.0001, "{f:?}: {x} -> {y}");
            }
        }
        assert!(amax(&[1.0, f32::NAN]).is_nan());
        assert_eq!(amax(&[-3.0, 2.0]), 3.0);
    }

    /// Against `ml_dtypes` (the conversions JAX and NumPy use), on the
    /// values `scripts/fp8-reference.py` writes: run it, then this test
    /// with `--ignored` (it needs Python, so CI does not run it).
    #[test]
    #[ignore = "needs the file scripts/fp8-reference.py writes"]
    fn encoding_agrees_with_ml_dtypes() {
        let path = std::env::var("TESSERA_FP8_REFERENCE").unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/../target/fp8-reference.txt").into());
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}; run scripts/fp8-reference.py first"));
        let (mut agree, mut beyond) = (0, 0);
        for line in text.lines() {
            let v: Vec<u32> = line.split(' ').map(|s| s.parse().unwrap()).collect();
            let x = f32::from_bits(v[0]);
            for (f, want) in [(Fp8Format::E4M3, v[1] as u8), (Fp8Format::E5M2, v[2] as u8)] {
                // ml_dtypes turns what is past the largest value into NaN
                // or infinity; these saturate (tested above).
                if x.abs() > f.max() {
                    beyond += 1;
                    continue;
                }
                assert_eq!(f.encode(x), want, "{f:?}: {x:e}");
                agree += 1;
            }
        }
        eprintln!("{agree} conversions agree with ml_dtypes ({beyond} beyond the largest value skipped)");
    }
}
