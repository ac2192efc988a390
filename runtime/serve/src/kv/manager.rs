//! The block manager: hands out blocks to sequences, shares cached prefixes
//! between them, and copies a shared block before it is written.

use tessera_core::{Error, Result};

use super::pool::BlockPool;
use super::prefix::{BlockHash, PrefixHasher};
use super::table::BlockTable;
use super::BlockId;

/// A sequence admitted with its prompt.
#[derive(Debug)]
#[must_use = "the table holds blocks: give it back with `BlockManager::free`"]
pub struct Admission {
    /// The sequence's block table, holding every prompt token.
    pub table: BlockTable,
    /// How many leading prompt tokens already have their K/V in the cache: the
    /// prefill computes only the tokens after them. Always a multiple of the
    /// block size, and below the prompt's length (the last prompt token is
    /// always computed, for its logits).
    pub cached_tokens: usize,
}

/// A block the engine must copy before the next K/V write: a sequence wrote
/// into a block it shared, and now has `dst`, a private copy to be, instead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use = "the engine must copy the K/V of `src` into `dst` before writing the new token"]
pub struct BlockCopy {
    /// The shared block, still read by the other sequences.
    pub src: BlockId,
    /// The sequence's new block, to receive `src`'s K/V.
    pub dst: BlockId,
}

/// The paged KV cache's block manager.
///
/// Blocks of finished (or preempted) sequences that hold a computed full
/// prompt-or-output block stay cached until their memory is needed, so a
/// later request with the same prefix (a shared system prompt, a preempted
/// sequence coming back) skips recomputing it.
pub struct BlockManager {
    pool: BlockPool,
    hasher: PrefixHasher,
    block_size: usize,
    watermark: usize,
}

/// What admitting a prompt takes: the cached blocks it reuses (with their
/// prefix hashes) and how many blocks it removes from the available ones.
struct AdmissionPlan {
    hits: Vec<(BlockId, BlockHash)>,
    cost: usize,
}

impl BlockManager {
    /// A cache of `num_blocks` blocks of `block_size` tokens
    /// ([`DEFAULT_BLOCK_SIZE`](super::DEFAULT_BLOCK_SIZE) is the usual choice;
    /// [`KvBudget`](super::KvBudget) computes `num_blocks`), with no
    /// watermark.
    pub fn new(num_blocks: usize, block_size: usize) -> Result<Self> {
        if block_size == 0 {
            return Err(Error::invalid("BlockManager::new", "block_size is 0; use a positive block size such as 16"));
        }
        if num_blocks == 0 || num_blocks > BlockId::MAX as usize {
            return Err(Error::invalid("BlockManager::new", format!("num_blocks is {num_blocks}; it must be between 1 and {}", BlockId::MAX)));
        }
        Ok(BlockManager { pool: BlockPool::new(num_blocks), hasher: PrefixHasher::new(), block_size, watermark: 0 })
    }

    /// Keeps `blocks` blocks out of reach of admissions, for the appends of
    /// running sequences: without it, admitting up to the last block means
    /// the next decode step must preempt at once (vLLM keeps 1% back).
    pub fn with_watermark(mut self, blocks: usize) -> Result<Self> {
        if blocks >= self.num_blocks() {
            return Err(Error::invalid(
                "BlockManager::with_watermark",
                format!("a watermark of {blocks} blocks leaves none of the {} blocks to admit a prompt into; use a smaller watermark", self.num_blocks()),
            ));
        }
        self.watermark = blocks;
        Ok(self)
    }

    /// The number of blocks in the cache.
    pub fn num_blocks(&self) -> usize {
        self.pool.num_blocks()
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The blocks kept back from admissions.
    pub fn watermark(&self) -> usize {
        self.watermark
    }

    /// Blocks a new block can come from: the free ones plus the evictable
    /// cached ones.
    pub fn available_blocks(&self) -> usize {
        self.pool.available()
    }

    /// Unreferenced blocks holding nothing cached.
    pub fn free_blocks(&self) -> usize {
        self.pool.num_free()
    }

    /// Unreferenced blocks still holding a cached prefix block, evicted least
    /// recently used first when a fresh block is needed.
    pub fn evictable_blocks(&self) -> usize {
        self.pool.num_evictable()
    }

    /// How many block tables reference `block`.
    pub fn refcount(&self, block: BlockId) -> u32 {
        self.pool.refcount(block)
    }

    /// How many blocks admitting `prompt` would take from the available ones:
    /// new blocks for the uncached part, plus cached blocks it would bring back
    /// from the evictable ones.
    pub fn blocks_to_admit(&self, prompt: &[u32]) -> usize {
        self.plan(prompt).cost
    }

    /// Whether [`admit`](Self::admit) would succeed: the prompt is not empty
    /// and its blocks fit without dipping into the watermark.
    pub fn can_admit(&self, prompt: &[u32]) -> bool {
        !prompt.is_empty() && self.plan(prompt).cost + self.watermark <= self.pool.available()
    }

    /// Admits a sequence with `prompt`: reuses the cached blocks of its
    /// longest cached prefix and allocates the rest.
    ///
    /// Fails, leaving the cache unchanged, on an empty prompt and when the
    /// blocks do not fit above the watermark
    /// ([`Error::InsufficientMemory`]): preempt a sequence, or wait for one
    /// to finish.
    pub fn admit(&mut self, prompt: &[u32]) -> Result<Admission> {
        if prompt.is_empty() {
            return Err(Error::invalid("BlockManager::admit", "the prompt is empty; a sequence needs at least one token"));
        }
        let plan = self.plan(prompt);
        let available = self.pool.available();
        if plan.cost + self.watermark > available {
            return Err(Error::InsufficientMemory {
                detail: format!(
                    "KV cache: admitting a {}-token prompt needs {} blocks ({} of its tokens are cached), {available} are available and {} are kept back by the watermark; preempt or finish a sequence first, or give the cache more memory",
                    prompt.len(),
                    plan.cost,
                    plan.hits.len() * self.block_size,
                    self.watermark
                ),
            });
        }
        // Hits first: retaining takes them off the evictable list, so the
        // allocations below cannot evict them.
        for &(block, _) in &plan.hits {
            self.pool.retain(block);
        }
        let total_blocks = prompt.len().div_ceil(self.block_size);
        let mut blocks: Vec<BlockId> = plan.hits.iter().map(|&(block, _)| block).collect();
        for _ in plan.hits.len()..total_blocks {
            blocks.push(self.pool.allocate().expect("the plan counted the blocks available"));
        }
        let cached_tokens = plan.hits.len() * self.block_size;
        let hashes = plan.hits.into_iter().map(|(_, hash)| hash).collect();
        Ok(Admission { table: BlockTable { block_size: self.block_size, blocks, tokens: prompt.to_vec(), hashes }, cached_tokens })
    }

    /// Whether [`append`](Self::append) on `table` would succeed: there is
    /// room in its last block, or a block is available for a new block or a
    /// copy. Appends may use the watermark.
    pub fn can_append(&self, table: &BlockTable) -> bool {
        !self.append_needs_block(table) || self.pool.available() > 0
    }

    /// Appends `token` to the sequence, allocating a block when the last is
    /// full. When the last block is shared with another sequence (after a
    /// [`fork`](Self::fork)) or cached whole (cut back into by
    /// [`truncate`](Self::truncate)), the sequence gets a private copy first: the
    /// returned [`BlockCopy`] says which K/V the engine must copy before it
    /// writes the new token's at [`BlockTable::slot`].
    ///
    /// Fails, leaving the table and cache unchanged, when a block is needed
    /// and none is available ([`Error::InsufficientMemory`]): preempt a
    /// sequence.
    pub fn append(&mut self, table: &mut BlockTable, token: u32) -> Result<Option<BlockCopy>> {
        if self.append_needs_block(table) && self.pool.available() == 0 {
            return Err(Error::InsufficientMemory {
                detail: format!(
                    "KV cache: all {} blocks are in use, so a sequence of {} tokens cannot grow; preempt a sequence (free its table and admit it again later), or give the cache more memory",
                    self.num_blocks(),
                    table.len()
                ),
            });
        }
        let mut copy = None;
        if table.last_block_full() {
            table.blocks.push(self.pool.allocate().expect("checked a block is available"));
        } else {
            let last = table.blocks.len() - 1;
            let src = table.blocks[last];
            if self.must_copy(src) {
                let dst = self.pool.allocate().expect("checked a block is available");
                self.pool.release(src);
                table.blocks[last] = dst;
                copy = Some(BlockCopy { src, dst });
            }
        }
        table.tokens.push(token);
        Ok(copy)
    }

    /// A new table for a sequence that continues `table` (parallel sampling,
    /// beam search): it shares all of `table`'s blocks, and whichever of the
    /// two first appends into the shared last block gets a copy of it. Fork a
    /// sequence after the forward pass that computed its tokens, so the
    /// shared blocks are complete. Takes no block, so it cannot fail.
    pub fn fork(&mut self, table: &BlockTable) -> BlockTable {
        for &block in &table.blocks {
            self.pool.retain(block);
        }
        BlockTable { block_size: table.block_size, blocks: table.blocks.clone(), tokens: table.tokens.clone(), hashes: table.hashes.clone() }
    }

    /// Gives back a finished or preempted sequence's blocks. Shared blocks
    /// lose one reference; cached ones stay in the cache, evictable, so the
    /// sequence admitted again (prompt and generated tokens) finds them.
    pub fn free(&mut self, table: BlockTable) {
        // A computed block another block was cached under instead (the two
        // sequences computed the same prefix) takes over the cache entry if
        // that block has been evicted since, so that re-admitting this
        // sequence finds its whole computed prefix.
        for (&block, &hash) in table.blocks.iter().zip(&table.hashes) {
            self.pool.register(block, hash);
        }
        // Last block first: it becomes the least recently used, evicted
        // before the blocks of the prefix it extends, which more requests share
        // (and without which it is unreachable anyway).
        for &block in table.blocks.iter().rev() {
            self.pool.release(block);
        }
    }

    /// Records that the engine has written the K/V of the first `computed`
    /// tokens of `table` (after a prefill or decode step): the full blocks
    /// among them become cached, for other sequences with the same prefix.
    /// Blocks are cached only once computed, so a sequence preempted before
    /// its forward pass never offers blocks that hold no K/V.
    pub fn commit(&mut self, table: &mut BlockTable, computed: usize) {
        let full_blocks = computed.min(table.len()) / self.block_size;
        for i in table.hashes.len()..full_blocks {
            let parent = table.hashes.last().copied();
            let hash = self.hasher.hash(parent, &table.tokens[i * self.block_size..(i + 1) * self.block_size]);
            self.pool.register(table.blocks[i], hash);
            table.hashes.push(hash);
        }
    }

    /// Drops the tokens of `table` from `len` on (speculative tokens the
    /// target rejected), giving back the blocks no longer needed. Tokens of
    /// committed blocks cannot be dropped: `len` must not cut into a block
    /// whose K/V was offered to other sequences (those are final).
    pub fn truncate(&mut self, table: &mut BlockTable, len: usize) -> Result<()> {
        if len > table.len() || len < table.hashes.len() * self.block_size || len == 0 {
            return Err(Error::invalid(
                "BlockManager::truncate",
                format!(
                    "cannot cut a sequence of {} tokens ({} committed) to {len}; keep every committed token and at least one",
                    table.len(),
                    table.hashes.len() * self.block_size
                ),
            ));
        }
        table.tokens.truncate(len);
        let keep = len.div_ceil(self.block_size);
        for block in table.blocks.drain(keep..).rev() {
            self.pool.release(block);
        }
        Ok(())
    }

    fn append_needs_block(&self, table: &BlockTable) -> bool {
        table.last_block_full() || table.blocks.last().is_some_and(|&last| self.must_copy(last))
    }

    /// Whether writing into the partly filled last block `block` of a table
    /// needs a private copy: another table shares it, or it is cached whole
    /// (it was filled and committed by a sequence this one was forked from,
    /// and this one was cut back into it by [`truncate`](Self::truncate)):
    /// its K/V must stay what its hash says.
    fn must_copy(&self, block: BlockId) -> bool {
        self.pool.refcount(block) > 1 || self.pool.is_cached(block)
    }

    fn plan(&self, prompt: &[u32]) -> AdmissionPlan {
        // Only blocks before the last prompt token can be reused: the prefill
        // must compute at least that token, whose logits give the first
        // output token.
        let reusable = prompt.len().saturating_sub(1) / self.block_size;
        let mut hits = Vec::new();
        let mut parent = None;
        for chunk in prompt.chunks_exact(self.block_size).take(reusable) {
            let hash = self.hasher.hash(parent, chunk);
            let Some(block) = self.pool.lookup(hash) else { break };
            hits.push((block, hash));
            parent = Some(hash);
        }
        let evictable_hits = hits.iter().filter(|&&(block, _)| self.pool.is_evictable(block)).count();
        let new_blocks = prompt.len().div_ceil(self.block_size) - hits.len();
        AdmissionPlan { hits, cost: evictable_hits + new_blocks }
    }
}

#[cfg(test)]
impl BlockManager {
    pub(crate) fn pool(&self) -> &BlockPool {
        &self.pool
    }
}
