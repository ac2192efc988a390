//! A file of the shared-memory directory mapped into this process, how
//! segments are named, created and found, and the removal of those left by
//! jobs that died.
//!
//! # Names
//!
//! Every file a job creates is named
//! `tessera-<ns>-<leader>-<job>-<what>`: `<ns>` the process-id namespace
//! (hashed), `<leader>` the process id of the job's lowest rank on this
//! node, `<job>` the job's id. A segment is removed from the directory as
//! soon as every process that needs it has mapped it (the mappings outlive
//! the name, and the memory goes when the last process unmaps it or
//! exits, however it ends), so a finished job leaves nothing behind. What a
//! job that died leaves (a segment some member never reached, a message
//! never received) is removed by the next job on the node: a file whose
//! leader no longer runs belongs to no live job.
//!
//! # Creation
//!
//! Any member may create a segment: each that finds no file builds a
//! complete one under a temporary name and links it to the final name, and
//! the first link wins (the others map the winner's). So a segment is
//! never seen half-initialised, and no member waits for another to create
//! it.

use super::sys;
use memmap2::MmapRaw;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

/// The prefix of every file Tessera creates in the shared-memory directory.
pub(super) const PREFIX: &str = "tessera-";

/// A file of the shared-memory directory, mapped.
pub(super) struct Segment {
    map: MmapRaw,
    path: PathBuf,
}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segment").field("path", &self.path).field("len", &self.map.len()).finish()
    }
}

/// Tells apart the temporary files of threads of one process that create
/// the same segment at once.
static TEMP: AtomicUsize = AtomicUsize::new(0);

impl Segment {
    /// The segment `name` of `len` bytes in `dir`: the existing file, or a
    /// new one that `init` fills in before any other process can see it.
    /// Returns whether this call created it.
    ///
    /// `init` runs on every file this call builds: a build that loses the
    /// race to link its file is retried when the winner's file is already
    /// gone again (its members attached and removed its name), and the
    /// retry's file must be filled in as well.
    pub(super) fn create_or_open(dir: &Path, name: &str, len: usize, init: impl Fn(&Segment)) -> io::Result<(Segment, bool)> {
        let path = dir.join(name);
        loop {
            match Self::open(&path, len) {
                Ok(s) => return Ok((s, false)),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
            let tmp = dir.join(format!("{name}.{}.{}.tmp", std::process::id(), TEMP.fetch_add(1, Ordering::Relaxed)));
            let built = Self::build(&tmp, len).and_then(|seg| {
                init(&seg);
                std::fs::hard_link(&tmp, &path)?;
                Ok(Segment { path: path.clone(), ..seg })
            });
            let _ = std::fs::remove_file(&tmp);
            match built {
                Ok(seg) => return Ok((seg, true)),
                // Another member linked its file first: map that one.
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// A new file at `path` of `len` bytes, its memory reserved, mapped.
    pub(super) fn build(path: &Path, len: usize) -> io::Result<Segment> {
        let file = OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(path)?;
        file.set_len(len as u64)?;
        sys::reserve(&file, len as u64)?;
        Self::map(&file, path)
    }

    /// The existing file at `path`, which must be `len` bytes long.
    pub(super) fn open(path: &Path, len: usize) -> io::Result<Segment> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let got = file.metadata()?.len();
        if got != len as u64 {
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("{} is {got} bytes, not the {len} this job's segment has", path.display())));
        }
        Self::map(&file, path)
    }

    fn map(file: &File, path: &Path) -> io::Result<Segment> {
        let map = MmapRaw::map_raw(file)?;
        Ok(Segment { map, path: path.to_path_buf() })
    }

    /// Where the file is (or was, once removed).
    pub(super) fn path(&self) -> &Path {
        &self.path
    }

    /// Removes the file's name; the mapping stays valid.
    pub(super) fn unlink(&self) {
        let _ = std::fs::remove_file(&self.path);
    }

    /// The segment's size in bytes.
    pub(super) fn len(&self) -> usize {
        self.map.len()
    }

    fn check(&self, off: usize, len: usize, align: usize) {
        assert!(off.checked_add(len).is_some_and(|end| end <= self.len()), "access of {len} bytes at {off} past a segment of {}", self.len());
        assert!(off.is_multiple_of(align), "misaligned access at {off}");
    }

    /// The 32-bit word at byte `off` (a multiple of 4).
    pub(super) fn u32(&self, off: usize) -> &AtomicU32 {
        self.check(off, 4, 4);
        // SAFETY: in bounds and aligned (checked; the mapping starts on a
        // page); the mapping lives as long as `self`; every process accesses
        // the words of a segment's control areas only atomically.
        unsafe { AtomicU32::from_ptr(self.map.as_mut_ptr().add(off).cast()) }
    }

    /// The 64-bit word at byte `off` (a multiple of 8).
    pub(super) fn u64(&self, off: usize) -> &AtomicU64 {
        self.check(off, 8, 8);
        // SAFETY: as for `u32`.
        unsafe { AtomicU64::from_ptr(self.map.as_mut_ptr().add(off).cast()) }
    }

    /// The `len` bytes at `off`, to read.
    ///
    /// # Safety
    ///
    /// No process may write them while the borrow lives: the caller holds
    /// the protocol's guarantee (the writer published them before the
    /// caller's acquire of its signal, and writes them again only after the
    /// caller has signalled that it is done).
    pub(super) unsafe fn bytes(&self, off: usize, len: usize) -> &[u8] {
        self.check(off, len, 1);
        // SAFETY: in bounds (checked) and alive with `self`; no concurrent
        // writer, by the caller's contract.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(off), len) }
    }

    /// The `len` bytes at `off`, to write.
    ///
    /// # Safety
    ///
    /// No process may read or write them while the borrow lives: they are
    /// this process's own area, which the peers read only after it signals
    /// them, and not again until it has seen them signal back.
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn bytes_mut(&self, off: usize, len: usize) -> &mut [u8] {
        self.check(off, len, 1);
        // SAFETY: in bounds (checked) and alive with `self`; exclusive, by
        // the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr().add(off), len) }
    }
}

/// `n` rounded up to a multiple of `to` (a power of two).
pub(super) fn align_up(n: usize, to: usize) -> usize {
    (n + to - 1) & !(to - 1)
}

/// The first part of the name of every file of the job `job` whose leader
/// is process `leader`.
pub(super) fn job_prefix(ns: u32, leader: u32, job: u64) -> String {
    format!("{PREFIX}{ns:08x}-{leader}-{job:016x}-")
}

/// Removes the files of `dir` that jobs of this process-id namespace (`ns`)
/// left behind: those whose leader no longer runs. Returns how many.
pub(super) fn remove_stale(dir: &Path, ns: u32) -> usize {
    let mine = format!("{PREFIX}{ns:08x}-");
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    let mut removed = 0;
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(&mine)) else { continue };
        let Some(leader) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else { continue };
        if !sys::alive(leader) && std::fs::remove_file(e.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A build that loses the race to link its file, and finds the
    /// winner's file gone when it looks again, fills in its next file too
    /// (the first attempt's `init` is not the only one).
    #[test]
    fn a_retried_build_is_filled_in_too() {
        let dir = std::env::temp_dir().join(format!("tessera-segment-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let name = "retry";
        let path = dir.join(name);
        let _ = std::fs::remove_file(&path);
        let calls = AtomicUsize::new(0);
        let (seg, created) = Segment::create_or_open(&dir, name, 64, |s| {
            if calls.fetch_add(1, Ordering::Relaxed) == 0 {
                // A competitor links first (a name that opens as not found,
                // as a file already removed again would).
                std::os::unix::fs::symlink(dir.join("gone"), &path).unwrap();
            } else {
                std::fs::remove_file(&path).unwrap();
            }
            s.u64(0).store(0x5445_5353, Ordering::Release);
        })
        .unwrap();
        assert!(created);
        assert_eq!(calls.load(Ordering::Relaxed), 2, "the retry built and filled a second file");
        assert_eq!(seg.u64(0).load(Ordering::Acquire), 0x5445_5353, "the linked file is filled in");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
