//! Inverted dropout whose mask is recomputed, never stored.
//!
//! Element `i` of a buffer whose first element has global index `start` is
//! kept iff `key.uniform_at(start + i) >= p`; kept values are scaled by
//! `1 / (1 - p)` so the expectation is unchanged. Because the mask is a pure
//! function of `(key, global index)`, the backward pass regenerates it
//! bit-for-bit, and a shard holding elements `[start, start + n)` of a larger
//! tensor drops exactly the elements the whole tensor would.

use super::elementwise::PAR_CHUNK;
use crate::rng::{philox4x32, RngKey};
use crate::Real;
use rayon::prelude::*;

/// Resolution of [`RngKey::uniform_at`]: it returns `k / 2^24` for a 24-bit `k`.
const UNIFORM_STEPS: f64 = (1u32 << 24) as f64;

/// The Philox block holding the bits of elements `4 * block .. 4 * block + 4`
/// under `key`: one block serves four consecutive elements, which is four
/// times cheaper than calling [`RngKey::bits_at`] per element. Must agree
/// with `RngKey`'s mapping (a test checks it does).
#[inline]
fn block_bits(key: RngKey, block: u64) -> [u32; 4] {
    philox4x32([block as u32, (block >> 32) as u32, key.stream as u32, (key.stream >> 32) as u32], [key.seed as u32, (key.seed >> 32) as u32])
}

/// Philox blocks drawn into a small buffer before their mask is applied,
/// which keeps the masking loop free of generator code so it vectorises.
const BATCH: usize = 8;

/// The smallest 24-bit draw `k` that is kept: `k / 2^24 >= p` holds exactly
/// when `k >= ceil(p * 2^24)` (the product is exact, a power-of-two scaling).
#[inline]
fn keep_threshold(p: f64) -> u32 {
    (p * UNIFORM_STEPS).ceil() as u32
}

/// Writes `out[i] = x[i] * scale` where element `base + i` is kept, `0` elsewhere.
fn apply_mask<T: Real>(key: RngKey, base: u64, threshold: u32, scale: T, x: &[T], out: &mut [T]) {
    let masked = |bits: u32, v: T| if (bits >> 8) >= threshold { v * scale } else { T::zero() };
    // Elements before the first multiple of four share a block with earlier
    // indices that lie outside this slice.
    let head = (((4 - (base & 3)) & 3) as usize).min(x.len());
    if head > 0 {
        let bits = block_bits(key, base >> 2);
        let lane = (base & 3) as usize;
        for (j, (o, &v)) in out[..head].iter_mut().zip(&x[..head]).enumerate() {
            *o = masked(bits[lane + j], v);
        }
    }
    let first_block = (base + head as u64) >> 2;
    let span = 4 * BATCH;
    for (g, (o, x)) in out[head..].chunks_mut(span).zip(x[head..].chunks(span)).enumerate() {
        let block = first_block + (g * BATCH) as u64;
        if x.len() == span {
            let mut bits = [0u32; 4 * BATCH];
            for (q, w) in bits.chunks_exact_mut(4).enumerate() {
                w.copy_from_slice(&block_bits(key, block + q as u64));
            }
            for ((o, &v), &r) in o.iter_mut().zip(x).zip(&bits) {
                *o = masked(r, v);
            }
        } else {
            // The ragged end: one block per four elements.
            for (q, (o, x)) in o.chunks_mut(4).zip(x.chunks(4)).enumerate() {
                let bits = block_bits(key, block + q as u64);
                for (w, (o, &v)) in o.iter_mut().zip(x).enumerate() {
                    *o = masked(bits[w], v);
                }
            }
        }
    }
}

/// Shared body of forward and backward: the same mask applied to `x`.
fn dropout<T: Real>(key: RngKey, start: u64, p: f64, x: &[T], out: &mut [T]) {
    assert!((0.0..1.0).contains(&p), "dropout probability {p} is outside [0, 1)");
    assert_eq!(x.len(), out.len(), "input and output lengths differ");
    if p == 0.0 {
        out.copy_from_slice(x);
        return;
    }
    let threshold = keep_threshold(p);
    let scale = T::lit(1.0 / (1.0 - p));
    if x.len() <= PAR_CHUNK {
        apply_mask(key, start, threshold, scale, x, out);
    } else {
        out.par_chunks_mut(PAR_CHUNK)
            .zip(x.par_chunks(PAR_CHUNK))
            .enumerate()
            .for_each(|(c, (o, x))| apply_mask(key, start + (c * PAR_CHUNK) as u64, threshold, scale, x, o));
    }
}

/// Inverted dropout: `y[i] = x[i] / (1 - p)` if `key.uniform_at(start + i) >= p`,
/// else `0`.
///
/// `x` and `y` are flat buffers of the same length; `start` is the global
/// index of `x[0]` in the tensor the mask is defined over. `p` must lie in
/// `[0, 1)`; `p == 0` copies.
pub fn dropout_forward<T: Real>(key: RngKey, start: u64, p: f64, x: &[T], y: &mut [T]) {
    dropout(key, start, p, x, y);
}

/// Gradient of [`dropout_forward`] with the same `key`, `start` and `p`:
/// `dx[i] = dy[i] / (1 - p)` where the forward kept element `i`, else `0`.
/// The mask is regenerated, not read back.
pub fn dropout_backward<T: Real>(key: RngKey, start: u64, p: f64, dy: &[T], dx: &mut [T]) {
    dropout(key, start, p, dy, dx);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{assert_close, dot, numeric_grad, rand_vec};

    #[test]
    fn block_bits_agree_with_the_generator() {
        let key = RngKey::new(0x1234_5678_9ABC_DEF0, 0xFEDC_BA98_7654_3210);
        for g in [0u64, 1, 2, 3, 4, 5, 1 << 33, (1 << 40) + 3] {
            assert_eq!(block_bits(key, g >> 2)[(g & 3) as usize], key.bits_at(g));
        }
    }

    #[test]
    fn mask_follows_its_definition() {
        let key = RngKey::new(3, 9);
        for p in [0.1, 0.5, 0.9, 1.0 / 3.0, 1.0 - 1e-9] {
            let n = 1003;
            let start = 77;
            let x: Vec<f64> = (0..n).map(|i| i as f64 + 1.0).collect();
            let mut y = vec![f64::NAN; n];
            dropout_forward(key, start, p, &x, &mut y);
            for i in 0..n {
                let kept = key.uniform_at(start + i as u64) as f64 >= p;
                let expected = if kept { x[i] * (1.0 / (1.0 - p)) } else { 0.0 };
                assert_eq!(y[i], expected, "p = {p}, element {i}");
            }
        }
        // A uniform draw equal to p is kept (`>=`), one just below is dropped.
        let u = key.uniform_at(5) as f64;
        let mut y = [0.0];
        dropout_forward(key, 5, u, &[1.0], &mut y);
        assert_ne!(y[0], 0.0);
        dropout_forward(key, 5, u + 1e-12, &[1.0], &mut y);
        assert_eq!(y[0], 0.0);
    }

    #[test]
    fn keeps_about_one_minus_p_and_scales_kept_values() {
        let n = 3 * PAR_CHUNK + 17;
        let x = vec![1f32; n];
        for p in [0.1, 0.5, 0.8] {
            let mut y = vec![0f32; n];
            dropout_forward(RngKey::new(11, 2), 0, p, &x, &mut y);
            let kept = y.iter().filter(|&&v| v != 0.0).count();
            let frac = kept as f64 / n as f64;
            // Binomial standard deviation is below 0.003 here.
            assert!((frac - (1.0 - p)).abs() < 0.015, "p = {p}: kept {frac}");
            let s = (1.0 / (1.0 - p)) as f32;
            assert!(y.iter().all(|&v| v == 0.0 || v == s));
        }
        let src = rand_vec(1, 50);
        let mut y = vec![0.0; 50];
        dropout_forward(RngKey::new(1, 1), 0, 0.0, &src, &mut y);
        assert_eq!(y, src);
    }

    #[test]
    fn mask_is_shared_by_forward_backward_and_slices() {
        let key = RngKey::new(5, 6);
        let p = 0.3;
        let n = 2 * PAR_CHUNK + 1001;
        let x: Vec<f32> = rand_vec(2, n).iter().map(|&v| v as f32 + 2.0).collect();
        let dy: Vec<f32> = rand_vec(3, n).iter().map(|&v| v as f32 + 2.0).collect();
        let (mut y, mut dx) = (vec![0f32; n], vec![0f32; n]);
        dropout_forward(key, 0, p, &x, &mut y);
        dropout_backward(key, 0, p, &dy, &mut dx);
        assert!(y.iter().zip(&dx).all(|(a, b)| (*a == 0.0) == (*b == 0.0)));
        // Unaligned offsets and lengths, small and parallel-sized.
        for (start, len) in [(1usize, 3usize), (5, 2), (6, 1), (3, 17), (501, 129), (4097, PAR_CHUNK + 7)] {
            let mut part = vec![0f32; len];
            dropout_forward(key, start as u64, p, &x[start..start + len], &mut part);
            assert_eq!(&part[..], &y[start..start + len], "slice at {start}");
            dropout_backward(key, start as u64, p, &dy[start..start + len], &mut part);
            assert_eq!(&part[..], &dx[start..start + len], "gradient slice at {start}");
        }
    }

    #[test]
    fn gradient_matches_finite_differences() {
        for n in [1, 3, 17, 129] {
            let key = RngKey::new(n as u64, 4);
            let x = rand_vec(10 + n as u64, n);
            let dy = rand_vec(20 + n as u64, n);
            let mut dx = vec![f64::NAN; n];
            dropout_backward(key, 9, 0.4, &dy, &mut dx);
            let num = numeric_grad(
                |x| {
                    let mut y = vec![0.0; n];
                    dropout_forward(key, 9, 0.4, x, &mut y);
                    dot(&y, &dy)
                },
                &x,
                1e-6,
            );
            assert_close(&dx, &num, 1e-9, 1e-8, "dropout dx");
        }
    }

    #[test]
    fn f32_path_matches_f64_path() {
        let key = RngKey::new(8, 8);
        let x = rand_vec(30, 1000);
        let x32: Vec<f32> = x.iter().map(|&v| v as f32).collect();
        let (mut y, mut y32) = (vec![0f64; 1000], vec![0f32; 1000]);
        dropout_forward(key, 123, 0.25, &x, &mut y);
        dropout_forward(key, 123, 0.25, &x32, &mut y32);
        let widened: Vec<f64> = y32.iter().map(|&v| v as f64).collect();
        assert_close(&widened, &y, 1e-7, 1e-6, "dropout f32");
        assert!(y.iter().zip(&y32).all(|(a, b)| (*a == 0.0) == (*b == 0.0)));
    }

    #[test]
    #[should_panic(expected = "outside [0, 1)")]
    fn rejects_p_of_one() {
        dropout_forward(RngKey::new(0, 0), 0, 1.0, &[1.0f32], &mut [0.0]);
    }
}
