//! Memory that a device's large host buffers can come from instead of the
//! C allocator.
//!
//! A rank that is a process of a multi-process job puts its tensors in a
//! shared-memory file that the other processes of its node map too (the
//! implementation lives with the shared-memory communicator): a collective
//! then reads its peers' inputs and writes their results in place, moving
//! each byte once, where a private heap would force a copy through a
//! staging area on the way in and another on the way out.

use std::any::Any;
use std::fmt;
use std::ptr::NonNull;

/// Buffers smaller than this never come from an arena: the C allocator
/// recycles them cheaply, and collectives stage them at little cost.
pub const MIN_ARENA_BYTES: usize = 64 << 10;

/// A source of host memory (its owner recognises its own kind by
/// upcasting to `Any`) for a [`CpuDevice`](super::CpuDevice)'s large
/// buffers (see [`CpuDevice::use_arena`](super::CpuDevice::use_arena)).
///
/// The device asks it for every buffer of at least [`MIN_ARENA_BYTES`] and
/// falls back to the C allocator when it answers `None`. A block's bytes
/// are whatever was last written there (buffers of plain numbers accept any
/// bytes); a buffer asked for zeroed is cleared by the device.
pub trait HostArena: Any + Send + Sync + fmt::Debug {
    /// A block of `bytes` bytes, aligned to 64 at least, that no one else
    /// uses until it is given back with [`free`](Self::free); `None` when
    /// the arena cannot hold it.
    fn alloc(&self, bytes: usize) -> Option<NonNull<u8>>;

    /// Gives back a block `alloc` returned for `bytes` bytes. The arena may
    /// keep it in memory for reuse while the bytes it keeps so stay within
    /// `headroom` (the device's budget for cached memory, as for its pool),
    /// and releases it to the operating system otherwise.
    fn free(&self, block: NonNull<u8>, bytes: usize, headroom: usize);

    /// Bytes of freed blocks the arena keeps in memory for reuse.
    fn cached_bytes(&self) -> usize;

    /// Releases every freed block it keeps to the operating system.
    fn release_cached(&self);
}
