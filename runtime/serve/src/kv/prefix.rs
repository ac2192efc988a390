//! Prefix hashes: how a full block is recognised as holding the same tokens,
//! after the same prefix, as a block computed earlier.

use std::hash::{BuildHasher, Hasher, RandomState};

/// The identity of a full block: a hash of its parent block's hash and its own
/// tokens, so it stands for the whole prefix up to the block's end (the K/V of
/// a token depends on every token before it, not only on its block).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct BlockHash(u64);

/// Hashes blocks with a per-cache random key: equal prefixes get equal hashes
/// within one cache, but nobody can craft two prompts whose hashes collide
/// (which would let one request read another's cached K/V).
pub(crate) struct PrefixHasher(RandomState);

impl PrefixHasher {
    /// A hasher with a fresh random key.
    pub(crate) fn new() -> Self {
        PrefixHasher(RandomState::new())
    }

    /// The hash of a full block holding `tokens` after the block `parent`
    /// (`None` for a sequence's first block).
    pub(crate) fn hash(&self, parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
        let mut hasher = self.0.build_hasher();
        // Distinguish "no parent" from every parent hash, 0 included.
        match parent {
            None => hasher.write_u8(0),
            Some(BlockHash(h)) => {
                hasher.write_u8(1);
                hasher.write_u64(h);
            }
        }
        for &token in tokens {
            hasher.write_u32(token);
        }
        BlockHash(hasher.finish())
    }
}
