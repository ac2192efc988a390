//! Reuse of freed host buffers of the sizes a training step asks for again.
//!
//! A training step allocates the same large activations and gradients every
//! time. Returned to the C allocator, a buffer of a few megabytes goes back
//! to the operating system, and its next allocation faults every page in
//! again and has it zeroed: for gpt-tiny that was about 80 000 page faults
//! per step. The pool keeps freed buffers by element type and length (a
//! training loop asks for exactly the same lengths again) up to a byte
//! budget, and hands them out before the C allocator is asked.
//!
//! Pooling does not change the device's accounting: a buffer counts as in
//! use from creation to drop either way, and [`HostPool::cached_bytes`]
//! reports what the pool holds besides. The pool never holds more than the
//! accounting has seen in use at once, less what is in use now: a buffer is
//! kept only if in-use plus cached bytes stay at or under the device's
//! high-water mark. So the process's memory follows the accounted peak,
//! however many buffers of lengths never asked for again are freed (without
//! that bound, an 8-rank bf16 run filled 2 GiB of dead buffers per rank).

use parking_lot::Mutex;
use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Buffers smaller than this come from the C allocator, which recycles them
/// cheaply itself.
const MIN_POOLED_BYTES: usize = 64 << 10;
/// The most bytes a device's pool keeps.
const DEFAULT_LIMIT: usize = 2 << 30;

/// Freed buffers (each a `Vec<T>`, type-erased) by element type and length.
type FreeLists = HashMap<(TypeId, usize), Vec<Box<dyn Any + Send>>>;

/// Freed buffers by element type and length.
#[derive(Debug)]
pub(crate) struct HostPool {
    free: Mutex<FreeLists>,
    cached: AtomicUsize,
    limit: usize,
}

impl Default for HostPool {
    fn default() -> Self {
        HostPool { free: Mutex::default(), cached: AtomicUsize::new(0), limit: DEFAULT_LIMIT }
    }
}

impl HostPool {
    /// A freed buffer of exactly `len` elements, if the pool holds one
    /// (its contents are whatever was last written).
    pub(crate) fn take<T: Send + 'static>(&self, len: usize) -> Option<Vec<T>> {
        let bytes = len * std::mem::size_of::<T>();
        if bytes < MIN_POOLED_BYTES {
            return None;
        }
        let mut free = self.free.lock();
        let boxed = free.get_mut(&(TypeId::of::<T>(), len))?.pop()?;
        self.cached.fetch_sub(bytes, Ordering::Relaxed);
        boxed.downcast::<Vec<T>>().ok().map(|v| *v)
    }

    /// Keeps `data` for a later [`take`](Self::take) of its length, unless it
    /// is small or keeping it would pass the pool's limit or `headroom` (the
    /// bytes the device may cache without passing its high-water mark; see
    /// the module's documentation): then it is simply freed.
    pub(crate) fn give<T: Send + 'static>(&self, data: Vec<T>, headroom: usize) {
        let bytes = data.len() * std::mem::size_of::<T>();
        let cached = self.cached.load(Ordering::Relaxed);
        if bytes < MIN_POOLED_BYTES || cached + bytes > self.limit.min(headroom) {
            return;
        }
        self.cached.fetch_add(bytes, Ordering::Relaxed);
        let mut free = self.free.lock();
        free.entry((TypeId::of::<T>(), data.len())).or_default().push(Box::new(data));
    }

    /// Bytes held for reuse.
    pub(crate) fn cached_bytes(&self) -> usize {
        self.cached.load(Ordering::Relaxed)
    }

    /// Frees every held buffer.
    pub(crate) fn clear(&self) {
        let mut free = self.free.lock();
        free.clear();
        self.cached.store(0, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_buffers_come_back_by_type_and_length() {
        let pool = HostPool::default();
        let n = MIN_POOLED_BYTES / 4;
        let mut v = vec![0f32; n];
        v[0] = 7.0;
        let ptr = v.as_ptr();
        pool.give(v, usize::MAX);
        assert_eq!(pool.cached_bytes(), n * 4);
        assert!(pool.take::<u32>(n).is_none(), "another element type");
        assert!(pool.take::<f32>(n + 1).is_none(), "another length");
        let back = pool.take::<f32>(n).expect("pooled");
        assert_eq!((back.as_ptr(), back[0]), (ptr, 7.0));
        assert_eq!(pool.cached_bytes(), 0);
        pool.give(vec![0u8; 16], usize::MAX);
        assert_eq!(pool.cached_bytes(), 0, "small buffers are not kept");
        pool.give(back, usize::MAX);
        pool.clear();
        assert!(pool.take::<f32>(n).is_none());
    }

    #[test]
    fn the_pool_keeps_no_more_than_the_headroom() {
        let pool = HostPool::default();
        let n = MIN_POOLED_BYTES / 4;
        pool.give(vec![0f32; n], 3 * n * 4);
        pool.give(vec![0f32; n], 3 * n * 4);
        assert_eq!(pool.cached_bytes(), 2 * n * 4);
        pool.give(vec![0f32; 2 * n], 3 * n * 4);
        assert_eq!(pool.cached_bytes(), 2 * n * 4, "a buffer past the headroom is freed");
        pool.give(vec![0f32; n], 3 * n * 4);
        assert_eq!(pool.cached_bytes(), 3 * n * 4, "up to the headroom exactly");
    }
}
