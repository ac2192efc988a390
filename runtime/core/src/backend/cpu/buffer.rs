use super::pool::HostPool;
use crate::backend::memory::MemoryTracker;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

/// A device's host memory: the accounting and the pool of freed buffers.
#[derive(Debug, Default)]
pub(crate) struct HostMemory {
    pub(crate) tracker: MemoryTracker,
    pub(crate) pool: HostPool,
}

/// A host allocation whose bytes are counted by its device's [`MemoryTracker`]
/// from creation until drop. Every CPU tensor and every temporary an op needs
/// (half-precision conversions, saved statistics) lives in one. Large
/// buffers go back to the device's pool when dropped, to be reused.
pub struct Buffer<T: Send + 'static> {
    data: Vec<T>,
    host: Arc<HostMemory>,
}

impl<T: Copy + Default + Send + 'static> Buffer<T> {
    /// `len` default (zero) elements.
    /// A buffer of `len` elements for a kernel that writes every one of
    /// them: a reused buffer keeps its old contents instead of being zeroed
    /// first (a whole extra pass over the output, on one thread), a new one
    /// comes zeroed from the allocator.
    pub(crate) fn for_overwrite(len: usize, host: &Arc<HostMemory>) -> Self {
        let data = host.pool.take::<T>(len).unwrap_or_else(|| vec![T::default(); len]);
        Self::from_vec(data, host)
    }

    pub(crate) fn zeros(len: usize, host: &Arc<HostMemory>) -> Self {
        let data = match host.pool.take::<T>(len) {
            Some(mut v) => {
                v.fill(T::default());
                v
            }
            None => vec![T::default(); len],
        };
        Self::from_vec(data, host)
    }
}

impl<T: Send + 'static> Buffer<T> {
    /// Takes ownership of `data` and counts its bytes.
    pub(crate) fn from_vec(data: Vec<T>, host: &Arc<HostMemory>) -> Self {
        host.tracker.on_alloc(Self::bytes_of(data.len()));
        Buffer { data, host: host.clone() }
    }

    fn bytes_of(len: usize) -> usize {
        len * std::mem::size_of::<T>()
    }

    /// Bytes counted for this buffer.
    pub fn bytes(&self) -> usize {
        Self::bytes_of(self.data.len())
    }
}

impl<T: Send + 'static> Drop for Buffer<T> {
    fn drop(&mut self) {
        self.host.tracker.on_free(Self::bytes_of(self.data.len()));
        self.host.pool.give(std::mem::take(&mut self.data), self.host.tracker.headroom());
    }
}

impl<T: Send + 'static> Deref for Buffer<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.data
    }
}

impl<T: Send + 'static> DerefMut for Buffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.data
    }
}
