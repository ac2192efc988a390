//! Communication threads ask the kernel to run them promptly.
//!
//! A collective started in the background runs on the communicator's thread
//! while the rank's own thread computes. Where the ranks' compute threads
//! already fill every core (CPU ranks, one per core), a communication thread
//! that wakes up has to wait for the scheduler to take a core from a
//! product, and under Linux's default slice (a few milliseconds) that can
//! be later than the product's end, when the rank waits for the collective
//! anyway: the overlap is lost. Since Linux 6.12 a thread may ask for a
//! shorter slice (`sched_setattr` with `sched_runtime` under the normal
//! policy), which gives it an earlier deadline and so the core soon after
//! it wakes, for a short time; its share of the processor is unchanged. A
//! communication thread mostly sleeps and runs in short bursts (a copy, a
//! sum), exactly the thread the shorter slice is for.
//!
//! The request needs no privilege and changes nothing else; where the
//! kernel does not know it (older kernels, other systems) it is ignored.

/// The slice asked for: the shortest Linux grants (0.1 ms).
#[cfg(target_os = "linux")]
const SLICE_NS: u64 = 100_000;

/// Asks for a short slice for the calling thread; best effort.
pub(crate) fn request() {
    #[cfg(target_os = "linux")]
    {
        let attr = libc::sched_attr {
            size: std::mem::size_of::<libc::sched_attr>() as u32,
            sched_policy: libc::SCHED_OTHER as u32,
            sched_flags: 0,
            sched_nice: 0,
            sched_priority: 0,
            sched_runtime: SLICE_NS,
            sched_deadline: 0,
            sched_period: 0,
        };
        // SAFETY: `sched_setattr(0, attr, 0)` reads `size` bytes of `attr`,
        // a live, initialised `sched_attr` whose `size` is its own, and
        // changes only the calling thread's scheduling. The result is
        // ignored on purpose: a kernel that refuses the slice leaves the
        // thread as it was, which is correct, only less prompt.
        let _ = unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &attr as *const libc::sched_attr, 0) };
    }
}
