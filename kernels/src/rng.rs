//! Counter-based random numbers (Philox4x32-10).
//!
//! A counter-based generator maps `(seed, stream, index)` straight to a random
//! value with no sequential state. That is what distributed initialisation
//! needs: a rank that owns elements `[a, b)` of a global tensor draws exactly
//! the values a single rank would have drawn for those positions, so sharded
//! and unsharded runs start from identical weights. Dropout masks use the same
//! mapping, which makes them reproducible and recomputable during backward.
//!
//! Element `i` of stream `s` reads word `i % 4` of Philox block `i / 4` for
//! uniforms, and one half of a Box–Muller pair from block `i / 2` for normals.

use crate::Real;
use rayon::prelude::*;

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// One Philox4x32 block: ten rounds over a 128-bit counter with a 64-bit key.
#[inline]
pub fn philox4x32(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (counter, key);
    for _ in 0..10 {
        let p0 = (M0 as u64) * (c[0] as u64);
        let p1 = (M1 as u64) * (c[2] as u64);
        c = [((p1 >> 32) as u32) ^ c[1] ^ k[0], p1 as u32, ((p0 >> 32) as u32) ^ c[3] ^ k[1], p0 as u32];
        k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
    }
    c
}

/// Where random values come from: a seed plus a stream that separates
/// independent uses of one seed (one stream per parameter, per dropout site...).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RngKey {
    /// The seed.
    pub seed: u64,
    /// The stream, one per independent use of the seed.
    pub stream: u64,
}

impl RngKey {
    /// The key of stream `stream` of `seed`.
    pub fn new(seed: u64, stream: u64) -> Self {
        Self { seed, stream }
    }

    #[inline]
    fn block(self, block: u64) -> [u32; 4] {
        philox4x32([block as u32, (block >> 32) as u32, self.stream as u32, (self.stream >> 32) as u32], [self.seed as u32, (self.seed >> 32) as u32])
    }

    /// The raw 32 random bits of element `index`.
    #[inline]
    pub fn bits_at(self, index: u64) -> u32 {
        self.block(index >> 2)[(index & 3) as usize]
    }

    /// A uniform value in `[0, 1)` for element `index`, with 24 bits of resolution
    /// (every value is exactly representable in `f32`).
    #[inline]
    pub fn uniform_at(self, index: u64) -> f32 {
        (self.bits_at(index) >> 8) as f32 * (1.0 / (1u32 << 24) as f32)
    }

    /// A standard normal value for element `index` (Box–Muller on one block).
    #[inline]
    pub fn normal_at(self, index: u64) -> f64 {
        let b = self.block(index >> 1);
        let (lo, hi) = if index & 1 == 0 { (b[0], b[1]) } else { (b[2], b[3]) };
        // u1 in (0, 1]: never zero, so the logarithm is finite.
        let u1 = ((lo >> 8) as f64 + 1.0) / (1u32 << 24) as f64;
        let u2 = (hi >> 8) as f64 / (1u32 << 24) as f64;
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

const CHUNK: usize = 1 << 14;

/// Fills `out[j]` with a uniform value in `[lo, hi)` drawn for global index `start + j`.
pub fn fill_uniform<T: Real>(key: RngKey, start: u64, lo: T, hi: T, out: &mut [T]) {
    out.par_chunks_mut(CHUNK).enumerate().for_each(|(c, chunk)| {
        let base = start + (c * CHUNK) as u64;
        for (j, v) in chunk.iter_mut().enumerate() {
            let u = T::lit(key.uniform_at(base + j as u64) as f64);
            *v = lo + (hi - lo) * u;
        }
    });
}

/// Fills `out[j]` with `mean + std * z`, `z` standard normal, drawn for global index `start + j`.
pub fn fill_normal<T: Real>(key: RngKey, start: u64, mean: T, std: T, out: &mut [T]) {
    out.par_chunks_mut(CHUNK).enumerate().for_each(|(c, chunk)| {
        let base = start + (c * CHUNK) as u64;
        for (j, v) in chunk.iter_mut().enumerate() {
            *v = mean + std * T::lit(key.normal_at(base + j as u64));
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slice_draws_the_same_values_as_the_whole() {
        let key = RngKey::new(7, 3);
        let mut whole = vec![0f32; 1000];
        fill_normal(key, 0, 0.0, 1.0, &mut whole);
        let mut part = vec![0f32; 333];
        fill_normal(key, 501, 0.0, 1.0, &mut part);
        assert_eq!(&whole[501..834], &part[..]);
        let mut u_whole = vec![0f64; 1000];
        fill_uniform(key, 0, -1.0, 1.0, &mut u_whole);
        let mut u_part = vec![0f64; 17];
        fill_uniform(key, 3, -1.0, 1.0, &mut u_part);
        assert_eq!(&u_whole[3..20], &u_part[..]);
    }

    #[test]
    fn streams_and_seeds_differ() {
        let a = RngKey::new(1, 0).bits_at(5);
        assert_ne!(a, RngKey::new(1, 1).bits_at(5));
        assert_ne!(a, RngKey::new(2, 0).bits_at(5));
    }

    #[test]
    fn moments_are_right() {
        let n = 200_000;
        let mut z = vec![0f64; n];
        fill_normal(RngKey::new(42, 0), 0, 0.0, 1.0, &mut z);
        let mean = z.iter().sum::<f64>() / n as f64;
        let var = z.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.02, "var {var}");
        let mut u = vec![0f32; n];
        fill_uniform(RngKey::new(42, 1), 0, 0.0, 1.0, &mut u);
        assert!(u.iter().all(|&x| (0.0..1.0).contains(&x)));
        let mean = u.iter().map(|&x| x as f64).sum::<f64>() / n as f64;
        assert!((mean - 0.5).abs() < 0.005, "mean {mean}");
    }
}
