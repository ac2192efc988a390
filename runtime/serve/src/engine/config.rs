//! What an engine is sized and limited by.

use crate::kv::DEFAULT_BLOCK_SIZE;
use tessera_core::{Error, Result};

/// How much memory the KV cache gets.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KvMemory {
    /// This many blocks.
    Blocks(usize),
    /// As many blocks as fit in this many bytes (measured from the model:
    /// the engine runs one token through it to learn what a slot takes).
    Bytes(usize),
}

/// An engine's sizes and scheduling limits (vLLM's names where it has one).
#[derive(Clone, Debug, PartialEq)]
pub struct EngineConfig {
    /// Token slots per cache block.
    pub block_size: usize,
    /// The cache's size.
    pub kv_memory: KvMemory,
    /// The most sequences in one step.
    pub max_num_seqs: usize,
    /// The most tokens in one step (decode tokens plus prefill chunks): a
    /// long prompt is prefilled in chunks of what is left of it, so a step's
    /// time stays bounded and running sequences keep decoding meanwhile.
    pub max_num_batched_tokens: usize,
    /// The longest sequence (prompt plus output) the model takes: its
    /// context length. A request stops there.
    pub max_model_len: usize,
    /// Blocks kept back from admitting new prompts, as a fraction of the
    /// cache, so running sequences can grow without preempting at once.
    pub watermark: f64,
    /// Seeds the draws of requests that give no seed of their own.
    pub seed: u64,
}

impl EngineConfig {
    /// The defaults for a model of context `max_model_len`: blocks of 16,
    /// 256 blocks, 64 sequences, 512 tokens per step, a 1% watermark.
    pub fn new(max_model_len: usize) -> EngineConfig {
        EngineConfig {
            block_size: DEFAULT_BLOCK_SIZE,
            kv_memory: KvMemory::Blocks(256),
            max_num_seqs: 64,
            max_num_batched_tokens: 512,
            max_model_len,
            watermark: 0.01,
            seed: 0,
        }
    }

    /// Checks every field; the error names the first one out of range.
    pub fn validate(&self) -> Result<()> {
        const OP: &str = "EngineConfig";
        let bad = |m: String| Err(Error::invalid(OP, m));
        if self.block_size == 0 {
            return bad("block_size is 0; use a positive block size such as 16".into());
        }
        if self.max_num_seqs == 0 || self.max_num_batched_tokens == 0 {
            return bad(format!("max_num_seqs ({}) and max_num_batched_tokens ({}) must be positive", self.max_num_seqs, self.max_num_batched_tokens));
        }
        if self.max_model_len < 2 {
            return bad(format!("max_model_len is {}; a model must take at least a prompt token and an output token", self.max_model_len));
        }
        if !(0.0..1.0).contains(&self.watermark) {
            return bad(format!("watermark {} is not a fraction in [0, 1)", self.watermark));
        }
        match self.kv_memory {
            KvMemory::Blocks(0) | KvMemory::Bytes(0) => bad("the KV cache has no memory; give it some blocks or bytes".into()),
            _ => Ok(()),
        }
    }
}
