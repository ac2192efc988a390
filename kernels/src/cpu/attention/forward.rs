//! Forward pass: one task per (batch, query head, query block), streaming key
//! and value blocks through an online softmax.

use super::exp::exp_minus;
use super::layout::{Layout, SharedOut};
use super::tile::{matmul_tile, max_of, sum_of, transpose_scaled};
use super::{AttnDims, BLOCK_KV, BLOCK_Q, PARALLEL_MIN_WORK};
use crate::cpu::mixed::Stored;
use crate::Real;
use rayon::prelude::*;

/// Per-thread working set, `O(BLOCK_Q·BLOCK_KV + (BLOCK_Q + BLOCK_KV)·head_dim)`.
struct Scratch<T> {
    /// Scaled query block, `[BLOCK_Q, head_dim]`.
    qs: Vec<T>,
    /// Transposed key block, `[head_dim, BLOCK_KV]`.
    kt: Vec<T>,
    /// Value block, `[BLOCK_KV, head_dim]`, when the values are not contiguous.
    vb: Vec<T>,
    /// Scores, then unnormalised probabilities, `[BLOCK_Q, BLOCK_KV]`.
    s: Vec<T>,
    /// Unnormalised output, `[BLOCK_Q, head_dim]`.
    acc: Vec<T>,
    /// Running maximum and running sum of exponentials per query.
    m: Vec<T>,
    l: Vec<T>,
}

impl<T: Real> Scratch<T> {
    fn new(hd: usize) -> Self {
        Self {
            qs: vec![T::zero(); BLOCK_Q * hd],
            kt: vec![T::zero(); hd * BLOCK_KV],
            vb: vec![T::zero(); BLOCK_KV * hd],
            s: vec![T::zero(); BLOCK_Q * BLOCK_KV],
            acc: vec![T::zero(); BLOCK_Q * hd],
            m: vec![T::zero(); BLOCK_Q],
            l: vec![T::zero(); BLOCK_Q],
        }
    }
}

/// Fused attention forward on separate per-head tensors (see [`AttnDims`]
/// for layouts and masking).
///
/// Overwrites `out` (`[batch, q_heads, seq_q, head_dim]`) with the attention
/// output and `lse` (`[batch, q_heads, seq_q]`) with each query's log-sum-exp
/// of scaled, masked scores, which [`attention_backward`](super::attention_backward)
/// needs. A query that sees no key (causal with `seq_q > seq_kv`) gets a zero
/// output and `lse = -inf`. Every query row is computed by one task in a fixed
/// order, so results do not depend on the thread count.
pub fn attention_forward<T: Real, S: Stored<T>>(d: &AttnDims, q: &[S], k: &[S], v: &[S], out: &mut [S], lse: &mut [T]) {
    d.check();
    assert_eq!(q.len(), d.q_len(), "attention_forward: q length");
    assert_eq!(k.len(), d.kv_len(), "attention_forward: k length");
    assert_eq!(v.len(), d.kv_len(), "attention_forward: v length");
    assert_eq!(out.len(), d.q_len(), "attention_forward: out length");
    forward(d, &Layout::heads(d), q, k, v, out, lse);
}

/// [`attention_forward`] on the fused projection of self-attention: `qkv` is
/// `[batch, seq, kv_heads, q_heads / kv_heads + 2, head_dim]` (per kv head,
/// its query heads, its key, its value) and `out` is
/// `[batch, seq, q_heads, head_dim]`, so neither side needs a copy into
/// per-head tensors. Needs `seq_q == seq_kv`; results are bit-identical to
/// [`attention_forward`] on the same values.
///
/// Both accept operands stored as bf16 while computing in f32 (`S = bf16`,
/// `T = f32`): rows are widened as the blocks gather them and output rows
/// rounded as they are written, the same bits as the f32 kernel on the
/// widened operands with its output rounded, without the widened copies.
pub fn attention_forward_packed<T: Real, S: Stored<T>>(d: &AttnDims, qkv: &[S], out: &mut [S], lse: &mut [T]) {
    d.check();
    assert_eq!(d.seq_q, d.seq_kv, "attention_forward_packed: self-attention needs seq_q == seq_kv");
    assert_eq!(qkv.len(), d.packed_len(), "attention_forward_packed: qkv length");
    assert_eq!(out.len(), d.q_len(), "attention_forward_packed: out length");
    forward(d, &Layout::packed(d), qkv, qkv, qkv, out, lse);
}

fn forward<T: Real, S: Stored<T>>(d: &AttnDims, lay: &Layout, q: &[S], k: &[S], v: &[S], out: &mut [S], lse: &mut [T]) {
    assert_eq!(lse.len(), d.lse_len(), "attention_forward: lse length");
    if d.lse_len() == 0 {
        return;
    }
    let hd = d.head_dim;
    let io = Io { d, lay, q, k, v, out: SharedOut::new(out) };
    let tasks: Vec<_> =
        lse.chunks_mut(d.seq_q).enumerate().flat_map(|(bh, l)| l.chunks_mut(BLOCK_Q).enumerate().map(move |(qb, l)| (bh, qb * BLOCK_Q, l))).collect();
    let run = |s: &mut Scratch<T>, (bh, i0, l): (usize, usize, &mut [T])| {
        let (b, h) = (bh / d.q_heads, bh % d.q_heads);
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the running CPU supports AVX-512F (just checked).
            return unsafe { forward_block_avx512(&io, b, h, i0, l, s) };
        }
        forward_block(&io, b, h, i0, l, s)
    };
    if d.work() < PARALLEL_MIN_WORK {
        let mut s = Scratch::new(hd);
        tasks.into_iter().for_each(|t| run(&mut s, t));
    } else {
        tasks.into_par_iter().for_each_init(|| Scratch::new(hd), run);
    }
}

/// What every forward task reads, and the output it writes its rows of.
struct Io<'a, S> {
    d: &'a AttnDims,
    lay: &'a Layout,
    q: &'a [S],
    k: &'a [S],
    v: &'a [S],
    out: SharedOut<S>,
}

/// [`forward_block`] compiled for AVX-512: the softmax's `exp`, max and sum
/// loops between the tile products run sixteen lanes wide instead of the
/// baseline's four. No multiply-adds are contracted, so the bits are the
/// same as the baseline copy's.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn forward_block_avx512<T: Real, S: Stored<T>>(io: &Io<'_, S>, b: usize, h: usize, i0: usize, lse: &mut [T], s: &mut Scratch<T>) {
    forward_block(io, b, h, i0, lse, s)
}

/// Output rows `i0..i0 + lse.len()` of query head `h` in batch `b`.
#[inline(always)]
fn forward_block<T: Real, S: Stored<T>>(io: &Io<'_, S>, b: usize, h: usize, i0: usize, lse: &mut [T], s: &mut Scratch<T>) {
    let Io { d, lay, q, k, v, out } = *io;
    let hd = d.head_dim;
    let bq = lse.len();
    let g = h / d.group();
    let scale = T::lit(d.scale);
    for (r, dst) in s.qs[..bq * hd].chunks_exact_mut(hd).enumerate() {
        let row = lay.q.at(d.group(), b, h, i0 + r);
        for (dst, &x) in dst.iter_mut().zip(&q[row..row + hd]) {
            *dst = x.load() * scale;
        }
    }
    s.m[..bq].fill(T::neg_infinity());
    s.l[..bq].fill(T::zero());
    s.acc[..bq * hd].fill(T::zero());

    // Keys past what the block's last query sees are masked for all of it.
    let kend = d.key_end(i0 + bq - 1);
    for j0 in (0..kend).step_by(BLOCK_KV) {
        let bk = BLOCK_KV.min(kend - j0);
        let k_blk = &k[lay.k.at(1, b, g, j0)..];
        let v_blk = &v[lay.v.at(1, b, g, j0)..];
        transpose_scaled(k_blk, bk, hd, lay.k.row(), T::one(), &mut s.kt);
        let st = &mut s.s[..bq * bk];
        matmul_tile(bq, bk, hd, &s.qs, hd, &s.kt, bk, st, bk, false);
        let needs_mask = d.causal && d.key_end(i0) < j0 + bk;
        for (r, row) in st.chunks_exact_mut(bk).enumerate() {
            if needs_mask {
                let visible = d.key_end(i0 + r).saturating_sub(j0).min(bk);
                row[visible..].fill(T::neg_infinity());
            }
            let row_max = max_of(row);
            let m_new = s.m[r].max(row_max);
            if m_new == T::neg_infinity() {
                // Nothing visible to this query yet: contribute nothing
                // (and avoid exp(-inf - -inf) = NaN).
                row.fill(T::zero());
                continue;
            }
            exp_minus(row, m_new);
            let sum = sum_of(row);
            // First visible block: m = -inf, alpha = 0, and acc/l are zero anyway.
            let alpha = (s.m[r] - m_new).exp();
            if alpha != T::one() {
                for a in &mut s.acc[r * hd..(r + 1) * hd] {
                    *a *= alpha;
                }
            }
            s.l[r] = s.l[r] * alpha + sum;
            s.m[r] = m_new;
        }
        // A fused layout's value rows lie a whole position apart; the
        // product re-reads each row, so it gets them back to back (widened,
        // when they are stored in another type).
        let (v_blk, v_ld) = match S::as_compute(v_blk) {
            Some(v_blk) if lay.v.row() == hd => (v_blk, hd),
            _ => {
                for (t, dst) in s.vb[..bk * hd].chunks_exact_mut(hd).enumerate() {
                    for (dst, &x) in dst.iter_mut().zip(&v_blk[t * lay.v.row()..t * lay.v.row() + hd]) {
                        *dst = x.load();
                    }
                }
                (&s.vb[..], hd)
            }
        };
        matmul_tile(bq, hd, bk, st, bk, v_blk, v_ld, &mut s.acc, hd, true);
    }

    for (r, (o, l)) in s.acc[..bq * hd].chunks_exact_mut(hd).zip(lse.iter_mut()).enumerate() {
        let sum = s.l[r];
        if sum == T::zero() {
            o.fill(T::zero());
            *l = T::neg_infinity();
        } else {
            let inv = T::one() / sum;
            for a in o.iter_mut() {
                *a *= inv;
            }
            *l = s.m[r] + sum.ln();
        }
        // SAFETY: this task is the only one computing query `i0 + r` of head
        // `h` in batch `b`, whose row no other row of the layout overlaps;
        // `out` stays borrowed by `forward` until every task has returned.
        unsafe { out.write_stored(lay.o.at(d.group(), b, h, i0 + r), o) };
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_inputs::{dims, qkv, to_f32, to_f64};
    use super::super::{attention_reference_forward, AttnDims};
    use super::*;
    use crate::testing::assert_close;

    fn check_against_reference(d: &AttnDims, seed: u64) {
        let (q, k, v) = qkv(d, seed);
        let mut want = vec![0.0; d.q_len()];
        attention_reference_forward(d, &q, &k, &v, &mut want);

        let mut out = vec![f64::NAN; d.q_len()];
        let mut lse = vec![f64::NAN; d.lse_len()];
        attention_forward(d, &q, &k, &v, &mut out, &mut lse);
        assert_close(&out, &want, 1e-12, 1e-11, &format!("f64 forward {d:?}"));

        // lse against its definition.
        let hd = d.head_dim;
        for b in 0..d.batch {
            for h in 0..d.q_heads {
                let kv_base = (b * d.kv_heads + h / (d.q_heads / d.kv_heads)) * d.seq_kv * hd;
                for i in 0..d.seq_q {
                    let row = (b * d.q_heads + h) * d.seq_q + i;
                    let scores: Vec<f64> =
                        (0..d.key_end(i)).map(|j| d.scale * (0..hd).map(|e| q[row * hd + e] * k[kv_base + j * hd + e]).sum::<f64>()).collect();
                    let want = scores.iter().map(|s| s.exp()).sum::<f64>().ln();
                    if scores.is_empty() {
                        assert_eq!(lse[row], f64::NEG_INFINITY);
                    } else {
                        assert!((lse[row] - want).abs() < 1e-11, "lse {row}: {} vs {want}", lse[row]);
                    }
                }
            }
        }

        let (qf, kf, vf) = (to_f32(&q), to_f32(&k), to_f32(&v));
        let mut outf = vec![f32::NAN; d.q_len()];
        let mut lsef = vec![f32::NAN; d.lse_len()];
        attention_forward(d, &qf, &kf, &vf, &mut outf, &mut lsef);
        assert_close(&to_f64(&outf), &want, 2e-5, 1e-4, &format!("f32 forward {d:?}"));
        let finite = |x: &[f64]| x.iter().map(|&e| if e.is_finite() { e } else { 0.0 }).collect::<Vec<_>>();
        assert_close(&finite(&to_f64(&lsef)), &finite(&lse), 1e-4, 1e-5, "f32 lse");
    }

    #[test]
    fn matches_reference_across_shapes_masks_and_groupings() {
        let mut seed = 10;
        for causal in [false, true] {
            for &(batch, q_heads, kv_heads) in &[(1, 1, 1), (3, 2, 1), (1, 4, 1), (2, 4, 2), (1, 3, 3)] {
                for &(seq_q, seq_kv) in &[(1, 1), (3, 3), (17, 17), (1, 17), (3, 17), (17, 129), (129, 129)] {
                    for &hd in &[1, 3, 16] {
                        // Keep the largest combinations to a few heads.
                        if seq_kv == 129 && batch * q_heads > 4 {
                            continue;
                        }
                        check_against_reference(&dims(batch, q_heads, kv_heads, seq_q, seq_kv, hd, causal), seed);
                        seed += 3;
                    }
                }
            }
        }
    }

    #[test]
    fn queries_that_see_no_key_get_zeros() {
        // Five queries, two keys: with the KV-cache alignment queries 0..3 see nothing.
        let d = dims(2, 2, 1, 5, 2, 3, true);
        check_against_reference(&d, 99);
        let (q, k, v) = qkv(&d, 99);
        let mut out = vec![f64::NAN; d.q_len()];
        let mut lse = vec![f64::NAN; d.lse_len()];
        attention_forward(&d, &q, &k, &v, &mut out, &mut lse);
        assert!(out[..3 * 3].iter().all(|&x| x == 0.0));
        assert!(out[3 * 3..5 * 3].iter().all(|&x| x != 0.0 && x.is_finite()));
        // No key at all.
        let d = dims(1, 1, 1, 4, 0, 2, false);
        let mut out = vec![f32::NAN; d.q_len()];
        let mut lse = vec![0f32; d.lse_len()];
        attention_forward(&d, &[1.0; 8], &[], &[], &mut out, &mut lse);
        assert!(out.iter().all(|&x| x == 0.0) && lse.iter().all(|&x| x == f32::NEG_INFINITY));
    }

    #[test]
    fn huge_scores_stay_finite() {
        // Scores in the hundreds overflow exp() without the running max.
        let d = dims(1, 2, 1, 130, 130, 16, true);
        let (q, k, v) = qkv(&d, 5);
        let q: Vec<f64> = q.iter().map(|x| x * 100.0).collect();
        let mut want = vec![0.0; d.q_len()];
        attention_reference_forward(&d, &q, &k, &v, &mut want);
        let (qf, kf, vf) = (to_f32(&q), to_f32(&k), to_f32(&v));
        let mut out = vec![0f32; d.q_len()];
        let mut lse = vec![0f32; d.lse_len()];
        attention_forward(&d, &qf, &kf, &vf, &mut out, &mut lse);
        assert!(out.iter().chain(&lse).all(|x| x.is_finite()));
        // exp() overflows f32 above ~88.
        assert!(lse.iter().any(|&x| x > 200.0), "scores were not large");
        assert_close(&to_f64(&out), &want, 1e-3, 1e-3, "huge scores f32");
    }

    #[test]
    fn bit_identical_across_runs_and_thread_counts() {
        // Large enough to take the parallel path.
        let d = dims(2, 4, 2, 200, 200, 32, true);
        assert!(d.work() >= PARALLEL_MIN_WORK);
        let (q, k, v) = qkv(&d, 3);
        let (q, k, v) = (to_f32(&q), to_f32(&k), to_f32(&v));
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let mut out = vec![0f32; d.q_len()];
                let mut lse = vec![0f32; d.lse_len()];
                attention_forward(&d, &q, &k, &v, &mut out, &mut lse);
                (out, lse)
            })
        };
        let one = run(1);
        for threads in [2, 3, 1] {
            let other = run(threads);
            assert!(
                one.0.iter().zip(&other.0).all(|(a, b)| a.to_bits() == b.to_bits()) && one.1.iter().zip(&other.1).all(|(a, b)| a.to_bits() == b.to_bits()),
                "forward differs with {threads} threads"
            );
        }
    }
}
