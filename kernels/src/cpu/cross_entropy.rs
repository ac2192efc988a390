//! Fused log-softmax + negative log-likelihood (cross-entropy) over a vocabulary.
//!
//! The forward never materialises probabilities: each row's log-sum-exp is
//! found in one streaming pass that keeps a running maximum `m` and a running
//! `Σ exp(x − m)`, rescaling the sum whenever the maximum grows, so logits of
//! any magnitude stay finite. The log-sum-exp is saved so that the backward
//! recomputes `softmax = exp(x − lse)` in a single pass as well.

use super::exp::exp;
use crate::Real;
use rayon::prelude::*;

/// Below this many elements the work stays on the calling thread.
const PAR_MIN_ELEMS: usize = 32 * 1024;
/// Rough number of elements one parallel task should cover.
const TASK_ELEMS: usize = 16 * 1024;
/// Block of the online log-sum-exp: the block maximum is found first (a
/// cheap, vectorisable scan over data already in L1), so the running sum is
/// rescaled at most once per block instead of at every new maximum.
const LSE_BLOCK: usize = 256;

/// `log Σ exp(x)`, stable for any magnitude; `-inf` for an all-`-inf` row.
fn log_sum_exp<T: Real>(x: &[T]) -> T {
    let mut m = T::neg_infinity();
    let mut s = T::zero();
    for blk in x.chunks(LSE_BLOCK) {
        let bm = blk.iter().fold(T::neg_infinity(), |a, &b| a.max(b));
        if bm > m {
            // exp(-inf) = 0 makes the very first rescale a no-op.
            s *= exp(m - bm);
            m = bm;
        }
        if m == T::neg_infinity() {
            continue;
        }
        let mut bs = T::zero();
        for &v in blk {
            bs += exp(v - m);
        }
        s += bs;
    }
    m + s.ln()
}

fn rows_per_task(vocab: usize) -> usize {
    (TASK_ELEMS / vocab).max(1)
}

/// Cross-entropy forward: for each row `r` of `logits` (`n × vocab`),
/// `lse[r] = log Σ_j exp(logits[r, j])` and
/// `losses[r] = lse[r] − logits[r, targets[r]]`.
///
/// `targets`, `losses`, `lse`: `n` (outputs overwritten). Rows whose target
/// equals `ignore_index` get `losses[r] = 0` and `lse[r] = 0` (their logits are
/// not read). Other targets must be `< vocab` (asserted). Returns the number of
/// rows not ignored, the usual divisor of a mean loss.
pub fn cross_entropy_forward<T: Real>(logits: &[T], vocab: usize, targets: &[u32], ignore_index: Option<u32>, losses: &mut [T], lse: &mut [T]) -> usize {
    assert!(vocab > 0, "vocab must be positive");
    let n = targets.len();
    assert_eq!(logits.len(), n * vocab, "logits length");
    assert_eq!(losses.len(), n, "losses length");
    assert_eq!(lse.len(), n, "lse length");
    let ignored = |t: u32| ignore_index == Some(t);
    let mut counted = 0;
    for &t in targets {
        if !ignored(t) {
            assert!((t as usize) < vocab, "target {t} outside the vocabulary of {vocab}");
            counted += 1;
        }
    }

    let one = |(((xr, &t), loss), l): (((&[T], &u32), &mut T), &mut T)| {
        if ignored(t) {
            *loss = T::zero();
            *l = T::zero();
        } else {
            let v = log_sum_exp(xr);
            *l = v;
            *loss = v - xr[t as usize];
        }
    };
    if logits.len() < PAR_MIN_ELEMS {
        logits.chunks(vocab).zip(targets).zip(losses.iter_mut()).zip(lse.iter_mut()).for_each(one);
    } else {
        logits.par_chunks(vocab).zip(targets.par_iter()).zip(losses.par_iter_mut()).zip(lse.par_iter_mut()).with_min_len(rows_per_task(vocab)).for_each(one);
    }
    counted
}

/// Cross-entropy backward:
/// `dlogits[r, j] = dloss[r] · (softmax(logits[r])[j] − [j == targets[r]])`,
/// with the softmax recomputed as `exp(logits − lse)` from the forward's `lse`.
///
/// `logits`, `dlogits`: `n × vocab` (`dlogits` overwritten); `lse`, `targets`,
/// `dloss`: `n`. Ignored rows (target == `ignore_index`) get zero gradient.
pub fn cross_entropy_backward<T: Real>(logits: &[T], lse: &[T], vocab: usize, targets: &[u32], ignore_index: Option<u32>, dloss: &[T], dlogits: &mut [T]) {
    for &t in targets {
        assert!(ignore_index == Some(t) || (t as usize) < vocab, "target {t} outside the vocabulary of {vocab}");
    }
    vocab_shard_backward(logits, lse, vocab, 0, targets, ignore_index, dloss, dlogits);
}

/// Per-row statistics of one shard of a vocabulary-parallel cross-entropy.
///
/// `logits` (`n × vocab_local`) hold vocabulary entries
/// `vocab_start .. vocab_start + vocab_local` of each row. Writes this shard's
/// log-sum-exp per row, and the target's logit where the target falls in this
/// shard (0 elsewhere, and for ignored rows). Summing `target_logit` over the
/// shards and combining their `lse` with a log-sum-exp gives the full row's
/// statistics without ever gathering the logits.
#[allow(clippy::too_many_arguments)]
pub fn vocab_shard_stats<T: Real>(
    logits: &[T],
    vocab_local: usize,
    vocab_start: u32,
    targets: &[u32],
    ignore_index: Option<u32>,
    lse: &mut [T],
    target_logit: &mut [T],
) {
    assert!(vocab_local > 0, "vocab shard must be non-empty");
    let n = targets.len();
    assert_eq!(logits.len(), n * vocab_local, "logits length");
    assert_eq!(lse.len(), n, "lse length");
    assert_eq!(target_logit.len(), n, "target_logit length");
    let one = |xr: &[T], t: u32, l: &mut T, tl: &mut T| {
        *l = log_sum_exp(xr);
        *tl = match local_target(t, vocab_start, vocab_local, ignore_index) {
            Some(j) => xr[j],
            None => T::zero(),
        };
    };
    if logits.len() < PAR_MIN_ELEMS {
        for (((xr, &t), l), tl) in logits.chunks(vocab_local).zip(targets).zip(lse.iter_mut()).zip(target_logit.iter_mut()) {
            one(xr, t, l, tl);
        }
    } else {
        logits
            .par_chunks(vocab_local)
            .zip(targets.par_iter())
            .zip(lse.par_iter_mut())
            .zip(target_logit.par_iter_mut())
            .with_min_len(rows_per_task(vocab_local))
            .for_each(|(((xr, &t), l), tl)| one(xr, t, l, tl));
    }
}

/// The column of `target` in a shard starting at `vocab_start`, if it is there.
fn local_target(target: u32, vocab_start: u32, vocab_local: usize, ignore_index: Option<u32>) -> Option<usize> {
    if ignore_index == Some(target) || target < vocab_start {
        return None;
    }
    let j = (target - vocab_start) as usize;
    (j < vocab_local).then_some(j)
}

/// Backward of a vocabulary shard: `dlogits[r, j] = dloss[r] · (exp(logits[r, j] − lse[r]) − [vocab_start + j == targets[r]])`,
/// where `lse` is the full row's log-sum-exp (over every shard). Ignored rows get zeros.
#[allow(clippy::too_many_arguments)]
pub fn vocab_shard_backward<T: Real>(
    logits: &[T],
    lse: &[T],
    vocab_local: usize,
    vocab_start: u32,
    targets: &[u32],
    ignore_index: Option<u32>,
    dloss: &[T],
    dlogits: &mut [T],
) {
    assert!(vocab_local > 0, "vocab must be positive");
    let n = targets.len();
    assert_eq!(logits.len(), n * vocab_local, "logits length");
    assert_eq!(lse.len(), n, "lse length");
    assert_eq!(dloss.len(), n, "dloss length");
    assert_eq!(dlogits.len(), n * vocab_local, "dlogits length");

    let one = |xr: &[T], dr: &mut [T], t: u32, l: T, dl: T| {
        if ignore_index == Some(t) {
            dr.fill(T::zero());
            return;
        }
        for (d, &x) in dr.iter_mut().zip(xr) {
            *d = dl * exp(x - l);
        }
        if let Some(j) = local_target(t, vocab_start, vocab_local, ignore_index) {
            dr[j] = dl * (exp(xr[j] - l) - T::one());
        }
    };
    if logits.len() < PAR_MIN_ELEMS {
        for ((((xr, dr), &t), &l), &dl) in logits.chunks(vocab_local).zip(dlogits.chunks_mut(vocab_local)).zip(targets).zip(lse).zip(dloss) {
            one(xr, dr, t, l, dl);
        }
    } else {
        logits
            .par_chunks(vocab_local)
            .zip(dlogits.par_chunks_mut(vocab_local))
            .zip(targets.par_iter())
            .zip(lse.par_iter())
            .zip(dloss.par_iter())
            .with_min_len(rows_per_task(vocab_local))
            .for_each(|((((xr, dr), &t), &l), &dl)| one(xr, dr, t, l, dl));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{assert_close, dot, numeric_grad, rand_vec};

    fn losses_of(logits: &[f64], vocab: usize, targets: &[u32], ignore: Option<u32>) -> Vec<f64> {
        let n = targets.len();
        let (mut loss, mut lse) = (vec![f64::NAN; n], vec![f64::NAN; n]);
        cross_entropy_forward(logits, vocab, targets, ignore, &mut loss, &mut lse);
        loss
    }

    #[test]
    fn forward_matches_naive_reference() {
        for &(n, vocab) in &[(1usize, 1usize), (3, 17), (5, 129), (2, 1000)] {
            let logits: Vec<f64> = rand_vec(n as u64, n * vocab).iter().map(|v| 8.0 * v).collect();
            let targets: Vec<u32> = (0..n as u32).map(|r| (r * 7 + 1) % vocab as u32).collect();
            let (mut loss, mut lse) = (vec![0.0; n], vec![0.0; n]);
            let count = cross_entropy_forward(&logits, vocab, &targets, None, &mut loss, &mut lse);
            assert_eq!(count, n);
            for r in 0..n {
                let row = &logits[r * vocab..(r + 1) * vocab];
                let naive = row.iter().map(|x| x.exp()).sum::<f64>().ln();
                assert!((lse[r] - naive).abs() < 1e-12 * naive.abs().max(1.0), "lse {} vs {naive}", lse[r]);
                let want = naive - row[targets[r] as usize];
                assert!((loss[r] - want).abs() < 1e-12 * want.abs().max(1.0), "loss {} vs {want}", loss[r]);
            }
        }
        // Uniform logits: loss = ln(vocab).
        let (mut loss, mut lse) = ([0f32; 1], [0f32; 1]);
        cross_entropy_forward(&[0.25f32; 50], 50, &[3], None, &mut loss, &mut lse);
        assert!((loss[0] - 50f32.ln()).abs() < 1e-6);
    }

    #[test]
    fn huge_logits_stay_finite() {
        let vocab = 700;
        let base: Vec<f64> = rand_vec(7, vocab).iter().map(|v| 3.0 * v).collect();
        let shifted: Vec<f32> = base.iter().map(|v| (v + 1.0e4) as f32).collect();
        let neg: Vec<f32> = base.iter().map(|v| (v - 1.0e4) as f32).collect();
        let (mut l0, mut s0) = ([0.0; 1], [0.0; 1]);
        cross_entropy_forward(&base, vocab, &[5], None, &mut l0, &mut s0);
        for logits in [&shifted, &neg] {
            let (mut l, mut s) = ([0f32; 1], [0f32; 1]);
            cross_entropy_forward(logits, vocab, &[5], None, &mut l, &mut s);
            assert!(l[0].is_finite() && s[0].is_finite());
            // Shift invariance, up to the rounding of the shifted logits themselves (ulp(1e4) ≈ 1e-3).
            assert!((l[0] as f64 - l0[0]).abs() < 2e-3, "loss {} vs {}", l[0], l0[0]);
            let mut d = vec![0f32; vocab];
            cross_entropy_backward(logits, &s, vocab, &[5], None, &[1.0], &mut d);
            assert!(d.iter().all(|v| v.is_finite()));
            // A row's gradient sums to zero, up to the f32 rounding of lse ≈ ±1e4
            // (half an ulp, 5e-4, scales every probability by exp(±5e-4)).
            let sum: f32 = d.iter().sum();
            assert!(sum.abs() < 1e-3, "gradient of a row sums to zero, got {sum}");
        }
    }

    #[test]
    fn backward_matches_finite_differences_with_ignored_rows() {
        const IGN: u32 = u32::MAX;
        for (k, &(n, vocab)) in [(1usize, 1usize), (3, 17), (6, 5), (2, 129)].iter().enumerate() {
            let logits: Vec<f64> = rand_vec(30 + k as u64, n * vocab).iter().map(|v| 4.0 * v).collect();
            let targets: Vec<u32> = (0..n as u32).map(|r| if r % 3 == 1 { IGN } else { (r * 5 + 2) % vocab as u32 }).collect();
            let dloss = rand_vec(40 + k as u64, n);
            let (mut loss, mut lse) = (vec![0.0; n], vec![0.0; n]);
            let count = cross_entropy_forward(&logits, vocab, &targets, Some(IGN), &mut loss, &mut lse);
            assert_eq!(count, targets.iter().filter(|&&t| t != IGN).count());
            let mut d = vec![f64::NAN; n * vocab];
            cross_entropy_backward(&logits, &lse, vocab, &targets, Some(IGN), &dloss, &mut d);
            let num = numeric_grad(|x| dot(&losses_of(x, vocab, &targets, Some(IGN)), &dloss), &logits, 1e-6);
            assert_close(&d, &num, 1e-8, 1e-7, &format!("cross-entropy n={n} vocab={vocab}"));
            for r in 0..n {
                if targets[r] == IGN {
                    assert_eq!(loss[r], 0.0);
                    assert!(d[r * vocab..(r + 1) * vocab].iter().all(|&v| v == 0.0));
                }
            }
        }
    }

    #[test]
    fn f32_matches_f64_and_is_thread_count_independent() {
        let (n, vocab) = (8, 50_257);
        let logits: Vec<f64> = rand_vec(9, n * vocab).iter().map(|v| 6.0 * v).collect();
        let targets: Vec<u32> = vec![0, 50_256, 17, 0, 25_000, 3, 99, 42];
        let dloss = vec![0.125; n];
        let (mut loss, mut lse) = (vec![0.0; n], vec![0.0; n]);
        cross_entropy_forward(&logits, vocab, &targets, Some(3), &mut loss, &mut lse);
        let mut d = vec![0.0; n * vocab];
        cross_entropy_backward(&logits, &lse, vocab, &targets, Some(3), &dloss, &mut d);

        let l32: Vec<f32> = logits.iter().map(|&v| v as f32).collect();
        let dl32 = vec![0.125f32; n];
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let (mut loss, mut lse) = (vec![0f32; n], vec![0f32; n]);
                let c = cross_entropy_forward(&l32, vocab, &targets, Some(3), &mut loss, &mut lse);
                let mut d = vec![0f32; n * vocab];
                cross_entropy_backward(&l32, &lse, vocab, &targets, Some(3), &dl32, &mut d);
                (c, loss, d)
            })
        };
        let (a, b) = (run(1), run(2));
        assert_eq!(a.0, 7);
        assert_eq!((&a.1, &a.2), (&b.1, &b.2));
        let up = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
        assert_close(&up(&a.1), &loss, 1e-5, 1e-5, "cross-entropy loss f32");
        assert_close(&up(&a.2), &d, 1e-8, 1e-4, "cross-entropy dlogits f32");
    }

    #[test]
    fn vocabulary_shards_combine_to_the_whole() {
        let (n, vocab, shards) = (5usize, 12usize, 3usize);
        let part = vocab / shards;
        let logits: Vec<f64> = rand_vec(31, n * vocab).iter().map(|v| 6.0 * v).collect();
        let targets: Vec<u32> = vec![0, 11, 4, 7, 99];
        let ignore = Some(99);
        let (mut loss, mut lse) = (vec![0.0; n], vec![0.0; n]);
        cross_entropy_forward(&logits, vocab, &targets, ignore, &mut loss, &mut lse);
        let mut lses = vec![vec![0.0; n]; shards];
        let mut tls = vec![vec![0.0; n]; shards];
        let shard_of = |s: usize| -> Vec<f64> { logits.chunks(vocab).flat_map(|r| r[s * part..(s + 1) * part].to_vec()).collect() };
        for s in 0..shards {
            vocab_shard_stats(&shard_of(s), part, (s * part) as u32, &targets, ignore, &mut lses[s], &mut tls[s]);
        }
        let dloss: Vec<f64> = rand_vec(32, n);
        let mut full = vec![0.0; n * vocab];
        cross_entropy_backward(&logits, &lse, vocab, &targets, ignore, &dloss, &mut full);
        for r in 0..n {
            let global = lses.iter().map(|l| l[r].exp()).sum::<f64>().ln();
            let target: f64 = tls.iter().map(|t| t[r]).sum();
            if targets[r] == 99 {
                assert_eq!(loss[r], 0.0);
                continue;
            }
            assert_close(&[global], &[lse[r]], 1e-12, 1e-12, "combined lse");
            assert_close(&[global - target], &[loss[r]], 1e-12, 1e-12, "combined loss");
        }
        for s in 0..shards {
            let mut d = vec![0.0; n * part];
            vocab_shard_backward(&shard_of(s), &lse, part, (s * part) as u32, &targets, ignore, &dloss, &mut d);
            let expect: Vec<f64> = full.chunks(vocab).flat_map(|r| r[s * part..(s + 1) * part].to_vec()).collect();
            assert_close(&d, &expect, 1e-14, 1e-12, "shard gradient");
        }
    }
}
