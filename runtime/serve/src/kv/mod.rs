//! The bookkeeping of a paged KV cache, as in vLLM: which fixed-size blocks of
//! cache memory hold which tokens of which sequence.
//!
//! No tensor lives here. The engine owns the K/V memory, laid out as
//! `num_blocks` blocks of `block_size` token slots; this module decides which
//! block each token is written to ([`BlockTable::slot`]) and which blocks the
//! attention kernel reads ([`BlockTable::blocks`]).
//!
//! - [`KvBudget`] turns a memory budget and the model's shape into a number of
//!   blocks.
//! - [`BlockManager`] hands out blocks to sequences: admission of a prompt
//!   (reusing the blocks of a cached prefix), appending generated tokens,
//!   forking for parallel sampling (copy-on-write), freeing on completion or
//!   preemption. [`BlockManager::commit`] tells it which tokens' K/V the
//!   engine has computed: only those blocks are offered to other sequences.
//! - [`BlockTable`] is one sequence's logical-to-physical block mapping.
//!
//! Running out of blocks is never a panic: [`BlockManager::can_admit`] and
//! [`BlockManager::can_append`] let a scheduler decide before it acts, and the
//! operations themselves return [`tessera_core::Error::InsufficientMemory`],
//! leaving the cache unchanged, when it did not.

mod budget;
mod manager;
mod pool;
mod prefix;
mod table;

#[cfg(test)]
mod tests;

pub use budget::KvBudget;
pub use manager::{Admission, BlockCopy, BlockManager};
pub use table::{BlockTable, Slot};

/// The index of a physical block in the cache.
pub type BlockId = u32;

/// Tokens per block unless told otherwise: vLLM's default, small enough that
/// a sequence wastes at most 15 slots, large enough for the attention kernel
/// to read whole blocks efficiently.
pub const DEFAULT_BLOCK_SIZE: usize = 16;
