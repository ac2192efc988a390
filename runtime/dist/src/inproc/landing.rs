//! The result buffer of one rank's all-reduce, which every rank of the group
//! writes its summed chunk into.
//!
//! An all-reduce must leave every rank with the whole sum in a buffer of its
//! own. Rank `r` sums chunk `r` of the inputs; if it kept the chunk in a
//! buffer of its own, every rank would then read every chunk back and write
//! it again (a second pass over the whole result). Instead each rank
//! allocates its result before the collective starts and shows it to its
//! peers, and rank `r` writes its summed chunk straight into all of them
//! while the chunk is still in its cache: each rank reads its share of the
//! inputs once and writes `S` bytes in all, what a plain copy of the result
//! would cost.

use crate::host;
use std::sync::Arc;
use tessera_core::backend::{CpuDevice, CpuStorage};
use tessera_core::tensor::{with_elem, DType, Element};

/// A rank's result buffer while its peers write into it.
///
/// Shared by `Arc`: the owner gets the storage back with [`finish`](Self::finish)
/// only once no peer holds a reference, so a peer that is still writing
/// (the owner gave up on a failed step) keeps the buffer alive instead of
/// writing into freed memory.
pub(crate) struct Landing {
    /// Never read or written through this field while the buffer is shared:
    /// every write goes through `base`.
    storage: CpuStorage,
    base: *mut u8,
    len: usize,
    dtype: DType,
}

// SAFETY: `base` points into `storage`'s heap allocation, which the Landing
// owns and which does not move or get freed while the Landing exists. The
// only accesses through it are `write`s of disjoint element ranges (each
// rank writes only the chunk it summed, and the chunks of an all-reduce do
// not overlap), and the owner reads the storage only after `finish`, when no
// other reference (hence no writer) remains; the board's mutex orders those
// writes before the owner's read.
unsafe impl Send for Landing {}
// SAFETY: as for `Send`: shared references only ever write disjoint ranges.
unsafe impl Sync for Landing {}

impl Landing {
    /// A result buffer of `len` elements of `dtype` on `dev`, its contents
    /// unspecified until every chunk is written.
    pub(crate) fn new(dev: &CpuDevice, dtype: DType, len: usize) -> Landing {
        let mut storage = with_elem!(dtype, T => CpuStorage::from_buffer(dev.buffer_for_overwrite::<T>(len)));
        let base = with_elem!(dtype, T => storage.as_mut_slice::<T>().expect("its own dtype").as_mut_ptr().cast::<u8>());
        Landing { storage, base, len, dtype }
    }

    /// Copies `src` to elements `at..at + src.len()`, past the caches when
    /// `stream` is set (see `host::streams`). Each element must be written
    /// by one rank only (see the `Sync` impl).
    pub(crate) fn write<T: Element>(&self, at: usize, src: &[T], stream: bool) {
        assert_eq!(T::DTYPE, self.dtype, "a landing is written in its own dtype");
        assert!(at + src.len() <= self.len, "write of {}..{} past a landing of {} elements", at, at + src.len(), self.len);
        // SAFETY: in bounds (checked above) and aligned (`base` is the
        // start of a `T` buffer); no other thread reads or writes these
        // elements while this borrow lives (see the `Sync` impl).
        let dst = unsafe { std::slice::from_raw_parts_mut(self.base.cast::<T>().add(at), src.len()) };
        host::store(src, dst, stream);
    }

    /// The storage, once this is the only reference (every peer has
    /// finished writing and dropped its own); the landing back otherwise.
    pub(crate) fn finish(this: Arc<Landing>) -> Result<CpuStorage, Arc<Landing>> {
        Arc::try_unwrap(this).map(|l| l.storage)
    }
}
