//! One sequence's block table: which physical block holds each run of
//! `block_size` of its tokens.

use super::prefix::BlockHash;
use super::BlockId;

/// Where one token's K/V lives: a block and a slot in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    /// The physical block.
    pub block: BlockId,
    /// The token's slot within the block, below the block size.
    pub offset: usize,
}

impl Slot {
    /// The slot's index in the cache seen as one array of `num_blocks *
    /// block_size` token slots: the "slot mapping" a K/V write kernel takes.
    pub fn flat(&self, block_size: usize) -> usize {
        self.block as usize * block_size + self.offset
    }
}

/// A sequence's logical-to-physical mapping: logical block `i` (tokens
/// `i * block_size ..`) is physical block `blocks()[i]`.
///
/// A table is made by [`BlockManager::admit`](super::BlockManager::admit) or
/// [`BlockManager::fork`](super::BlockManager::fork) and must be given back
/// with [`BlockManager::free`](super::BlockManager::free): it holds a
/// reference on each of its blocks, and dropping it instead leaks them. It is
/// not `Clone` for the same reason; fork it.
#[derive(Debug)]
pub struct BlockTable {
    pub(crate) block_size: usize,
    pub(crate) blocks: Vec<BlockId>,
    pub(crate) tokens: Vec<u32>,
    /// The prefix hashes of the leading full blocks whose K/V is known to be
    /// computed: those the manager may offer to other sequences.
    pub(crate) hashes: Vec<BlockHash>,
}

impl BlockTable {
    /// The physical blocks, in logical order: what the attention kernel reads.
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// The sequence's tokens, prompt and generated.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The number of tokens.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the table holds no token (never true of a table the manager
    /// hands out; a prompt has at least one token).
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Where the K/V of the token at `position` lives, or `None` past the
    /// last token.
    pub fn slot(&self, position: usize) -> Option<Slot> {
        if position >= self.tokens.len() {
            return None;
        }
        Some(Slot { block: self.blocks[position / self.block_size], offset: position % self.block_size })
    }

    /// Whether the next token needs a new block because the last is full (or
    /// there is none).
    pub(crate) fn last_block_full(&self) -> bool {
        self.tokens.len() == self.blocks.len() * self.block_size
    }
}
