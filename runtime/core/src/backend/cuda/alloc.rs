//! A caching allocator: freed device blocks are kept by size class and handed
//! out again before the driver is asked.
//!
//! `cuMemAlloc` and `cuMemFree` synchronise the device and cost tens of
//! microseconds to milliseconds; a training step asks for the same
//! activation and gradient sizes every time, so after the first step almost
//! every allocation is a cache hit. Like the CPU pool (`cpu/pool.rs`) this
//! keeps freed blocks in free lists; unlike it, requests are rounded up to a
//! size class, so a block serves any request of its class.
//!
//! Reuse is safe without events because every block is allocated, used and
//! freed in the order of one stream (the device's compute stream): work
//! queued on a reused block runs after the work queued before its free.
//! A block used on another stream (communication) must be freed only after
//! that stream's work is ordered before the compute stream's.
//!
//! The accounting is exact for what the device holds: a block counts as in
//! use, at its class size, from hand-out to release, and the cached bytes are
//! reported beside it. [`MemoryStats::in_use`] + [`MemoryStats::cached`] is
//! what the allocator holds from the driver.
//!
//! The policy is independent of CUDA (a [`BlockSource`] supplies the blocks)
//! so it is tested on every machine.

use crate::backend::memory::{MemoryStats, MemoryTracker};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Requests below this are rounded up to a multiple of [`SMALL_GRANULE`].
const SMALL_LIMIT: usize = 1 << 20;
/// The granule of small blocks: the alignment cuBLAS and vector loads want.
const SMALL_GRANULE: usize = 512;
/// The granule of large blocks: bounds the waste at 2 MiB per block while
/// keeping the number of distinct classes (and so of unused cached blocks) small.
const LARGE_GRANULE: usize = 2 << 20;

/// The block size that serves a request of `bytes` (at least one granule, so
/// an empty tensor still has a valid, distinct address).
pub(crate) fn size_class(bytes: usize) -> usize {
    let granule = if bytes < SMALL_LIMIT { SMALL_GRANULE } else { LARGE_GRANULE };
    bytes.max(1).div_ceil(granule) * granule
}

/// Why a [`BlockSource`] could not allocate.
#[derive(Debug)]
pub(crate) enum SourceError {
    /// The device has no room: releasing cached blocks may help.
    OutOfMemory,
    /// Any other failure, described.
    Other(String),
}

/// Where new blocks come from (the driver, on a device).
pub(crate) trait BlockSource {
    /// A block of device memory; dropping it returns it to the driver.
    type Block: Send;
    /// A new block of exactly `bytes`.
    fn allocate(&self, bytes: usize) -> Result<Self::Block, SourceError>;
}

/// Free blocks by size class.
type FreeLists<B> = BTreeMap<usize, Vec<B>>;

/// The caching allocator of one device.
pub(crate) struct CachingAllocator<S: BlockSource> {
    source: S,
    free: Mutex<FreeLists<S::Block>>,
    tracker: MemoryTracker,
    cached: AtomicUsize,
}

impl<S: BlockSource> CachingAllocator<S> {
    pub(crate) fn new(source: S) -> Self {
        CachingAllocator { source, free: Mutex::new(BTreeMap::new()), tracker: MemoryTracker::default(), cached: AtomicUsize::new(0) }
    }

    /// A block for `bytes` and its class size (what [`release`](Self::release)
    /// takes back). Its contents are whatever was last written.
    ///
    /// On a miss the driver is asked; if it is out of memory, every cached
    /// block is released and the driver asked once more.
    pub(crate) fn allocate(&self, bytes: usize) -> Result<(S::Block, usize), SourceError> {
        let class = size_class(bytes);
        let block = match self.take_cached(class) {
            Some(b) => b,
            None => match self.source.allocate(class) {
                Ok(b) => b,
                Err(SourceError::OutOfMemory) => {
                    self.empty_cache();
                    self.source.allocate(class)?
                }
                Err(e) => return Err(e),
            },
        };
        self.tracker.on_alloc(class);
        Ok((block, class))
    }

    /// Takes back a block handed out for class `class`, keeping it for reuse.
    pub(crate) fn release(&self, block: S::Block, class: usize) {
        self.tracker.on_free(class);
        let mut free = self.free.lock();
        free.entry(class).or_default().push(block);
        self.cached.fetch_add(class, Ordering::Relaxed);
    }

    fn take_cached(&self, class: usize) -> Option<S::Block> {
        let mut free = self.free.lock();
        let block = free.get_mut(&class)?.pop()?;
        self.cached.fetch_sub(class, Ordering::Relaxed);
        Some(block)
    }

    /// Returns every cached block to the driver; the bytes released.
    pub(crate) fn empty_cache(&self) -> usize {
        let drained = {
            let mut free = self.free.lock();
            std::mem::take(&mut *free)
        };
        let bytes: usize = drained.iter().map(|(class, blocks)| class * blocks.len()).sum();
        self.cached.fetch_sub(bytes, Ordering::Relaxed);
        // Dropping the blocks outside the lock: a driver free may take a while.
        drop(drained);
        bytes
    }

    /// Bytes in use, the peak, allocations and the cached bytes.
    pub(crate) fn stats(&self) -> MemoryStats {
        MemoryStats { cached: self.cached.load(Ordering::Relaxed), ..self.tracker.stats() }
    }

    /// Starts a new peak window at the bytes in use now.
    pub(crate) fn reset_peak(&self) {
        self.tracker.reset_peak();
    }

    /// The block source.
    #[cfg(test)]
    pub(crate) fn source(&self) -> &S {
        &self.source
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// Host memory with a byte budget standing in for a device: the
    /// allocator's policy does not depend on where blocks live.
    struct Budget {
        left: AtomicUsize,
        calls: AtomicUsize,
    }

    struct HostBlock {
        data: Vec<u8>,
        budget: Arc<Budget>,
    }

    impl Drop for HostBlock {
        fn drop(&mut self) {
            self.budget.left.fetch_add(self.data.len(), Ordering::Relaxed);
        }
    }

    impl BlockSource for Arc<Budget> {
        type Block = HostBlock;
        fn allocate(&self, bytes: usize) -> Result<HostBlock, SourceError> {
            self.calls.fetch_add(1, Ordering::Relaxed);
            let left = self.left.load(Ordering::Relaxed);
            if bytes > left {
                return Err(SourceError::OutOfMemory);
            }
            self.left.store(left - bytes, Ordering::Relaxed);
            Ok(HostBlock { data: vec![0; bytes], budget: self.clone() })
        }
    }

    fn allocator(budget: usize) -> CachingAllocator<Arc<Budget>> {
        CachingAllocator::new(Arc::new(Budget { left: AtomicUsize::new(budget), calls: AtomicUsize::new(0) }))
    }

    #[test]
    fn requests_round_up_to_size_classes() {
        assert_eq!(size_class(0), 512);
        assert_eq!(size_class(1), 512);
        assert_eq!(size_class(512), 512);
        assert_eq!(size_class(513), 1024);
        assert_eq!(size_class((1 << 20) - 1), 1 << 20);
        assert_eq!(size_class(1 << 20), 2 << 20);
        assert_eq!(size_class((2 << 20) + 1), 4 << 20);
    }

    #[test]
    fn freed_blocks_are_reused_by_class_and_counted_exactly() {
        let a = allocator(64 << 20);
        let (b1, c1) = a.allocate(1000).unwrap();
        let ptr = b1.data.as_ptr();
        assert_eq!(c1, 1024);
        assert_eq!(a.stats(), MemoryStats { in_use: 1024, peak: 1024, allocations: 1, cached: 0 });
        a.release(b1, c1);
        assert_eq!(a.stats(), MemoryStats { in_use: 0, peak: 1024, allocations: 1, cached: 1024 });
        let (b2, c2) = a.allocate(600).unwrap();
        assert_eq!((b2.data.as_ptr(), c2), (ptr, 1024), "a request of the same class reuses the block");
        assert_eq!(a.source().calls.load(Ordering::Relaxed), 1, "the driver was asked once");
        let (b3, c3) = a.allocate(3 << 20).unwrap();
        assert_eq!(c3, 4 << 20);
        assert_eq!(a.stats().in_use, 1024 + (4 << 20));
        assert_eq!(a.stats().peak, 1024 + (4 << 20));
        a.release(b3, c3);
        a.reset_peak();
        assert_eq!(a.stats().peak, 1024, "a new peak window starts at the bytes in use");
        assert_eq!(a.empty_cache(), 4 << 20);
        assert_eq!(a.stats().cached, 0);
        assert_eq!(a.source().left.load(Ordering::Relaxed), (64 << 20) - 1024, "the cached block went back");
        a.release(b2, c2);
    }

    #[test]
    fn out_of_memory_releases_the_cache_and_retries_once() {
        let a = allocator(8 << 20);
        let (b, c) = a.allocate(6 << 20).unwrap();
        a.release(b, c);
        // 6 MiB cached, 2 MiB left: a 4 MiB request fits only after the cache is emptied.
        let (b, c) = a.allocate(4 << 20).unwrap();
        assert_eq!(a.stats(), MemoryStats { in_use: 4 << 20, peak: 6 << 20, allocations: 2, cached: 0 });
        assert!(matches!(a.allocate(8 << 20), Err(SourceError::OutOfMemory)));
        assert_eq!(a.stats().in_use, 4 << 20, "a failed request is not counted");
        a.release(b, c);
    }
}
