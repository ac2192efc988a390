//! One request inside the engine: its tokens, sampler, stop conditions and
//! (while it is admitted) its block table.

use super::{FinishReason, RequestId, RequestOutput, TokenOut};
use crate::kv::BlockTable;
use crate::sampling::{History, Sampled, Sampler, Status, StopChecker};

/// Turns a request's generated tokens into text, one token at a time: each
/// call returns the text that token completes (possibly empty).
pub type PieceDecoder = Box<dyn FnMut(u32) -> String + Send>;

pub(crate) struct Request {
    pub id: RequestId,
    /// Prompt and generated tokens: everything known of the sequence.
    pub tokens: Vec<u32>,
    pub history: History,
    pub sampler: Sampler,
    pub stop: StopChecker,
    pub text: Option<PieceDecoder>,
    /// Held while admitted (running); given back on finish or preemption.
    pub table: Option<BlockTable>,
    /// Leading tokens whose K/V are in the cache (meaningful while admitted).
    pub computed: usize,
    /// Times it was preempted.
    pub preemptions: usize,
    /// Speculative tokens at the end of `tokens`, to be verified this step.
    pub draft: Vec<u32>,
    /// The distributions they were drawn from (`None`: deterministic proposals).
    pub draft_dists: Option<Vec<Vec<(u32, f64)>>>,
}

impl Request {
    /// Tokens still to run through the model before the next sample.
    pub fn pending(&self) -> usize {
        self.tokens.len() - self.computed
    }

    /// Records a sampled token; returns the output, finished when a stop
    /// condition (or the context length `max_len`) is met.
    pub fn accept(&mut self, s: Sampled, max_len: usize) -> RequestOutput {
        self.tokens.push(s.token);
        self.history.push(s.token);
        let piece = self.text.as_mut().map(|f| f(s.token)).unwrap_or_default();
        let check = self.stop.push(s.token, &piece);
        let mut text = check.emit;
        let finished = match check.status {
            Status::Stop(r) => Some(FinishReason::Stop(r)),
            Status::Continue if self.tokens.len() >= max_len => {
                text.push_str(&self.stop.flush());
                Some(FinishReason::Length)
            }
            Status::Continue => None,
        };
        RequestOutput { id: self.id, tokens: vec![TokenOut { id: s.token, logprob: s.logprob, top: s.top }], text, finished }
    }

    /// The last output of a request that ends for a reason the sampler did not see.
    pub fn end(&mut self, reason: FinishReason) -> RequestOutput {
        RequestOutput { id: self.id, tokens: Vec::new(), text: self.stop.flush(), finished: Some(reason) }
    }
}
