//! Ranking tokens and cutting the unlikely tail: top-k, top-p and min-p.
//!
//! Every filter keeps a prefix of one ranking (most likely first, ties to the
//! lowest token id), so filtering is finding where that prefix ends, and the
//! result does not depend on the order ties happen to be stored in.

use std::cmp::Ordering;

/// The ids of the `limit` highest-scoring tokens whose score is not -inf,
/// highest first, ties to the lowest id, written to `out`. With a limit, only
/// the kept tokens are sorted, so top-k costs O(vocab + k log k).
pub(crate) fn rank(scores: &[f64], limit: usize, out: &mut Vec<u32>) {
    out.clear();
    out.extend((0..scores.len()).filter(|&i| scores[i] > f64::NEG_INFINITY).map(|i| i as u32));
    // partial_cmp, not total_cmp: -0.0 and 0.0 are the same score and must tie.
    let order = |a: &u32, b: &u32| scores[*b as usize].partial_cmp(&scores[*a as usize]).unwrap_or(Ordering::Equal).then(a.cmp(b));
    if limit == 0 {
        out.clear();
        return;
    }
    if limit < out.len() {
        out.select_nth_unstable_by(limit - 1, order);
        out.truncate(limit);
    }
    out.sort_unstable_by(order);
}

/// Cuts `ranked` (tokens with their probabilities, most likely first, already
/// cut to the top k) by top-p and then min-p, in Hugging Face's order, and
/// renormalises what is left to sum to 1.
///
/// Top-p keeps each token whose more likely neighbours hold less than `top_p`
/// of the mass, which is the smallest prefix holding at least `top_p`. Min-p
/// keeps the tokens at least `min_p` times as likely as the most likely one; as
/// a ratio it does not care whether top-p renormalised first.
pub(crate) fn truncate(ranked: &mut Vec<(u32, f64)>, top_p: f32, min_p: f32) {
    let mass: f64 = ranked.iter().map(|&(_, p)| p).sum();
    let mut keep = ranked.len();
    if top_p < 1.0 {
        let target = f64::from(top_p) * mass;
        let mut before = 0.0;
        keep = 0;
        for &(_, p) in ranked.iter() {
            if before >= target {
                break;
            }
            before += p;
            keep += 1;
        }
    }
    if min_p > 0.0 {
        let threshold = f64::from(min_p) * ranked.first().map_or(0.0, |&(_, p)| p);
        keep = keep.min(ranked.iter().take_while(|&&(_, p)| p >= threshold).count());
    }
    // The most likely token always survives, whatever rounding did.
    ranked.truncate(keep.max(1));
    let kept_mass: f64 = ranked.iter().map(|&(_, p)| p).sum();
    for (_, p) in ranked.iter_mut() {
        *p /= kept_mass;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_data::Gen;

    #[test]
    fn rank_with_a_limit_is_the_prefix_of_the_full_ranking() {
        let mut g = Gen::new(3);
        for _ in 0..300 {
            let vocab = 1 + g.below(40);
            let scores: Vec<f64> = g.logits(vocab).iter().map(|&l| f64::from(l)).collect();
            let mut full = Vec::new();
            rank(&scores, usize::MAX, &mut full);
            // The full ranking, by a plain comparison sort of (score desc, id asc).
            let mut want: Vec<u32> = (0..vocab as u32).filter(|&t| scores[t as usize] > f64::NEG_INFINITY).collect();
            want.sort_by(|&a, &b| scores[b as usize].partial_cmp(&scores[a as usize]).unwrap().then(a.cmp(&b)));
            assert_eq!(full, want);
            let limit = g.below(vocab + 2);
            let mut part = Vec::new();
            rank(&scores, limit, &mut part);
            assert_eq!(part, want[..limit.min(want.len())]);
        }
    }
}
