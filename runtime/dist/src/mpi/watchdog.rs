//! The deadline of every blocking MPI call of this process.
//!
//! A blocked MPI call cannot be cancelled or timed out: `MPI_Allreduce`
//! returns when every rank has joined, and a rank that never joins keeps it
//! waiting forever. So every blocking call registers here while it runs,
//! and one thread per process looks at the oldest: when it has waited past
//! the world's timeout, the thread prints what was waited for and aborts the
//! job (`MPI_Abort` from another thread is allowed at
//! `MPI_THREAD_MULTIPLE`), which the launcher turns into the end of every
//! rank. That keeps the communicator interface's rule that no call waits
//! forever, at the cost MPI imposes: the job ends instead of returning an
//! error.

use parking_lot::{Condvar, Mutex};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};
use tessera_core::{Error, Result};

/// A call in progress.
struct Open {
    since: Instant,
    op: &'static str,
    group: Arc<str>,
}

#[derive(Default)]
struct State {
    next: u64,
    /// Calls in progress by registration order, so the first is the oldest.
    open: BTreeMap<u64, Open>,
    stop: bool,
}

struct Inner {
    state: Mutex<State>,
    wake: Condvar,
    timeout: Duration,
}

/// The deadlines of this process's blocking calls, and the thread that
/// enforces them.
pub(super) struct Watchdog {
    inner: Arc<Inner>,
    thread: Option<JoinHandle<()>>,
}

/// A registered call: dropping it (when the call returns) unregisters it.
pub(super) struct Watched<'a> {
    inner: &'a Inner,
    id: u64,
}

impl Watchdog {
    /// Starts the thread that aborts the job when a call of world rank
    /// `rank` outlasts `timeout`.
    pub(super) fn start(rank: usize, timeout: Duration) -> Result<Watchdog> {
        let inner = Arc::new(Inner { state: Mutex::default(), wake: Condvar::new(), timeout });
        let watcher = inner.clone();
        let thread = thread::Builder::new()
            .name(format!("tessera-mpi-watchdog-{rank}"))
            .spawn(move || watcher.run())
            .map_err(|source| Error::Thread { what: "the MPI timeout watchdog", source })?;
        Ok(Watchdog { inner, thread: Some(thread) })
    }

    /// Registers a blocking call of `op` on `group` until the guard drops.
    pub(super) fn watch(&self, op: &'static str, group: &Arc<str>) -> Watched<'_> {
        let mut s = self.inner.state.lock();
        let id = s.next;
        s.next += 1;
        s.open.insert(id, Open { since: Instant::now(), op, group: group.clone() });
        Watched { inner: &self.inner, id }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.inner.state.lock().stop = true;
        self.inner.wake.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Watched<'_> {
    fn drop(&mut self) {
        self.inner.state.lock().open.remove(&self.id);
    }
}

impl Inner {
    fn run(&self) {
        // Registering does not wake this thread (that would cost every call
        // a wake-up); it looks every eighth of the timeout instead, so a
        // call is aborted at most that much past its deadline.
        let period = (self.timeout / 8).max(Duration::from_millis(10));
        let mut s = self.state.lock();
        loop {
            if s.stop {
                return;
            }
            let now = Instant::now();
            let mut next = now + period;
            if let Some(oldest) = s.open.values().next() {
                let waited = now.saturating_duration_since(oldest.since);
                if waited >= self.timeout {
                    let reason = format!(
                        "it waited {waited:.1?} in {} on group {}, past the timeout of {:?}: a peer never joined the call (it hangs, is stuck outside the collectives, or is far slower), or the ranks called collectives in different orders",
                        oldest.op, oldest.group, self.timeout
                    );
                    drop(s);
                    super::abort_job(&reason);
                }
                next = next.min(oldest.since + self.timeout);
            }
            self.wake.wait_until(&mut s, next);
        }
    }
}
