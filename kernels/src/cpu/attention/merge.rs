//! Merging two partial attentions of the same queries over disjoint key sets.
//!
//! Attention over keys `K₁ ∪ K₂` is the two partial attentions weighted by
//! their share of the softmax's denominator: with `l = log(e^{l₁} + e^{l₂})`,
//! `out = e^{l₁ − l}·out₁ + e^{l₂ − l}·out₂`. Ring attention computes a
//! query block against one key/value block at a time and folds each result
//! in with this; the log-sum-exp it leaves is the one the backward needs.

use crate::Real;
use rayon::prelude::*;

/// Folds the partial attention `(out_b, lse_b)` into `(out, lse)` in place:
/// `out` and `out_b` hold `lse.len()` rows of `head_dim` values, the rows of
/// `lse` and `lse_b` their log-sum-exps. A row whose partial saw no key
/// (`lse_b = −∞`) is left as it was; one that had none before takes the
/// partial's.
pub fn attention_merge<T: Real>(head_dim: usize, out: &mut [T], lse: &mut [T], out_b: &[T], lse_b: &[T]) {
    assert_eq!(out.len(), lse.len() * head_dim, "attention_merge: out length");
    assert_eq!(out_b.len(), out.len(), "attention_merge: out_b length");
    assert_eq!(lse_b.len(), lse.len(), "attention_merge: lse_b length");
    if head_dim == 0 {
        return;
    }
    let rows = out.par_chunks_mut(head_dim).zip(lse.par_iter_mut()).zip(out_b.par_chunks(head_dim).zip(lse_b.par_iter()));
    rows.with_min_len(64).for_each(|((o, l), (ob, &lb))| {
        let la = *l;
        if lb == T::neg_infinity() {
            return;
        }
        let m = la.max(lb);
        let (wa, wb) = ((la - m).exp(), (lb - m).exp());
        let total = m + (wa + wb).ln();
        let (wa, wb) = (wa / (wa + wb), wb / (wa + wb));
        for (x, &y) in o.iter_mut().zip(ob) {
            *x = wa * *x + wb * y;
        }
        *l = total;
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::attention::{attention_forward, AttnDims};

    fn lcg(seed: u64, n: usize) -> Vec<f64> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
            })
            .collect()
    }

    /// Attention over all keys equals the merge of attentions over a split
    /// of them, at every split point.
    #[test]
    fn merging_two_halves_of_the_keys_is_attention_over_all_of_them() {
        let (b, hq, hkv, tq, tk, d) = (2, 4, 2, 5, 9, 3);
        let dims = |seq_kv| AttnDims { batch: b, q_heads: hq, kv_heads: hkv, seq_q: tq, seq_kv, head_dim: d, causal: false, scale: 0.7 };
        let q = lcg(1, b * hq * tq * d);
        let (k, v) = (lcg(2, b * hkv * tk * d), lcg(3, b * hkv * tk * d));
        let mut out = vec![0.0; q.len()];
        let mut lse = vec![0.0; b * hq * tq];
        attention_forward(&dims(tk), &q, &k, &v, &mut out, &mut lse);
        // [b, h, t, d] keys: split each head's rows at `cut`.
        let part = |x: &[f64], from: usize, to: usize| -> Vec<f64> { x.chunks(tk * d).flat_map(|h| h[from * d..to * d].to_vec()).collect() };
        for cut in 1..tk {
            let mut o1 = vec![0.0; q.len()];
            let mut l1 = vec![0.0; lse.len()];
            attention_forward(&dims(cut), &q, &part(&k, 0, cut), &part(&v, 0, cut), &mut o1, &mut l1);
            let mut o2 = vec![0.0; q.len()];
            let mut l2 = vec![0.0; lse.len()];
            attention_forward(&dims(tk - cut), &q, &part(&k, cut, tk), &part(&v, cut, tk), &mut o2, &mut l2);
            attention_merge(d, &mut o2, &mut l2, &o1, &l1);
            for (x, y) in o2.iter().zip(&out).chain(l2.iter().zip(&lse)) {
                assert!((x - y).abs() < 1e-12, "cut {cut}: {x} vs {y}");
            }
        }
    }

    #[test]
    fn a_partial_that_saw_no_key_changes_nothing_and_an_empty_row_takes_the_partial() {
        let mut out = vec![1.0f32, 2.0, 3.0, 4.0];
        let mut lse = vec![0.5f32, f32::NEG_INFINITY];
        attention_merge(2, &mut out, &mut lse, &[9.0, 9.0, 7.0, 8.0], &[f32::NEG_INFINITY, 1.5]);
        assert_eq!(out, vec![1.0, 2.0, 7.0, 8.0]);
        assert_eq!(lse, vec![0.5, 1.5]);
    }
}
