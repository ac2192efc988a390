//! Host-side routing decisions: which token slots each expert keeps under a
//! capacity, what is dropped, and the load-balancing loss.

/// What one forward of a [`Moe`](super::Moe) routed, on this rank: the
/// router's choices, the slots dropped by the capacity, and the
/// load-balancing loss. Counts are over this rank's own tokens, except
/// [`received`](Self::received), which counts the rows this rank's experts
/// processed for every rank of the expert-parallel group.
///
/// A *slot* is one (token, choice) pair: each token fills `top_k` slots.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeStats {
    /// Tokens this rank routed (rows of its input).
    pub tokens: usize,
    /// Slots each expert accepts from this rank's tokens, or `None` when the
    /// capacity is unlimited (see [`Moe::with_capacity_factor`](super::Moe::with_capacity_factor)).
    pub capacity: Option<usize>,
    /// Per expert (global index): slots the router chose it for, before the capacity.
    pub routed: Vec<usize>,
    /// Per expert (global index): slots beyond its capacity, dropped.
    pub dropped: Vec<usize>,
    /// Per local expert of this rank (in the order of
    /// [`Moe::local_experts`](super::Moe::local_experts)): rows it processed,
    /// from all ranks of the expert-parallel group.
    pub received: Vec<usize>,
    /// The load-balancing loss `E · Σ_e f_e · P_e` of this rank's tokens,
    /// before the coefficient (see [`Moe::with_aux_loss`](super::Moe::with_aux_loss)).
    pub aux_loss: f64,
    /// The coefficient the backward applied to [`aux_loss`](Self::aux_loss)
    /// (0 when the loss only is reported, not trained on).
    pub aux_coef: f64,
}

impl MoeStats {
    /// Slots the router filled (`tokens · top_k`).
    pub fn slots(&self) -> usize {
        self.routed.iter().sum()
    }

    /// Slots dropped by the capacity, over all experts.
    pub fn dropped_total(&self) -> usize {
        self.dropped.iter().sum()
    }

    /// The fraction of slots dropped (0 when none were routed).
    pub fn drop_fraction(&self) -> f64 {
        let slots = self.slots();
        if slots == 0 {
            0.0
        } else {
            self.dropped_total() as f64 / slots as f64
        }
    }

    /// What the load-balancing loss adds to the training loss: `aux_coef · aux_loss`.
    pub fn aux_contribution(&self) -> f64 {
        self.aux_coef * self.aux_loss
    }
}

/// The slots each expert keeps, and how many it was routed and dropped.
pub(super) struct Routing {
    /// Per expert (global index): its kept slots, in priority order.
    pub kept: Vec<Vec<u32>>,
    pub routed: Vec<usize>,
    pub dropped: Vec<usize>,
}

/// `ceil(factor · tokens · top_k / experts)`: the slots one expert accepts
/// from `tokens` tokens.
pub(super) fn capacity(factor: f64, tokens: usize, top_k: usize, experts: usize) -> usize {
    (factor * (tokens * top_k) as f64 / experts as f64).ceil() as usize
}

/// Assigns each slot of `chosen` (`[tokens, top_k]` row-major, expert
/// indices) to its expert, keeping at most `capacity` per expert.
///
/// Priority: every token's first choice comes before any token's second
/// choice, and so on; within one choice rank, earlier tokens come first. So
/// a token loses its best expert only when that expert is full of other
/// tokens' best choices.
pub(super) fn route(chosen: &[u32], top_k: usize, experts: usize, capacity: Option<usize>) -> Routing {
    let tokens = chosen.len() / top_k;
    let mut kept = vec![Vec::new(); experts];
    let mut routed = vec![0; experts];
    let mut dropped = vec![0; experts];
    for choice in 0..top_k {
        for token in 0..tokens {
            let slot = token * top_k + choice;
            let e = chosen[slot] as usize;
            routed[e] += 1;
            if capacity.is_some_and(|c| kept[e].len() >= c) {
                dropped[e] += 1;
            } else {
                kept[e].push(slot as u32);
            }
        }
    }
    Routing { kept, routed, dropped }
}

/// The load-balancing loss of `tokens` tokens: `E · Σ_e f_e · P_e`, with
/// `f_e = routed[e] / (tokens · top_k)` and `P_e` the mean over tokens of
/// `probs[t, e]` (`[tokens, E]` row-major, the softmax over all `E` logits).
pub(super) fn aux_loss(probs: &[f64], routed: &[usize], tokens: usize) -> f64 {
    let experts = routed.len();
    let slots: usize = routed.iter().sum();
    let mut mean_p = vec![0.0; experts];
    for row in probs.chunks(experts) {
        for (m, p) in mean_p.iter_mut().zip(row) {
            *m += p;
        }
    }
    let e = experts as f64;
    routed.iter().zip(&mean_p).map(|(&r, &p)| (r as f64 / slots as f64) * (p / tokens as f64)).sum::<f64>() * e
}

/// `d(coef · aux) / d probs[t, e] = coef · E · f_e / tokens`, the same for
/// every token (`f_e` is piecewise constant): one row of `E` values.
pub(super) fn aux_grad_row(coef: f64, routed: &[usize], tokens: usize) -> Vec<f64> {
    let e = routed.len() as f64;
    let slots: usize = routed.iter().sum();
    routed.iter().map(|&r| coef * e * (r as f64 / slots as f64) / tokens as f64).collect()
}
