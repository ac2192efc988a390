use std::sync::atomic::{AtomicUsize, Ordering};

/// Bytes a device holds now and the most it held since the last reset.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct MemoryStats {
    /// Bytes allocated and not yet freed.
    pub in_use: usize,
    /// The largest `in_use` seen since the device was created or its peak reset.
    pub peak: usize,
    /// Number of allocations made since the device was created.
    pub allocations: usize,
    /// Bytes of freed buffers the device keeps for reuse (not in `in_use`).
    pub cached: usize,
}

/// Exact accounting of one device's memory: every buffer the device hands out
/// registers its bytes here when allocated and releases them when dropped.
///
/// Later parts of the system (ZeRO, recompute, the planner) prove their memory
/// savings with these figures, so nothing may bypass it.
#[derive(Debug, Default)]
pub struct MemoryTracker {
    in_use: AtomicUsize,
    peak: AtomicUsize,
    /// The largest `in_use` since the device was created (`reset_peak`
    /// leaves it): what the device has shown it needs at once.
    high_water: AtomicUsize,
    allocations: AtomicUsize,
}

impl MemoryTracker {
    pub(crate) fn on_alloc(&self, bytes: usize) {
        let now = self.in_use.fetch_add(bytes, Ordering::AcqRel) + bytes;
        self.peak.fetch_max(now, Ordering::AcqRel);
        self.high_water.fetch_max(now, Ordering::AcqRel);
        self.allocations.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn on_free(&self, bytes: usize) {
        self.in_use.fetch_sub(bytes, Ordering::AcqRel);
    }

    /// How many bytes a cache of freed buffers may hold now without the
    /// device's memory (in use plus cached) passing its high-water mark.
    pub(crate) fn headroom(&self) -> usize {
        self.high_water.load(Ordering::Acquire).saturating_sub(self.in_use.load(Ordering::Acquire))
    }

    /// Current figures.
    pub fn stats(&self) -> MemoryStats {
        MemoryStats {
            in_use: self.in_use.load(Ordering::Acquire),
            peak: self.peak.load(Ordering::Acquire),
            allocations: self.allocations.load(Ordering::Relaxed),
            cached: 0,
        }
    }

    /// Starts a new peak window at the bytes in use now.
    pub fn reset_peak(&self) {
        self.peak.store(self.in_use.load(Ordering::Acquire), Ordering::Release);
    }
}
