//! ZeRO-Offload: this rank's master weights and AdamW moments kept in host
//! memory, the update computed there by a worker thread while the next
//! step's forward already runs.
//!
//! The worker updates the shard front to back in chunks and publishes how
//! far it has got. The flat vector follows the order the model visits its
//! parameters, which is the order its forward uses them, so the first
//! layers' values are ready first: a gather of a sub-module's parameters
//! waits only until the worker has passed this rank's pieces of them, then
//! copies those rows to the device. Nothing reads a value before its update
//! is complete, so the result is bit for bit that of the update made in
//! place on the device.

use parking_lot::{Condvar, Mutex};
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tessera_core::ops::{self, AdamWStep};
use tessera_core::tensor::Tensor;
use tessera_core::{Error, Result};

/// Elements of the shard the worker updates between two progress reports:
/// small enough that the first layers are ready soon, large enough that the
/// per-chunk overhead is noise.
const CHUNK: usize = 1 << 16;

/// One AdamW update of a shard held in host memory, under way on a worker
/// thread.
pub(super) struct HostUpdate {
    progress: Arc<Progress>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// When the update started.
    started: Instant,
}

/// How far the worker has got, behind a lock the waiters sleep on.
struct Progress {
    done: Mutex<Done>,
    moved: Condvar,
    /// Time the engine's callers spent blocked on the update.
    waited: Mutex<Duration>,
}

struct Done {
    /// Elements of the shard updated, from its start.
    upto: usize,
    /// When the worker finished (or failed).
    finished: Option<Instant>,
    /// The worker's failure, handed to the first caller that waits.
    error: Option<Error>,
    failed: bool,
}

/// What the worker updates: each tensor lies in host memory and has the
/// shard's length.
pub(super) struct UpdateJob {
    pub(super) step: AdamWStep,
    /// The master copy, updated in place.
    pub(super) master: Tensor,
    pub(super) grad: Tensor,
    pub(super) m: Tensor,
    pub(super) v: Tensor,
    /// Where the shard's pieces end (in shard coordinates, ascending): a
    /// chunk never spans two parameters' pieces, so a parameter is ready as
    /// soon as its own chunks are.
    pub(super) boundaries: Vec<usize>,
}

impl UpdateJob {
    /// The chunks of the shard, in order: the pieces cut at `boundaries`,
    /// and each cut again into at most [`CHUNK`] elements.
    fn chunks(&self) -> Vec<Range<usize>> {
        let len = self.master.elem_count();
        let mut out = Vec::new();
        let mut at = 0;
        for end in self.boundaries.iter().copied().filter(|&b| b > 0 && b < len).chain([len]) {
            while at < end {
                let stop = (at + CHUNK).min(end);
                out.push(at..stop);
                at = stop;
            }
        }
        out
    }

    fn run(&self, progress: &Progress) -> Result<()> {
        for chunk in self.chunks() {
            let cut = |t: &Tensor| t.narrow(0, chunk.start, chunk.len());
            ops::adamw_update(&self.step, &cut(&self.master)?, &cut(&self.grad)?, &cut(&self.m)?, &cut(&self.v)?)?;
            progress.done.lock().upto = chunk.end;
            progress.moved.notify_all();
        }
        Ok(())
    }
}

impl HostUpdate {
    /// Starts `job` on a worker thread.
    pub(super) fn start(job: UpdateJob) -> Result<Self> {
        let progress = Arc::new(Progress {
            done: Mutex::new(Done { upto: 0, finished: None, error: None, failed: false }),
            moved: Condvar::new(),
            waited: Mutex::new(Duration::ZERO),
        });
        let shared = progress.clone();
        let started = Instant::now();
        let thread = std::thread::Builder::new()
            .name("zero-offload".into())
            .spawn(move || {
                let r = job.run(&shared);
                // The host copy of the gradients goes as soon as it is used.
                drop(job);
                let mut done = shared.done.lock();
                done.finished = Some(Instant::now());
                if let Err(e) = r {
                    done.error = Some(e);
                    done.failed = true;
                }
                drop(done);
                shared.moved.notify_all();
            })
            .map_err(|source| Error::Thread { what: "ZeRO-Offload host update", source })?;
        Ok(HostUpdate { progress, thread: Some(thread), started })
    }

    /// Waits until the first `upto` elements of the shard are updated.
    pub(super) fn wait_for(&self, upto: usize) -> Result<()> {
        let mut done = self.progress.done.lock();
        if done.upto < upto && !done.failed && done.finished.is_none() {
            let since = Instant::now();
            while done.upto < upto && !done.failed && done.finished.is_none() {
                self.progress.moved.wait(&mut done);
            }
            // Blocked until the update finished at the latest: the time
            // the update was not hidden, never more than it ran.
            let now = Instant::now();
            let end = done.finished.map_or(now, |f| f.min(now));
            *self.progress.waited.lock() += end.saturating_duration_since(since);
        }
        if done.failed {
            return Err(done.error.take().unwrap_or_else(|| {
                Error::state_mismatch("Zero", "the host update of the optimizer failed earlier (its error was reported then); restore a checkpoint")
            }));
        }
        Ok(())
    }

    /// Waits for the whole update; returns how long it ran and how long
    /// callers were blocked on it.
    pub(super) fn finish(mut self) -> Result<(Duration, Duration)> {
        self.wait_for(usize::MAX)?;
        if let Some(t) = self.thread.take() {
            t.join().map_err(|_| Error::state_mismatch("Zero", "the ZeRO-Offload worker thread panicked; its message is printed above"))?;
        }
        let finished = self.progress.done.lock().finished.unwrap_or_else(Instant::now);
        Ok((finished - self.started, *self.progress.waited.lock()))
    }
}

impl Drop for HostUpdate {
    fn drop(&mut self) {
        // Never leave the worker writing to state nobody holds any more.
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
