//! The physical blocks: reference counts, the free list, and the prefix
//! cache's index of full blocks with the LRU order in which unused cached
//! blocks are evicted.
//!
//! Every block is in exactly one of three states:
//! - in use: referenced by at least one table (refcount > 0);
//! - evictable: unreferenced but holding a cached prefix block, kept for a
//!   later hit until a fresh block is needed;
//! - free: unreferenced, holding nothing worth keeping.

use std::collections::{BTreeMap, HashMap};

use super::prefix::BlockHash;
use super::BlockId;

/// The state of one block, as the tests see it.
#[cfg(test)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BlockState {
    Free,
    Evictable,
    InUse(u32),
}

pub(crate) struct BlockPool {
    refcounts: Vec<u32>,
    /// The prefix hash a block is cached under, if any.
    hashes: Vec<Option<BlockHash>>,
    /// When an evictable block was released: its key in `evictable`.
    released_at: Vec<u64>,
    free: Vec<BlockId>,
    /// Evictable blocks, least recently released first.
    evictable: BTreeMap<u64, BlockId>,
    /// Cached full blocks, in use or evictable, by prefix hash.
    index: HashMap<BlockHash, BlockId>,
    clock: u64,
}

impl BlockPool {
    /// `num_blocks` free blocks; the caller checked it fits a [`BlockId`].
    pub(crate) fn new(num_blocks: usize) -> Self {
        BlockPool {
            refcounts: vec![0; num_blocks],
            hashes: vec![None; num_blocks],
            released_at: vec![0; num_blocks],
            // Reversed so that blocks are handed out from 0 up: easier to read in a debugger.
            free: (0..num_blocks as BlockId).rev().collect(),
            evictable: BTreeMap::new(),
            index: HashMap::new(),
            clock: 0,
        }
    }

    pub(crate) fn num_blocks(&self) -> usize {
        self.refcounts.len()
    }

    /// Blocks a new allocation can take: the free ones and the evictable ones.
    pub(crate) fn available(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    pub(crate) fn num_free(&self) -> usize {
        self.free.len()
    }

    pub(crate) fn num_evictable(&self) -> usize {
        self.evictable.len()
    }

    pub(crate) fn refcount(&self, block: BlockId) -> u32 {
        self.refcounts[block as usize]
    }

    pub(crate) fn is_evictable(&self, block: BlockId) -> bool {
        self.refcounts[block as usize] == 0 && self.hashes[block as usize].is_some()
    }

    /// A block with refcount 1 and no cached content: a free one, else the
    /// least recently released evictable one (dropping it from the cache).
    /// `None` when every block is in use.
    pub(crate) fn allocate(&mut self) -> Option<BlockId> {
        let block = match self.free.pop() {
            Some(block) => block,
            None => {
                let (_, block) = self.evictable.pop_first()?;
                if let Some(hash) = self.hashes[block as usize].take() {
                    self.index.remove(&hash);
                }
                block
            }
        };
        self.refcounts[block as usize] = 1;
        Some(block)
    }

    /// One more reference on `block`, which is in use or evictable (a prefix
    /// hit: an evictable block comes back into use).
    pub(crate) fn retain(&mut self, block: BlockId) {
        let i = block as usize;
        if self.refcounts[i] == 0 {
            let removed = self.evictable.remove(&self.released_at[i]);
            debug_assert_eq!(removed, Some(block), "retained block {block} is neither in use nor evictable");
        }
        self.refcounts[i] += 1;
    }

    /// One reference fewer on `block`; at zero it becomes evictable if cached,
    /// free otherwise.
    pub(crate) fn release(&mut self, block: BlockId) {
        let i = block as usize;
        debug_assert!(self.refcounts[i] > 0, "released block {block} has no reference");
        self.refcounts[i] -= 1;
        if self.refcounts[i] > 0 {
            return;
        }
        if self.hashes[i].is_some() {
            self.clock += 1;
            self.released_at[i] = self.clock;
            self.evictable.insert(self.clock, block);
        } else {
            self.free.push(block);
        }
    }

    /// Whether `block` is cached under a prefix hash (so its K/V are final:
    /// other sequences may find and read them).
    pub(crate) fn is_cached(&self, block: BlockId) -> bool {
        self.hashes[block as usize].is_some()
    }

    /// The cached block holding the prefix block `hash`, in use or evictable.
    pub(crate) fn lookup(&self, hash: BlockHash) -> Option<BlockId> {
        self.index.get(&hash).copied()
    }

    /// Caches the in-use, full `block` under `hash`. A no-op if the block is
    /// cached already, or if another block holds the same prefix (two
    /// sequences computed it independently): the first stays the cached one,
    /// and this one is freed, not kept, when released.
    pub(crate) fn register(&mut self, block: BlockId, hash: BlockHash) {
        if self.hashes[block as usize].is_some() || self.index.contains_key(&hash) {
            return;
        }
        self.index.insert(hash, block);
        self.hashes[block as usize] = Some(hash);
    }

    #[cfg(test)]
    pub(crate) fn state(&self, block: BlockId) -> BlockState {
        match self.refcounts[block as usize] {
            0 if self.hashes[block as usize].is_some() => BlockState::Evictable,
            0 => BlockState::Free,
            n => BlockState::InUse(n),
        }
    }

    /// Checks the pool's own structures agree: each block is in exactly one
    /// state, the lists hold what the states say, the index and the hashes
    /// are inverse.
    #[cfg(test)]
    pub(crate) fn audit(&self) -> Result<(), String> {
        let n = self.num_blocks();
        let mut seen_free = vec![false; n];
        for &b in &self.free {
            if std::mem::replace(&mut seen_free[b as usize], true) {
                return Err(format!("block {b} is twice on the free list"));
            }
            if self.state(b) != BlockState::Free {
                return Err(format!("block {b} is on the free list but {:?}", self.state(b)));
            }
        }
        for (&t, &b) in &self.evictable {
            if self.state(b) != BlockState::Evictable || self.released_at[b as usize] != t {
                return Err(format!("block {b} is in the LRU but {:?}", self.state(b)));
            }
        }
        for b in 0..n as BlockId {
            let listed = usize::from(seen_free[b as usize]) + usize::from(self.evictable.values().any(|&e| e == b));
            let expected = usize::from(self.refcounts[b as usize] == 0);
            if listed != expected {
                return Err(format!("block {b} ({:?}) is on {listed} lists", self.state(b)));
            }
            if let Some(h) = self.hashes[b as usize] {
                if self.index.get(&h) != Some(&b) {
                    return Err(format!("block {b} has a hash the index does not map to it"));
                }
            }
        }
        for (h, &b) in &self.index {
            if self.hashes[b as usize] != Some(*h) {
                return Err(format!("the index maps a hash to block {b}, which is not cached under it"));
            }
        }
        let in_use = self.refcounts.iter().filter(|&&r| r > 0).count();
        if self.free.len() + self.evictable.len() + in_use != n {
            return Err(format!("free {} + evictable {} + in use {in_use} != {n} blocks", self.free.len(), self.evictable.len()));
        }
        Ok(())
    }
}
