//! Element-wise loops compiled for the widest vectors the CPU offers.
//!
//! The build targets the x86-64 baseline (SSE2: four `f32` lanes). A
//! point-wise loop whose body is a few dozen flops per element, such as an
//! activation with an `exp` and a division, is compute-bound there; the same
//! loop compiled for AVX2 (eight lanes) or AVX-512 (sixteen) runs up to two or
//! four times faster. [`widest`] runs a loop in a copy compiled for the best
//! instruction set the running CPU has, chosen at run time.
//!
//! None of the copies enables fused multiply-add, and Rust never contracts
//! `a * b + c` on its own, so every copy rounds exactly as the baseline does:
//! results are bit-identical whichever copy runs.

/// Runs `body` (a loop over flat buffers) compiled for AVX-512 or AVX2 when
/// the CPU supports them, for the x86-64 baseline otherwise.
///
/// `body` is inlined into each copy, so the loop inside it is vectorised for
/// that copy's instruction set; the check itself is a cached flag load, cheap
/// next to a chunk of thousands of elements. Callers mark their closure
/// `#[inline(always)]`: a large body (an activation's gradient inside a
/// conversion loop) is otherwise left out of line by the inliner and runs
/// in the baseline build, four times slower.
#[inline(always)]
pub(crate) fn widest<R>(body: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: `with_avx512` only requires AVX-512F, which the running
            // CPU was just found to support.
            return unsafe { with_avx512(body) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: `with_avx2` only requires AVX2, which the running CPU
            // was just found to support.
            return unsafe { with_avx2(body) };
        }
    }
    body()
}

/// `body` compiled with 64-byte vectors.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn with_avx512<R>(body: impl FnOnce() -> R) -> R {
    body()
}

/// `body` compiled with 32-byte vectors (AVX2 also widens the integer lanes
/// that `exp` assembles its powers of two in).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn with_avx2<R>(body: impl FnOnce() -> R) -> R {
    body()
}

#[cfg(test)]
mod tests {
    use crate::cpu::exp::exp_f32;

    /// A loop with the shape of the activations: polynomial, bit assembly,
    /// select and division, over finite, infinite and NaN inputs.
    fn logistic(x: &[f32], out: &mut [f32]) {
        for (o, &v) in out.iter_mut().zip(x) {
            *o = 1.0 / (1.0 + exp_f32(-v));
        }
    }

    #[test]
    fn every_available_copy_rounds_like_the_baseline() {
        let mut x: Vec<f32> = (0..40_000).map(|i| (i as f32 - 20_000.0) * 0.0061).collect();
        x.extend([f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -0.0, 1e30, -1e30]);
        let mut want = vec![0f32; x.len()];
        logistic(&x, &mut want);
        let same = |got: &[f32]| got.iter().zip(&want).all(|(g, w)| g.to_bits() == w.to_bits());
        let mut got = vec![0f32; x.len()];
        super::widest(|| logistic(&x, &mut got));
        assert!(same(&got), "selected copy differs from the baseline");
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                got.fill(0.0);
                // SAFETY: AVX2 support was just checked.
                unsafe { super::with_avx2(|| logistic(&x, &mut got)) };
                assert!(same(&got), "AVX2 copy differs from the baseline");
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                got.fill(0.0);
                // SAFETY: AVX-512F support was just checked.
                unsafe { super::with_avx512(|| logistic(&x, &mut got)) };
                assert!(same(&got), "AVX-512 copy differs from the baseline");
            }
        }
    }
}
