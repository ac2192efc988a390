use super::arena::{HostArena, MIN_ARENA_BYTES};
use super::pool::HostPool;
use crate::backend::memory::MemoryTracker;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::{Arc, OnceLock};

/// A device's host memory: the accounting, the pool of freed buffers, and
/// the arena large buffers come from, if the device has one.
#[derive(Debug, Default)]
pub(crate) struct HostMemory {
    pub(crate) tracker: MemoryTracker,
    pub(crate) pool: HostPool,
    pub(crate) arena: OnceLock<Arc<dyn HostArena>>,
}

impl HostMemory {
    /// Bytes of freed memory kept for reuse, in the pool and the arena.
    pub(crate) fn cached_bytes(&self) -> usize {
        self.pool.cached_bytes() + self.arena.get().map_or(0, |a| a.cached_bytes())
    }
}

/// A host allocation whose bytes are counted by its device's [`MemoryTracker`]
/// from creation until drop. Every CPU tensor and every temporary an op needs
/// (half-precision conversions, saved statistics) lives in one. Large
/// buffers come from the device's arena when it has one (see
/// [`HostArena`]), and otherwise go back to the device's pool when dropped,
/// to be reused.
pub struct Buffer<T: Send + 'static> {
    data: Data<T>,
    host: Arc<HostMemory>,
}

/// Where a buffer's elements live.
enum Data<T> {
    /// The C allocator's heap.
    Heap(Vec<T>),
    /// A block of the device's arena, owned by this buffer alone.
    Arena { ptr: NonNull<T>, len: usize, arena: Arc<dyn HostArena> },
}

// SAFETY: an arena block belongs to one buffer from `alloc` to `free`, like a
// Vec's allocation, so moving the buffer to another thread moves sole
// ownership of its elements.
unsafe impl<T: Send> Send for Data<T> {}
// SAFETY: shared references only read the elements, as for a `Vec<T>`.
unsafe impl<T: Sync> Sync for Data<T> {}

impl<T: bytemuck::Pod + Send> Buffer<T> {
    /// A buffer of `len` elements for a kernel that writes every one of
    /// them: a reused buffer keeps its old contents instead of being zeroed
    /// first (a whole extra pass over the output, on one thread), a new one
    /// comes zeroed from the allocator.
    pub(crate) fn for_overwrite(len: usize, host: &Arc<HostMemory>) -> Self {
        if let Some(b) = Self::from_arena(len, host) {
            return b;
        }
        let data = host.pool.take::<T>(len).unwrap_or_else(|| vec![T::zeroed(); len]);
        Self::from_vec(data, host)
    }

    /// `len` zero elements.
    pub(crate) fn zeros(len: usize, host: &Arc<HostMemory>) -> Self {
        if let Some(mut b) = Self::from_arena(len, host) {
            b.fill(T::zeroed());
            return b;
        }
        let data = match host.pool.take::<T>(len) {
            Some(mut v) => {
                v.fill(T::zeroed());
                v
            }
            None => vec![T::zeroed(); len],
        };
        Self::from_vec(data, host)
    }

    /// `len` elements of the device's arena (any bytes: `T` is plain data),
    /// if the device has one and it holds them.
    fn from_arena(len: usize, host: &Arc<HostMemory>) -> Option<Self> {
        let bytes = Self::bytes_of(len);
        if bytes < MIN_ARENA_BYTES {
            return None;
        }
        let arena = host.arena.get()?;
        let ptr = arena.alloc(bytes)?.cast::<T>();
        debug_assert!(ptr.as_ptr().is_aligned(), "an arena block is aligned to 64");
        host.tracker.on_alloc(bytes);
        Some(Buffer { data: Data::Arena { ptr, len, arena: arena.clone() }, host: host.clone() })
    }
}

impl<T: Send + 'static> Buffer<T> {
    /// Takes ownership of `data` and counts its bytes.
    pub(crate) fn from_vec(data: Vec<T>, host: &Arc<HostMemory>) -> Self {
        host.tracker.on_alloc(Self::bytes_of(data.len()));
        Buffer { data: Data::Heap(data), host: host.clone() }
    }

    fn bytes_of(len: usize) -> usize {
        len * std::mem::size_of::<T>()
    }

    /// Bytes counted for this buffer.
    pub fn bytes(&self) -> usize {
        Self::bytes_of(self.len())
    }

    /// Whether the elements live in the device's arena (see [`HostArena`]).
    pub fn in_arena(&self) -> bool {
        matches!(self.data, Data::Arena { .. })
    }
}

impl<T: Send + 'static> Drop for Buffer<T> {
    fn drop(&mut self) {
        let bytes = self.bytes();
        self.host.tracker.on_free(bytes);
        let headroom = self.host.tracker.headroom().saturating_sub(self.host.cached_bytes());
        match &mut self.data {
            Data::Heap(v) => self.host.pool.give(std::mem::take(v), headroom + self.host.pool.cached_bytes()),
            Data::Arena { ptr, arena, .. } => arena.free(ptr.cast(), bytes, headroom + arena.cached_bytes()),
        }
    }
}

impl<T: Send + 'static> Deref for Buffer<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match &self.data {
            Data::Heap(v) => v,
            // SAFETY: the block holds `len` elements of `T` (any bytes are a
            // valid `T`: only `Pod` buffers come from an arena), is aligned,
            // and is this buffer's alone until dropped.
            Data::Arena { ptr, len, .. } => unsafe { std::slice::from_raw_parts(ptr.as_ptr(), *len) },
        }
    }
}

impl<T: Send + 'static> DerefMut for Buffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.data {
            Data::Heap(v) => v,
            // SAFETY: as for `deref`, and `&mut self` makes the borrow unique.
            Data::Arena { ptr, len, .. } => unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), *len) },
        }
    }
}
