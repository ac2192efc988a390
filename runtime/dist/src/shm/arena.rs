//! The shared-memory arena a process rank's large tensors live in, and its
//! peers' view of it.
//!
//! A collective between processes that each keep their tensors on a
//! private heap must copy every input into shared memory and every result
//! out of it: twice the bytes a collective between threads moves. So a rank
//! of a job of processes allocates its large host buffers (see
//! [`HostArena`]) from an anonymous shared-memory file of its own, and its
//! peers on the node map that file: a collective then reads its peers'
//! inputs and writes their results where they are, and each rank moves what
//! it would if the ranks were threads.
//!
//! The file is large and sparse: its pages take memory only once written,
//! and freed blocks past what the device may cache are given back to the
//! operating system, so the arena costs what the tensors in it do.
//! Blocks are whole pages, handed out best-fit from the freed ones (kept in
//! memory first), then from the top of the file.

use super::sys;
use memmap2::{MmapOptions, MmapRaw};
use parking_lot::Mutex;
use std::any::Any;
use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tessera_core::backend::{CpuDevice, HostArena};

const PAGE: usize = 4096;

/// The most bytes an arena's file spans. The file is as large as the
/// machine's memory (a power of two, at most this): what a rank can hold in
/// shared memory at once (buffers past it come from the C allocator). Only
/// written pages take memory, but every peer maps every arena of the node,
/// so the size is kept to what can be used: 128 ranks on a 512 GiB machine
/// map 64 TiB of the 128 TiB address space.
const ARENA_BYTES: usize = 1 << 40;

/// An arena as its owner publishes it to its peers: the descriptor the file
/// is open as in the owner's process, and the file's size.
pub(crate) type Published = (i32, usize);

/// A process's arena: an anonymous shared-memory file, mapped.
pub(crate) struct ShmArena {
    file: File,
    map: MmapRaw,
    free: Mutex<FreeBlocks>,
    /// Bytes of freed blocks that are still in memory.
    cached: AtomicUsize,
}

impl std::fmt::Debug for ShmArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmArena").field("fd", &self.fd()).field("len", &self.map.len()).field("cached", &self.cached_bytes()).finish()
    }
}

/// The freed blocks, by offset and by size, those in memory apart from
/// those given back to the operating system; and where fresh blocks start.
#[derive(Default)]
struct FreeBlocks {
    /// Offset → (length, in memory).
    by_offset: BTreeMap<usize, (usize, bool)>,
    /// (length, offset) of the blocks in memory.
    kept: BTreeSet<(usize, usize)>,
    /// (length, offset) of the blocks given back.
    released: BTreeSet<(usize, usize)>,
    /// The end of the highest block ever handed out.
    top: usize,
}

impl FreeBlocks {
    fn sizes(&mut self, kept: bool) -> &mut BTreeSet<(usize, usize)> {
        if kept {
            &mut self.kept
        } else {
            &mut self.released
        }
    }

    /// The smallest freed block of at least `len` bytes, preferring those
    /// in memory; its unused tail stays free. Returns the offset and whether
    /// the block was in memory.
    fn take(&mut self, len: usize) -> Option<(usize, bool)> {
        for kept in [true, false] {
            if let Some(&(size, off)) = self.sizes(kept).range((len, 0)..).next() {
                self.sizes(kept).remove(&(size, off));
                self.by_offset.remove(&off);
                if size > len {
                    self.insert(off + len, size - len, kept);
                }
                return Some((off, kept));
            }
        }
        None
    }

    /// Frees `off..off + len`, joined with free neighbours in the same state.
    fn put(&mut self, mut off: usize, mut len: usize, kept: bool) {
        if let Some((&before, &(blen, bkept))) = self.by_offset.range(..off).next_back() {
            if before + blen == off && bkept == kept {
                self.remove(before);
                off = before;
                len += blen;
            }
        }
        if let Some(&(alen, akept)) = self.by_offset.get(&(off + len)) {
            if akept == kept {
                self.remove(off + len);
                len += alen;
            }
        }
        self.insert(off, len, kept);
    }

    fn insert(&mut self, off: usize, len: usize, kept: bool) {
        self.by_offset.insert(off, (len, kept));
        self.sizes(kept).insert((len, off));
    }

    fn remove(&mut self, off: usize) -> Option<(usize, bool)> {
        let (len, kept) = self.by_offset.remove(&off)?;
        self.sizes(kept).remove(&(len, off));
        Some((len, kept))
    }
}

impl ShmArena {
    /// A new arena, or `None` where the system has no anonymous shared
    /// memory (the device then keeps its heap, and collectives stage).
    fn create() -> Option<ShmArena> {
        #[cfg(target_os = "linux")]
        {
            let mut len = sys::physical_memory().max(1).next_power_of_two().clamp(1 << 30, ARENA_BYTES);
            // A smaller file where the address space is limited (`ulimit -v`).
            while len >= 1 << 30 {
                if let Ok(file) = sys::memfd(c"tessera-arena", len as u64) {
                    if let Ok(map) = MmapOptions::new().len(len).map_raw(&file) {
                        return Some(ShmArena { file, map, free: Mutex::default(), cached: AtomicUsize::new(0) });
                    }
                }
                len /= 4;
            }
            None
        }
        #[cfg(not(target_os = "linux"))]
        None
    }

    /// The arena of `device`: the one it has, or a new one it takes from
    /// now on. `None` if the device has an arena of another kind or the
    /// system cannot make one.
    pub(crate) fn of(device: &CpuDevice) -> Option<Arc<ShmArena>> {
        if device.arena().is_none() {
            if let Some(a) = Self::create() {
                // A racing thread may install its own first; either way the
                // device's arena is what counts.
                device.use_arena(Arc::new(a));
            }
        }
        let arena = device.arena()?.clone();
        let any: Arc<dyn Any + Send + Sync> = arena;
        any.downcast::<ShmArena>().ok()
    }

    /// The descriptor peers open the file through.
    pub(crate) fn fd(&self) -> i32 {
        use std::os::fd::AsRawFd;
        self.file.as_raw_fd()
    }

    /// The file's size.
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// The offset in the file of `bytes` bytes at `ptr`, if they lie in it.
    pub(crate) fn offset_of(&self, ptr: *const u8, bytes: usize) -> Option<u64> {
        let base = self.map.as_ptr() as usize;
        let at = (ptr as usize).checked_sub(base)?;
        (at.checked_add(bytes)? <= self.len()).then_some(at as u64)
    }
}

impl HostArena for ShmArena {
    fn alloc(&self, bytes: usize) -> Option<NonNull<u8>> {
        let len = bytes.max(1).next_multiple_of(PAGE);
        let mut free = self.free.lock();
        let off = match free.take(len) {
            Some((off, kept)) => {
                if kept {
                    self.cached.fetch_sub(len, Ordering::Relaxed);
                }
                off
            }
            None if free.top + len <= self.len() => {
                free.top += len;
                free.top - len
            }
            None => return None,
        };
        // SAFETY: `off + len` lies within the mapping (blocks are carved
        // from `0..len()`), whose base is not null.
        Some(unsafe { NonNull::new_unchecked(self.map.as_mut_ptr().add(off)) })
    }

    fn free(&self, block: NonNull<u8>, bytes: usize, headroom: usize) {
        let len = bytes.max(1).next_multiple_of(PAGE);
        let off = block.as_ptr() as usize - self.map.as_ptr() as usize;
        let keep = self.cached.load(Ordering::Relaxed) + len <= headroom;
        // A block that cannot be given back stays in memory: it is counted
        // as cached rather than lost.
        let kept = keep || sys::punch(&self.file, off as u64, len as u64).is_err();
        if kept {
            self.cached.fetch_add(len, Ordering::Relaxed);
        }
        self.free.lock().put(off, len, kept);
    }

    fn cached_bytes(&self) -> usize {
        self.cached.load(Ordering::Relaxed)
    }

    fn release_cached(&self) {
        let mut free = self.free.lock();
        for (len, off) in std::mem::take(&mut free.kept) {
            free.by_offset.remove(&off);
            if sys::punch(&self.file, off as u64, len as u64).is_ok() {
                self.cached.fetch_sub(len, Ordering::Relaxed);
                free.put(off, len, false);
            } else {
                free.insert(off, len, true);
            }
        }
    }
}

/// A peer's arena, mapped into this process.
pub(crate) struct PeerArena {
    map: MmapRaw,
}

impl PeerArena {
    /// Maps the arena that process `pid` holds open as descriptor `fd`,
    /// `len` bytes long; `None` if this process may not open it (another
    /// user's process, a restricted `/proc`): the group then stages.
    pub(crate) fn open(pid: u32, fd: i32, len: usize) -> Option<PeerArena> {
        let file = std::fs::OpenOptions::new().read(true).write(true).open(format!("/proc/{pid}/fd/{fd}")).ok()?;
        if file.metadata().ok()?.len() != len as u64 {
            return None;
        }
        let map = MmapOptions::new().len(len).map_raw(&file).ok()?;
        Some(PeerArena { map })
    }

    /// Elements `T` at byte `off` of the arena, `len` of them, if they lie
    /// within it and are aligned.
    ///
    /// # Safety
    ///
    /// The collective's protocol must give the caller these bytes: the
    /// owner does not write them (an input) or reads them only after the
    /// caller has signalled (a result, where each member writes a disjoint
    /// part), and keeps the block allocated until the last step.
    pub(crate) unsafe fn slice<T: bytemuck::Pod>(&self, off: u64, len: usize) -> Option<&[T]> {
        let ptr = self.check::<T>(off, len)?;
        // SAFETY: in bounds and aligned (checked); not written while the
        // borrow lives, by the caller's contract.
        Some(unsafe { std::slice::from_raw_parts(ptr, len) })
    }

    /// As [`slice`](Self::slice), to write.
    ///
    /// # Safety
    ///
    /// As for `slice`, and no one else reads or writes these elements while
    /// the borrow lives.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice_mut<T: bytemuck::Pod>(&self, off: u64, len: usize) -> Option<&mut [T]> {
        let ptr = self.check::<T>(off, len)? as *mut T;
        // SAFETY: in bounds and aligned (checked); exclusive, by the
        // caller's contract.
        Some(unsafe { std::slice::from_raw_parts_mut(ptr, len) })
    }

    fn check<T>(&self, off: u64, len: usize) -> Option<*const T> {
        let off = usize::try_from(off).ok()?;
        let end = len.checked_mul(std::mem::size_of::<T>())?.checked_add(off)?;
        if end > self.map.len() || !off.is_multiple_of(std::mem::align_of::<T>()) {
            return None;
        }
        // SAFETY: `off` is within the mapping (checked).
        Some(unsafe { self.map.as_ptr().add(off) }.cast())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freed_blocks_are_reused_best_fit_and_joined() {
        let mut f = FreeBlocks::default();
        f.put(0, 3 * PAGE, true);
        f.put(5 * PAGE, PAGE, true);
        // Best fit: the one-page block, not the three-page one.
        assert_eq!(f.take(PAGE), Some((5 * PAGE, true)));
        // The tail of a larger block stays free.
        assert_eq!(f.take(PAGE), Some((0, true)));
        assert_eq!(f.by_offset.get(&PAGE), Some(&(2 * PAGE, true)));
        // Neighbours join when in the same state, not across states.
        f.put(0, PAGE, true);
        assert_eq!(f.by_offset.get(&0), Some(&(3 * PAGE, true)));
        f.put(3 * PAGE, PAGE, false);
        assert_eq!(f.by_offset.len(), 2);
        // Blocks in memory are preferred; released ones serve when none fits.
        assert_eq!(f.take(PAGE), Some((0, true)));
        assert_eq!(f.take(2 * PAGE), Some((PAGE, true)));
        assert_eq!(f.take(PAGE), Some((3 * PAGE, false)));
        assert_eq!(f.take(PAGE), None);
    }

    #[test]
    fn a_device_with_an_arena_puts_large_buffers_in_it_and_reuses_them() {
        let dev = CpuDevice::new();
        let Some(arena) = ShmArena::of(&dev) else {
            eprintln!("skipped: no anonymous shared memory here");
            return;
        };
        let small = dev.buffer_for_overwrite::<f32>(16);
        assert!(!small.in_arena());
        let mut big = dev.buffer_zeros::<f32>(1 << 20);
        assert!(big.in_arena() && big.iter().all(|&x| x == 0.0));
        big[12345] = 7.0;
        let at = arena.offset_of(big.as_ptr().cast(), big.bytes()).expect("in the arena");
        // A peer's view of the same file sees the same bytes.
        let peer = PeerArena::open(std::process::id(), arena.fd(), arena.len()).expect("this process opens its own arena");
        // SAFETY: nothing writes `big` while the view is read.
        assert_eq!(unsafe { peer.slice::<f32>(at, 1 << 20) }.unwrap()[12345], 7.0);
        // SAFETY: past the end or misaligned: refused, nothing read.
        assert!(unsafe { peer.slice::<f32>(arena.len() as u64 - 4, 2) }.is_none());
        assert!(unsafe { peer.slice::<f32>(at + 2, 1) }.is_none());
        let bytes = big.bytes();
        drop(big);
        // Freed within the device's headroom: kept, and handed out again.
        assert_eq!(arena.cached_bytes(), bytes);
        let again = dev.buffer_for_overwrite::<f32>(1 << 20);
        assert_eq!(arena.offset_of(again.as_ptr().cast(), again.bytes()), Some(at));
        assert_eq!(arena.cached_bytes(), 0);
        drop(again);
        dev.empty_cache();
        assert_eq!(arena.cached_bytes(), 0);
        // Released pages read as zeros.
        let fresh = dev.buffer_for_overwrite::<f32>(1 << 20);
        assert_eq!(fresh[12345], 0.0);
    }
}
