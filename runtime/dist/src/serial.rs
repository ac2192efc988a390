//! One rank's calls on a communicator, run in program order: on the calling
//! thread, or on a background thread for the `*_async` forms.
//!
//! Every backend whose collectives run on host threads (in-process, between
//! processes) needs the same rule: an asynchronous call takes its place in
//! the order when it is *called*, and a synchronous call issued while some
//! are still queued waits its turn behind them. [`Serial`] is that rule,
//! written once.

use crate::comm::Pending;
use crate::host_comm::HostCore;
use parking_lot::Mutex;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::{self, JoinHandle};
use tessera_core::{Error, Result};

/// Runs calls on a backend state `C` one at a time, in the order issued.
pub(crate) struct Serial<C> {
    core: Arc<C>,
    /// Held while a call runs: two calls never interleave their steps.
    exec: Arc<Mutex<()>>,
    /// Calls submitted to the background thread and not yet finished.
    outstanding: Arc<AtomicUsize>,
    worker: Mutex<Option<Worker>>,
    /// The world rank, named in errors and in the thread's name.
    rank: usize,
}

type Job = Box<dyn FnOnce() + Send>;

struct Worker {
    jobs: mpsc::Sender<Job>,
    thread: JoinHandle<()>,
}

impl<C: HostCore> Serial<C> {
    /// Calls on `core` for world rank `rank`; a call that panics on the
    /// background thread stops the job ([`HostCore::fail`]).
    pub(crate) fn new(core: C, rank: usize) -> Self {
        Serial { core: Arc::new(core), exec: Arc::default(), outstanding: Arc::default(), worker: Mutex::new(None), rank }
    }

    /// The backend state.
    pub(crate) fn core(&self) -> &C {
        &self.core
    }

    /// Runs `f` now on this thread, or behind the queued background calls.
    pub(crate) fn run<T: Send + 'static>(&self, op: &'static str, f: impl FnOnce(&C) -> Result<T> + Send + 'static) -> Result<T> {
        if self.outstanding.load(Ordering::Acquire) == 0 {
            let _turn = self.exec.lock();
            return f(&self.core);
        }
        self.submit(op, f)?.wait()
    }

    /// Queues `f` on the background thread, starting it if needed.
    pub(crate) fn submit<T: Send + 'static>(&self, op: &'static str, f: impl FnOnce(&C) -> Result<T> + Send + 'static) -> Result<Pending<T>> {
        let (done, pending) = Pending::channel(op, self.rank);
        let (core, exec, outstanding) = (self.core.clone(), self.exec.clone(), self.outstanding.clone());
        let job: Job = Box::new(move || {
            // Decremented even if `f` panics, so later calls do not queue
            // behind a call that will never finish.
            struct Finished(Arc<AtomicUsize>);
            impl Drop for Finished {
                fn drop(&mut self) {
                    self.0.fetch_sub(1, Ordering::AcqRel);
                }
            }
            let finished = Finished(outstanding);
            let result = {
                let _turn = exec.lock();
                f(&core)
            };
            drop(finished);
            done.complete(result);
        });
        let mut worker = self.worker.lock();
        if worker.is_none() {
            *worker = Some(self.start_worker()?);
        }
        self.outstanding.fetch_add(1, Ordering::AcqRel);
        if worker.as_ref().expect("started above").jobs.send(job).is_err() {
            self.outstanding.fetch_sub(1, Ordering::AcqRel);
            return Err(Error::PeerFailed { rank: self.rank, reason: format!("its communication thread has stopped, so {op} cannot start") });
        }
        Ok(pending)
    }

    fn start_worker(&self) -> Result<Worker> {
        let (jobs, queue) = mpsc::channel::<Job>();
        let core = self.core.clone();
        let thread = thread::Builder::new()
            .name(format!("tessera-comm-{}", self.rank))
            .spawn(move || {
                // Woken beside the rank's products, it should get a core at once.
                crate::short_slice::request();
                for job in queue {
                    // A panic inside a collective is a bug, but it must not
                    // leave the peers waiting: report it and keep serving, so
                    // the queued calls fail fast instead of never finishing.
                    if let Err(p) = catch_unwind(AssertUnwindSafe(job)) {
                        core.fail(format!("its communication thread panicked: {}", tessera_core::error::panic_message(p.as_ref())));
                    }
                }
            })
            .map_err(|source| Error::Thread { what: "background communication", source })?;
        Ok(Worker { jobs, thread })
    }

    /// Finishes the queued calls (each bounded by the backend's timeout)
    /// and stops the background thread.
    pub(crate) fn shut_down(&self) {
        if let Some(w) = self.worker.lock().take() {
            // Closing the queue lets the thread finish what was submitted
            // and exit.
            drop(w.jobs);
            let _ = w.thread.join();
        }
    }
}
