//! The decoding state a serving step carries in [`Cx`](super::Cx): where the
//! step's tokens sit and the key/value cache they read and extend.
//!
//! A serving step runs the model's ordinary forward on the step's tokens
//! flattened into one row, `[1, tokens]`: decode tokens of running
//! sequences and prefill chunks of new ones side by side. The layers that
//! look across tokens read this state instead of assuming positions
//! `0..seq` of independent rows:
//!
//! * [`CausalAttention`](crate::CausalAttention) writes each token's key and
//!   value into its cache slot and attends its own sequence's cached
//!   positions through the block table (`ops::paged_attention`), applying
//!   RoPE at the tokens' positions;
//! * [`PositionEmbedding`](crate::PositionEmbedding) adds the rows of the
//!   tokens' positions;
//! * a vocabulary head ([`Linear`](crate::Linear) as `#[shard(vocab)]`)
//!   computes logits only for the rows the step samples from, and products
//!   of [`Linear`](crate::Linear) run batch-invariant (`ops::matmul_rows_nt`),
//!   so a request's tokens do not depend on what else shares its step.
//!
//! Every other layer works token by token and needs nothing. So the models
//! a user trains serve unchanged: no second definition.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use tessera_core::ops::{self, PagedBatch};
use tessera_core::tensor::{DType, Tensor};
use tessera_core::{Device, Error, Result};

/// One decoding step's state: where the step's tokens (fed as one row
/// `[1, tokens]`) sit and the cache they read and extend. `CausalAttention`
/// writes and attends through it, `PositionEmbedding` adds the tokens'
/// positions, a vocabulary head computes only `logit_rows`, and `Linear`
/// runs batch-invariant; every other layer works token by token.
#[derive(Clone, Debug)]
pub struct Decode {
    /// Where each token sits: sequence, position, slot, block tables.
    pub batch: PagedBatch,
    /// The cache the attention layers write and read.
    pub cache: Arc<KvCache>,
    /// The token rows whose logits the step needs (each sequence's last
    /// token of the step), in the order the logits come out; `None` for all.
    pub logit_rows: Option<Vec<u32>>,
}

impl Decode {
    /// Checks that `x` holds this step's tokens as `[1, tokens, ..]`, the form
    /// a serving step feeds; `op` names the layer in the error.
    pub fn check_tokens(&self, op: &'static str, x: &Tensor) -> Result<()> {
        let d = x.dims();
        if d.len() < 2 || d[0] != 1 || d[1] != self.batch.tokens() {
            return Err(Error::shape(
                op,
                format!(
                    "a decoding step of {} tokens got activations {}; feed the step's tokens as one row [1, {}, ..]",
                    self.batch.tokens(),
                    x.shape(),
                    self.batch.tokens()
                ),
            ));
        }
        Ok(())
    }
}

/// The keys and values of every attention layer of a served model, in
/// blocks of slots shared by all sequences (which sequence owns which
/// block is the scheduler's business; see `PagedBatch`).
///
/// A layer's two tensors, `[slots, kv_heads, head_dim]` each in the cache's
/// dtype, are allocated on the layer's first step, keyed by its module path;
/// so one cache serves any model, whatever its number and kind of attention
/// layers, and [`bytes_per_slot`](Self::bytes_per_slot) measures what a model needs.
pub struct KvCache {
    device: Device,
    dtype: DType,
    block_size: usize,
    blocks: usize,
    layers: Mutex<HashMap<String, KvLayer>>,
}

/// One attention layer's cache.
#[derive(Clone)]
pub struct KvLayer {
    /// Keys, `[slots, kv_heads, head_dim]`.
    pub k: Tensor,
    /// Values, `[slots, kv_heads, head_dim]`.
    pub v: Tensor,
}

impl std::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KvCache({} blocks of {} on {}, {} layers, {})", self.blocks, self.block_size, self.device, self.layers.lock().len(), self.dtype)
    }
}

impl KvCache {
    /// A cache of `blocks` blocks of `block_size` slots on `device`, in `dtype`.
    pub fn new(device: Device, dtype: DType, blocks: usize, block_size: usize) -> Result<KvCache> {
        if blocks == 0 || block_size == 0 {
            return Err(Error::invalid("KvCache::new", format!("{blocks} blocks of {block_size} slots; both must be positive")));
        }
        if !dtype.is_float() {
            return Err(Error::invalid("KvCache::new", format!("a cache of {dtype}; keys and values are floats (use the compute dtype)")));
        }
        Ok(KvCache { device, dtype, block_size, blocks, layers: Mutex::new(HashMap::new()) })
    }

    /// Slots per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks of the cache.
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// The cache's dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The layer at `path`, allocated (zeroed) on first use for `kv_heads`
    /// heads of `head_dim`; an error if the path was used with other sizes.
    pub fn layer(&self, path: &str, kv_heads: usize, head_dim: usize) -> Result<KvLayer> {
        let mut layers = self.layers.lock();
        let slots = self.blocks * self.block_size;
        if let Some(l) = layers.get(path) {
            if l.k.dims() != [slots, kv_heads, head_dim] {
                return Err(Error::shape(
                    "KvCache",
                    format!("attention layer `{path}` asks for {kv_heads} kv heads of {head_dim} but its cache is {}", l.k.shape()),
                ));
            }
            return Ok(l.clone());
        }
        let zeros = || Tensor::zeros([slots, kv_heads, head_dim], self.dtype, &self.device);
        let l = KvLayer { k: zeros()?, v: zeros()? };
        layers.insert(path.to_string(), l.clone());
        Ok(l)
    }

    /// Attention layers allocated so far.
    pub fn layers(&self) -> usize {
        self.layers.lock().len()
    }

    /// Bytes one slot takes over every layer allocated so far (keys and values).
    pub fn bytes_per_slot(&self) -> usize {
        let slots = self.blocks * self.block_size;
        self.layers.lock().values().map(|l| 2 * l.k.elem_count() / slots * self.dtype.size_in_bytes()).sum()
    }

    /// Bytes the cache holds.
    pub fn bytes(&self) -> usize {
        self.bytes_per_slot() * self.blocks * self.block_size
    }

    /// Copies each block `from` onto its block `to` in every layer (copy-on-write of a
    /// shared block before a sequence writes into it).
    pub fn copy_blocks(&self, pairs: &[(usize, usize)]) -> Result<()> {
        for l in self.layers.lock().values() {
            ops::copy_blocks(&l.k, self.block_size, pairs)?;
            ops::copy_blocks(&l.v, self.block_size, pairs)?;
        }
        Ok(())
    }
}
