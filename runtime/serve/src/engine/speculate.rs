//! Speculative decoding: a cheap proposer guesses the next `k` tokens of a
//! sequence, the target model scores all of them in one forward, and
//! [`Sampler::verify`] keeps the longest prefix its acceptance rule allows
//! plus one token of the target's own. The output is distributed exactly as
//! plain decoding's (greedy: token for token the same); what changes is how
//! many tokens one target forward yields.

use super::layout::StepBatch;
use super::RequestId;
use crate::kv::BlockManager;
use crate::sampling::{History, Sampler, SamplingParams};
use std::collections::HashMap;
use std::sync::Arc;
use tessera_core::Result;
use tessera_nn::module::{Cx, KvCache, Module, Replicated, SplitHidden};

/// A sequence to propose for.
pub struct DraftInput<'a> {
    /// The request.
    pub id: RequestId,
    /// Its tokens so far, prompt and output; the last is not yet computed by the target.
    pub tokens: &'a [u32],
    /// The most tokens to propose.
    pub k: usize,
    /// Its sampling parameters (a draft model samples as the target will).
    pub params: &'a SamplingParams,
    /// Its history (for the penalties).
    pub history: &'a History,
    /// The seed its draws use.
    pub seed: u64,
}

/// Proposed tokens, with the distribution each was drawn from (`None` for a
/// deterministic proposer).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Proposal {
    /// The tokens, at most `k`.
    pub tokens: Vec<u32>,
    /// Per token, the proposer's distribution `(token, probability)`.
    pub dists: Option<Vec<Vec<(u32, f64)>>>,
}

/// What proposes tokens for speculative decoding.
pub trait Drafter: Send {
    /// Proposals for each sequence, in order (an empty proposal is fine).
    fn propose(&mut self, seqs: &[DraftInput<'_>]) -> Result<Vec<Proposal>>;
    /// Request `id` now holds its first `len` tokens for good (the rest of
    /// what was proposed was rejected).
    fn accepted(&mut self, id: RequestId, len: usize);
    /// Request `id` is done (finished, aborted or preempted): forget it.
    fn finished(&mut self, id: RequestId);
    /// The vocabulary the proposals come from, if the drafter has one (a
    /// draft model's must be the target's).
    fn vocab(&self) -> Option<usize> {
        None
    }
}

/// Prompt lookup (n-gram) proposals: find the sequence's last `n` tokens
/// earlier in it (longest `n` first, most recent match) and propose what
/// followed there. No model, no memory; it pays off when the output copies
/// from the prompt (summaries, code edits, retrieval answers).
#[derive(Clone, Debug)]
pub struct PromptLookup {
    /// The longest n-gram tried.
    pub max_n: usize,
    /// The shortest n-gram tried.
    pub min_n: usize,
}

impl Default for PromptLookup {
    /// n-grams of 3 down to 1 tokens.
    fn default() -> Self {
        PromptLookup { max_n: 3, min_n: 1 }
    }
}

impl PromptLookup {
    /// The proposal for one sequence.
    pub fn lookup(&self, tokens: &[u32], k: usize) -> Vec<u32> {
        let len = tokens.len();
        for n in (self.min_n.max(1)..=self.max_n).rev() {
            if n >= len {
                continue;
            }
            let suffix = &tokens[len - n..];
            // The most recent earlier occurrence with something after it.
            if let Some(start) = (0..len - n).rev().find(|&s| &tokens[s..s + n] == suffix) {
                let from = start + n;
                return tokens[from..(from + k).min(len)].to_vec();
            }
        }
        Vec::new()
    }
}

impl Drafter for PromptLookup {
    fn propose(&mut self, seqs: &[DraftInput<'_>]) -> Result<Vec<Proposal>> {
        Ok(seqs.iter().map(|s| Proposal { tokens: self.lookup(s.tokens, s.k), dists: None }).collect())
    }
    fn accepted(&mut self, _: RequestId, _: usize) {}
    fn finished(&mut self, _: RequestId) {}
}

/// A smaller model with the target's tokenizer as the proposer: it decodes
/// `k` tokens per sequence (batched over the sequences, on its own paged
/// cache), sampling as the target will so [`Sampler::verify`] can weigh
/// its guesses.
pub struct DraftModel<D> {
    model: D,
    cx: Cx,
    cache: Arc<KvCache>,
    blocks: BlockManager,
    seqs: HashMap<RequestId, DraftSeq>,
    vocab: usize,
}

struct DraftSeq {
    table: crate::kv::BlockTable,
    /// Leading tokens whose K/V are in the draft's cache.
    computed: usize,
    sampler: Sampler,
}

/// A stream apart from the target's draws for the draft's proposals.
const DRAFT_SEED: u64 = 0xd7af_7000_0000_0001;

impl<D: Module<In = Replicated, Out = SplitHidden>> DraftModel<D> {
    /// A draft model materialised in `cx`, with a cache of `blocks` blocks
    /// of `block_size`. Its vocabulary must be the target's (the engine checks).
    pub fn new(model: D, mut cx: Cx, blocks: usize, block_size: usize) -> Result<DraftModel<D>> {
        cx.set_training(false);
        let (dtype, vocab, _) = super::probe_slots(&model, &mut cx, block_size)?;
        let cache = Arc::new(KvCache::new(cx.device().clone(), dtype, blocks, block_size)?);
        Ok(DraftModel { model, cx, cache, blocks: BlockManager::new(blocks, block_size)?, seqs: HashMap::new(), vocab })
    }

    /// The draft's vocabulary size.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Brings the draft's table of `s` up to its tokens, adding to `copies`
    /// the block copies its appends need (see [`flush`](Self::flush));
    /// `false` when the draft's cache has no room (the sequence then gets no
    /// proposal).
    fn sync(&mut self, s: &DraftInput<'_>, copies: &mut Vec<(usize, usize)>) -> Result<bool> {
        if !self.seqs.contains_key(&s.id) {
            if !self.blocks.can_admit(s.tokens) {
                return Ok(false);
            }
            let sampler = Sampler::new(SamplingParams { seed: Some(s.seed ^ DRAFT_SEED), ..s.params.clone() }, self.vocab, 0)?;
            let a = self.blocks.admit(s.tokens)?;
            self.seqs.insert(s.id, DraftSeq { table: a.table, computed: a.cached_tokens, sampler });
            return Ok(true);
        }
        let seq = self.seqs.get_mut(&s.id).expect("checked");
        for &t in &s.tokens[seq.table.len()..] {
            if !self.blocks.can_append(&seq.table) {
                let seq = self.seqs.remove(&s.id).expect("present");
                self.blocks.free(seq.table);
                return Ok(false);
            }
            if let Some(c) = self.blocks.append(&mut seq.table, t)? {
                copies.push((c.src as usize, c.dst as usize));
            }
        }
        Ok(true)
    }

    /// Makes the block copies that appends asked for, in their order, in one
    /// call, before the next forward writes into the copies. Callers flush
    /// even when gathering failed part way: the appends made so far stay in
    /// the tables, so their copies are owed all the same.
    fn flush(&self, copies: &[(usize, usize)]) -> Result<()> {
        if copies.is_empty() {
            return Ok(());
        }
        self.cache.copy_blocks(copies)
    }
}

impl<D: Module<In = Replicated, Out = SplitHidden> + Send> Drafter for DraftModel<D> {
    fn propose(&mut self, seqs: &[DraftInput<'_>]) -> Result<Vec<Proposal>> {
        let mut out: Vec<Proposal> = seqs.iter().map(|_| Proposal { tokens: Vec::new(), dists: Some(Vec::new()) }).collect();
        let mut active: Vec<usize> = Vec::new();
        let mut copies = Vec::new();
        let synced: Result<()> = seqs.iter().enumerate().try_for_each(|(i, s)| {
            if s.k > 0 && self.sync(s, &mut copies)? {
                active.push(i);
            }
            Ok(())
        });
        self.flush(&copies)?;
        synced?;
        let mut histories: Vec<History> = seqs.iter().map(|s| s.history.clone()).collect();
        let max_k = seqs.iter().map(|s| s.k).max().unwrap_or(0);
        for round in 0..max_k {
            active.retain(|&i| out[i].tokens.len() < seqs[i].k && round < seqs[i].k);
            if active.is_empty() {
                break;
            }
            // One draft forward over every active sequence's uncomputed tokens.
            let mut step = StepBatch::new(self.blocks.block_size(), active.iter().map(|&i| &self.seqs[&seqs[i].id].table));
            let mut rows = Vec::new();
            for &i in &active {
                let seq = &self.seqs[&seqs[i].id];
                step.push(&seq.table, seq.table.tokens(), seq.computed..seq.table.len());
                rows.push(step.ids.len() as u32 - 1);
            }
            let logits = super::run_forward(&self.model, &mut self.cx, &self.cache, &step.ids, step.batch, rows)?;
            let vocab = logits.len() / active.len();
            let (mut still, mut copies) = (Vec::new(), Vec::new());
            let sampled: Result<()> = active.iter().enumerate().try_for_each(|(row, &i)| {
                let s = &seqs[i];
                let seq = self.seqs.get_mut(&s.id).expect("synced");
                seq.computed = seq.table.len();
                let dist = seq.sampler.distribution(&logits[row * vocab..(row + 1) * vocab], &histories[i])?;
                let step = (histories[i].generated().len()) as u64;
                let token = seq.sampler.draw_from(&dist, step);
                out[i].tokens.push(token);
                out[i].dists.as_mut().expect("set").push(dist);
                histories[i].push(token);
                if out[i].tokens.len() < s.k && self.blocks.can_append(&seq.table) {
                    if let Some(c) = self.blocks.append(&mut seq.table, token)? {
                        copies.push((c.src as usize, c.dst as usize));
                    }
                    still.push(i);
                }
                Ok(())
            });
            self.flush(&copies)?;
            sampled?;
            active = still;
        }
        Ok(out)
    }

    fn accepted(&mut self, id: RequestId, len: usize) {
        if let Some(seq) = self.seqs.get_mut(&id) {
            let len = len.min(seq.table.len());
            if self.blocks.truncate(&mut seq.table, len).is_err() {
                let seq = self.seqs.remove(&id).expect("present");
                self.blocks.free(seq.table);
                return;
            }
            seq.computed = seq.computed.min(len);
            let computed = seq.computed;
            self.blocks.commit(&mut seq.table, computed);
        }
    }

    fn finished(&mut self, id: RequestId) {
        if let Some(seq) = self.seqs.remove(&id) {
            self.blocks.free(seq.table);
        }
    }

    fn vocab(&self) -> Option<usize> {
        Some(self.vocab)
    }
}
