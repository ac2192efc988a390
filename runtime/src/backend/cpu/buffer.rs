use crate::backend::memory::MemoryTracker;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

/// A host allocation whose bytes are counted by its device's [`MemoryTracker`]
/// from creation until drop. Every CPU tensor and every temporary an op needs
/// (half-precision conversions, saved statistics) lives in one.
pub struct Buffer<T> {
    data: Vec<T>,
    tracker: Arc<MemoryTracker>,
}

impl<T: Copy + Default> Buffer<T> {
    /// `len` default (zero) elements.
    pub(crate) fn zeros(len: usize, tracker: &Arc<MemoryTracker>) -> Self {
        Self::from_vec(vec![T::default(); len], tracker)
    }
}

impl<T> Buffer<T> {
    /// Takes ownership of `data` and counts its bytes.
    pub(crate) fn from_vec(data: Vec<T>, tracker: &Arc<MemoryTracker>) -> Self {
        tracker.on_alloc(Self::bytes_of(data.len()));
        Buffer { data, tracker: tracker.clone() }
    }

    fn bytes_of(len: usize) -> usize {
        len * std::mem::size_of::<T>()
    }

    /// Bytes counted for this buffer.
    pub fn bytes(&self) -> usize {
        Self::bytes_of(self.data.len())
    }
}

impl<T> Drop for Buffer<T> {
    fn drop(&mut self) {
        self.tracker.on_free(Self::bytes_of(self.data.len()));
    }
}

impl<T> Deref for Buffer<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.data
    }
}

impl<T> DerefMut for Buffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.data
    }
}
