//! How many KV blocks fit in a memory budget.

use tessera_core::{Error, Result};

/// The memory given to the KV cache and the model shape that fills it: what
/// fixes the number of blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvBudget {
    /// Bytes of accelerator memory for the K/V blocks (what is left after the
    /// weights and the activations of the largest batch).
    pub memory_bytes: usize,
    /// The model's transformer layers: each has its own K and V.
    pub layers: usize,
    /// Key/value heads per layer (fewer than the query heads under grouped-query attention).
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Bytes per K/V element: 2 for bf16 or f16, 4 for f32, 1 for an 8-bit cache.
    pub dtype_bytes: usize,
    /// Tokens per block ([`DEFAULT_BLOCK_SIZE`](super::DEFAULT_BLOCK_SIZE) is the usual choice).
    pub block_size: usize,
    /// The longest sequence (prompt and output) to be served: the cache must
    /// hold at least one.
    pub max_seq_len: usize,
}

impl KvBudget {
    /// Bytes of one block: its K and V, for every layer, head and slot,
    /// `2 · layers · kv_heads · head_dim · block_size · dtype_bytes`.
    pub fn bytes_per_block(&self) -> Result<usize> {
        let fields = [
            ("layers", self.layers),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("dtype_bytes", self.dtype_bytes),
            ("block_size", self.block_size),
        ];
        if let Some((name, _)) = fields.iter().find(|(_, value)| *value == 0) {
            return Err(Error::invalid("KvBudget", format!("{name} is 0; every dimension of the model's K/V must be positive")));
        }
        fields
            .iter()
            .try_fold(2usize, |bytes, &(_, value)| bytes.checked_mul(value))
            .ok_or_else(|| Error::invalid("KvBudget", format!("one block of {self:?} overflows usize bytes; the shape is implausible, check it")))
    }

    /// The number of blocks the budget holds. Fails with
    /// [`Error::InsufficientMemory`], saying what to change, when it holds
    /// fewer than one sequence of `max_seq_len` tokens needs.
    pub fn num_blocks(&self) -> Result<usize> {
        let block_bytes = self.bytes_per_block()?;
        if self.max_seq_len == 0 {
            return Err(Error::invalid("KvBudget", "max_seq_len is 0; give the longest sequence to serve"));
        }
        // Block ids are u32: more blocks could not be addressed.
        let blocks = (self.memory_bytes / block_bytes).min(super::BlockId::MAX as usize);
        let needed = self.max_seq_len.div_ceil(self.block_size);
        if blocks == 0 {
            return Err(Error::InsufficientMemory {
                detail: format!(
                    "the KV cache budget of {} bytes cannot hold one block of {block_bytes} bytes (2 · {} layers · {} kv heads · {} head dim · {} tokens · {} bytes); give the cache more memory (a smaller batch leaves more), or use a smaller block size or a narrower dtype",
                    self.memory_bytes, self.layers, self.kv_heads, self.head_dim, self.block_size, self.dtype_bytes
                ),
            });
        }
        if blocks < needed {
            return Err(Error::InsufficientMemory {
                detail: format!(
                    "the KV cache budget of {} bytes holds {blocks} blocks of {} tokens ({block_bytes} bytes each), but one sequence of max_seq_len {} tokens needs {needed} blocks ({} bytes); give the cache at least that much memory, lower max_seq_len to {}, or use a narrower dtype",
                    self.memory_bytes,
                    self.block_size,
                    self.max_seq_len,
                    needed.saturating_mul(block_bytes),
                    blocks * self.block_size
                ),
            });
        }
        Ok(blocks)
    }
}
