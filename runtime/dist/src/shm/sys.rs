//! The operating-system calls of shared memory: waiting on a word of a
//! shared mapping (a process-shared futex), whether a process is alive,
//! reserving a file's memory, and what tells this node from another.

use std::fs::File;
use std::io;
use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// Sleeps until another process (or thread) calls [`wake`] on `word`, at
/// most `timeout`; returns at once when `word` no longer holds `seen`, so a
/// change made between the caller's check and this call is never missed.
/// May also return early (a signal, a spurious wake-up): callers re-check.
pub(super) fn wait(word: &AtomicU32, seen: u32, timeout: Duration) {
    #[cfg(target_os = "linux")]
    {
        let ts = libc::timespec { tv_sec: timeout.as_secs().min(i32::MAX as u64) as libc::time_t, tv_nsec: timeout.subsec_nanos() as libc::c_long };
        // SAFETY: `word` is a live, aligned 32-bit word, and `ts` a valid
        // timespec; FUTEX_WAIT only reads both. Without FUTEX_PRIVATE_FLAG
        // the futex is keyed by the physical page, so waiters and wakers in
        // different processes mapping the same file meet.
        unsafe {
            libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAIT, seen, &ts as *const libc::timespec, std::ptr::null::<u32>(), 0);
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (word, seen);
        std::thread::sleep(timeout.min(Duration::from_micros(200)));
    }
}

/// Wakes every waiter of `word` (see [`wait`]).
pub(super) fn wake(word: &AtomicU32) {
    #[cfg(target_os = "linux")]
    // SAFETY: as in `wait`; FUTEX_WAKE reads nothing but the word's address.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX, std::ptr::null::<libc::timespec>(), std::ptr::null::<u32>(), 0);
    }
    #[cfg(not(target_os = "linux"))]
    let _ = word;
}

/// Whether process `pid` still runs: it exists, and is not a zombie (a
/// process that exited but that its parent has not reaped yet still
/// exists for `kill`).
pub(super) fn alive(pid: u32) -> bool {
    let Ok(pid) = i32::try_from(pid) else { return false };
    // SAFETY: signal 0 sends nothing; `kill` only checks that the process
    // exists and may be signalled.
    let r = unsafe { libc::kill(pid, 0) };
    if r != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) {
        return false;
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state is the first field after the command name, which is in
        // parentheses and may itself contain them.
        Ok(stat) => !matches!(stat.rsplit_once(')').and_then(|(_, rest)| rest.trim_start().chars().next()), Some('Z' | 'X' | 'x')),
        Err(e) => e.kind() != io::ErrorKind::NotFound,
    }
}

/// Reserves `len` bytes of memory for `file` (on tmpfs: allocates its
/// pages), so that running out of memory is an error now rather than a
/// `SIGBUS` when a page is first written.
pub(super) fn reserve(file: &File, len: u64) -> io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        let len = libc::off_t::try_from(len).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "segment too large"))?;
        // SAFETY: the descriptor is open for writing for the duration of the
        // call; posix_fallocate touches nothing in this process's memory.
        let r = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) };
        match r {
            0 => Ok(()),
            // Filesystems without fallocate: the pages come on first write.
            libc::EOPNOTSUPP | libc::ENOSYS | libc::EINVAL => Ok(()),
            e => Err(io::Error::from_raw_os_error(e)),
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (file, len);
        Ok(())
    }
}

/// What processes that can share memory with this one have in common, and
/// processes elsewhere do not: the running kernel (its boot id), the host
/// name, the shared-memory directory itself (a container usually has its
/// own), and the process-id namespace (so that one process's ids mean the
/// same to the others).
pub(super) fn node_identity(dir: &std::path::Path) -> String {
    let read = |p: &str| std::fs::read_to_string(p).map(|s| s.trim().to_string()).unwrap_or_default();
    let ns = std::fs::read_link("/proc/self/ns/pid").map(|p| p.display().to_string()).unwrap_or_default();
    let shm = {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(dir).map(|m| format!("{}:{}", m.dev(), m.ino())).unwrap_or_default()
    };
    format!("{}|{}|{}|{}", read("/proc/sys/kernel/random/boot_id"), read("/proc/sys/kernel/hostname"), shm, ns)
}

/// The process-id namespace's identity, which names this node's segments:
/// only processes that see the same process ids clean up each other's.
pub(super) fn pid_namespace() -> String {
    std::fs::read_link("/proc/self/ns/pid").map(|p| p.display().to_string()).unwrap_or_default()
}

/// A new anonymous shared-memory file of `len` bytes (none of them in
/// memory yet), which other processes of the same user open through
/// `/proc/<pid>/fd/<fd>`.
#[cfg(target_os = "linux")]
pub(super) fn memfd(name: &std::ffi::CStr, len: u64) -> io::Result<File> {
    use std::os::fd::FromRawFd;
    // SAFETY: `name` is a valid C string; the call creates a descriptor and
    // touches nothing else.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and is owned by nothing else.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(len)?;
    Ok(file)
}

/// Gives the memory behind bytes `off..off + len` of `file` back to the
/// operating system; they read as zeros afterwards, and take memory again
/// when written.
#[cfg(target_os = "linux")]
pub(super) fn punch(file: &File, off: u64, len: u64) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let (off, len) = (off as libc::off_t, len as libc::off_t);
    // SAFETY: the descriptor is open for writing for the duration of the
    // call; the kernel frees the file's pages in the range, which mappings
    // then see as zero pages, and touches nothing else of this process.
    let r = unsafe { libc::fallocate(file.as_raw_fd(), libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, off, len) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Bytes of physical memory of the machine (0 if unknown).
#[cfg(target_os = "linux")]
pub(super) fn physical_memory() -> usize {
    // SAFETY: sysconf only reads system constants.
    let (pages, page) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
    usize::try_from(pages).unwrap_or(0).saturating_mul(usize::try_from(page).unwrap_or(0))
}
