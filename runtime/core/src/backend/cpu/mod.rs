//! The CPU backend: host buffers with exact accounting, computed by `tessera-kernels`.
//!
//! Work runs synchronously on the calling thread and rayon's pool, so a CPU
//! device has nothing to synchronise; reading to host is a copy.

mod arena;
mod buffer;
mod convert;
mod exec;
mod pool;
mod storage;

pub use arena::{HostArena, MIN_ARENA_BYTES};
pub use buffer::Buffer;
use buffer::HostMemory;
pub(crate) use convert::convert;
pub(crate) use exec::run_float;
pub use storage::CpuStorage;

use super::memory::MemoryStats;
use crate::error::Result;
use crate::tensor::DType;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// One CPU "device": an accounting domain for host memory.
///
/// Each rank of an in-process run gets its own `CpuDevice`, so per-rank
/// memory watermarks are measured separately. Clones share the accounting.
#[derive(Clone, Debug)]
pub struct CpuDevice {
    id: usize,
    host: Arc<HostMemory>,
}

static NEXT_CPU_ID: AtomicUsize = AtomicUsize::new(0);

impl CpuDevice {
    /// A new CPU device with its own memory accounting.
    pub fn new() -> Self {
        CpuDevice { id: NEXT_CPU_ID.fetch_add(1, Ordering::Relaxed), host: Arc::default() }
    }

    /// A process-unique number that tells devices apart in messages.
    pub fn id(&self) -> usize {
        self.id
    }

    /// Whether `other` is this very device (shares its accounting).
    pub fn same(&self, other: &CpuDevice) -> bool {
        Arc::ptr_eq(&self.host, &other.host)
    }

    /// A tracked buffer of `len` zeros.
    pub fn buffer_zeros<T: bytemuck::Pod + Send>(&self, len: usize) -> Buffer<T> {
        Buffer::zeros(len, &self.host)
    }

    /// A tracked buffer of `len` elements with unspecified (but initialised)
    /// contents, for a kernel that overwrites all of them: a buffer of that
    /// length freed earlier comes back from the device's pool as it is,
    /// without the zero-fill (or, for a new allocation, the page faults) a
    /// fresh buffer costs.
    pub fn buffer_for_overwrite<T: bytemuck::Pod + Send>(&self, len: usize) -> Buffer<T> {
        Buffer::for_overwrite(len, &self.host)
    }

    /// Frees the buffers kept for reuse (they count in
    /// [`MemoryStats::cached`], not in `in_use`).
    pub fn empty_cache(&self) {
        self.host.pool.clear();
        if let Some(a) = self.host.arena.get() {
            a.release_cached();
        }
    }

    /// Makes `arena` the source of this device's (and its clones') buffers
    /// of at least [`MIN_ARENA_BYTES`] from now on; buffers allocated
    /// before stay where they are. A device takes one arena for its
    /// lifetime: returns `false`, changing nothing, if it already has one.
    pub fn use_arena(&self, arena: Arc<dyn HostArena>) -> bool {
        self.host.arena.set(arena).is_ok()
    }

    /// The arena this device's large buffers come from, if it has one.
    pub fn arena(&self) -> Option<&Arc<dyn HostArena>> {
        self.host.arena.get()
    }

    /// Moves `data` into a tracked buffer.
    pub fn buffer<T: Send + 'static>(&self, data: Vec<T>) -> Buffer<T> {
        Buffer::from_vec(data, &self.host)
    }
}

impl super::BackendDevice for CpuDevice {
    type Storage = CpuStorage;

    fn zeros(&self, dtype: DType, len: usize) -> Result<CpuStorage> {
        Ok(CpuStorage::zeros(self, dtype, len))
    }

    fn memory_stats(&self) -> MemoryStats {
        MemoryStats { cached: self.host.cached_bytes(), ..self.host.tracker.stats() }
    }

    fn reset_peak(&self) {
        self.host.tracker.reset_peak()
    }

    /// CPU work runs synchronously: nothing is ever queued.
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
}

impl Default for CpuDevice {
    fn default() -> Self {
        Self::new()
    }
}
