//! Iteration-level scheduling: which requests run in the next step, and how
//! many of their tokens.
//!
//! The policy (vLLM's, with chunked prefill):
//!
//! 1. Running requests first, oldest first. Each gets a slot for the token
//!    it sampled last; when no block is free, the newest running requests
//!    are preempted (their blocks freed, their computed full blocks left in
//!    the prefix cache) and go back to the front of the queue, to be
//!    recomputed from prompt and output when there is room again.
//! 2. Within the step's token budget, each running request gets its
//!    pending tokens: one for a decode, what is left of its prompt (or as
//!    much as the budget allows) for a prefill.
//! 3. With budget and sequence room left, waiting requests are admitted in
//!    arrival order while their prompts fit the cache (above the
//!    watermark), reusing cached prefix blocks, and start their prefill.
//!    A request that does not fit waits; later ones wait behind it, so
//!    long prompts are not starved.

use super::{Engine, FinishReason};
use tessera_core::Result;

/// A running request's part of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Planned {
    /// Its index in the running list.
    pub index: usize,
    /// Tokens it runs in this step, starting at its first uncomputed one.
    pub tokens: usize,
}

/// Plans the next step; preempts and admits as it goes (see the module docs).
pub(crate) fn schedule<M>(e: &mut Engine<M>) -> Result<Vec<Planned>> {
    let mut copies = Vec::new();
    // 1. Slots for every known token of every running request.
    let mut i = 0;
    while i < e.running.len() {
        let r = &e.running[i];
        let table = r.table.as_ref().expect("running requests are admitted");
        if table.len() == r.tokens.len() {
            i += 1;
            continue;
        }
        if !e.blocks.can_append(table) {
            // Make room by preempting the newest; if that is this one, it waits.
            let newest = e.running.len() - 1;
            if newest == 0 {
                // Alone and still out of blocks: the cache cannot hold this sequence.
                let mut r = e.running.remove(0);
                let t = r.table.take().expect("admitted");
                let msg = format!(
                    "the KV cache ({} blocks of {}) cannot hold this sequence past {} tokens; give the cache more memory or lower max_tokens",
                    e.blocks.num_blocks(),
                    e.blocks.block_size(),
                    t.len()
                );
                e.blocks.free(t);
                e.ended.push(r.end(FinishReason::Error(msg)));
                continue;
            }
            preempt(e, newest);
            continue;
        }
        let r = &mut e.running[i];
        let token = r.tokens[r.table.as_ref().expect("admitted").len()];
        if let Some(c) = e.blocks.append(r.table.as_mut().expect("admitted"), token)? {
            copies.push((c.src as usize, c.dst as usize));
        }
    }
    if !copies.is_empty() {
        e.cache.copy_blocks(&copies)?;
    }
    // 2. Pending tokens of the running requests, within the budget.
    let mut budget = e.config.max_num_batched_tokens;
    let mut plan = Vec::new();
    for (index, r) in e.running.iter().enumerate() {
        let tokens = r.pending().min(budget);
        if tokens > 0 {
            plan.push(Planned { index, tokens });
            budget -= tokens;
        }
    }
    // 3. New requests, in arrival order, while they fit.
    while budget > 0 && e.running.len() < e.config.max_num_seqs {
        let Some(r) = e.waiting.front() else { break };
        if !e.blocks.can_admit(&r.tokens) {
            if e.running.is_empty() {
                // Nothing will free a block: this request can never be admitted.
                let mut r = e.waiting.pop_front().expect("checked");
                let msg = format!(
                    "the KV cache ({} blocks of {}) cannot hold this request's {} tokens; give the cache more memory",
                    e.blocks.num_blocks(),
                    e.blocks.block_size(),
                    r.tokens.len()
                );
                e.ended.push(r.end(FinishReason::Error(msg)));
                continue;
            }
            break;
        }
        let mut r = e.waiting.pop_front().expect("checked");
        let admitted = e.blocks.admit(&r.tokens)?;
        e.stats.prefix_cached_tokens += admitted.cached_tokens as u64;
        r.computed = admitted.cached_tokens;
        r.table = Some(admitted.table);
        let tokens = r.pending().min(budget);
        budget -= tokens;
        plan.push(Planned { index: e.running.len(), tokens });
        e.running.push(r);
    }
    Ok(plan)
}

/// Frees running request `i`'s blocks and puts it back at the front of the
/// queue, to be recomputed from all its tokens.
fn preempt<M>(e: &mut Engine<M>, i: usize) {
    let mut r = e.running.remove(i);
    if let Some(t) = r.table.take() {
        e.blocks.free(t);
    }
    r.computed = 0;
    r.preemptions += 1;
    if let Some((_, d)) = e.speculation.as_mut() {
        d.finished(r.id);
    }
    e.stats.preemptions += 1;
    e.waiting.push_front(r);
}
