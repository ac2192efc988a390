//! An [`Engine`] on a thread of its own, serving many clients at once: what
//! a server puts between its connections and the engine.
//!
//! [`Driver::spawn`] builds the engine on the new thread (a GPU context
//! stays on the thread that made it) and runs steps while any request is
//! unfinished, sleeping when none is. A client [`submit`](Driver::submit)s a
//! prompt with a [`Sink`]: the sink hears whether the engine admitted the
//! request, then every step's output for it, the last one finished. A sink
//! whose receiver has gone cancels its request before the next step, so a
//! client that disconnects frees its sequence and its KV blocks.
//!
//! Admission is bounded: beyond [`DriverLimits::max_pending`] unfinished
//! requests, `submit` refuses at once with [`SubmitError::QueueFull`] (a
//! server's 429), rather than letting a queue grow without end. A failing
//! step fails the requests it held, each told why, and the engine goes on
//! with new ones; a panicking one stops the driver, and every waiting
//! client and every later `submit` is told the panic's message.
//!
//! [`Driver::spawn_tensor_parallel`] runs the engines of a tensor-parallel
//! group instead, one per rank thread, in lockstep (see [`lockstep`]): the
//! clients see one engine.
//!
//! ```
//! # use tessera::module::{self, Cx};
//! # use tessera::serve::driver::{Driver, DriverLimits, Event};
//! # use tessera::serve::engine::{Engine, EngineConfig};
//! # use tessera::serve::sampling::SamplingParams;
//! # use tessera_models::gpt2::{Gpt2, Gpt2Config};
//! let driver = Driver::spawn(
//!     || {
//!         let cx = Cx::new(tessera::Device::cpu());
//!         let model = module::build(Gpt2::new(&Gpt2Config::tiny(64, 16, 2, 1, 32)).expect("a valid config"), &cx)?;
//!         Engine::new(model, cx, EngineConfig::new(32))
//!     },
//!     DriverLimits::default(),
//! )?;
//! let (tx, rx) = std::sync::mpsc::channel();
//! driver.submit(vec![1, 2, 3], SamplingParams { max_tokens: 4, ..SamplingParams::greedy() }, tx)?;
//! let mut tokens = Vec::new();
//! for event in rx {
//!     match event {
//!         Event::Admitted(_) => {}
//!         Event::Rejected(e) => panic!("{e}"),
//!         Event::Output(out) => tokens.extend(out.tokens.iter().map(|t| t.id)),
//!     }
//! }
//! assert_eq!(tokens.len(), 4);
//! driver.shutdown(true)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TryRecvError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use tessera_core::{Error, Result};
use tessera_nn::module::{Module, Replicated, SplitHidden};

use crate::engine::{Engine, EngineStats, FinishReason, RequestId, RequestOutput};
use crate::sampling::SamplingParams;

pub mod lockstep;
use lockstep::Lockstep;

/// What the driver tells a request's [`Sink`], in this order: `Admitted` or
/// `Rejected` once, then (if admitted) outputs until one is finished.
#[derive(Debug)]
pub enum Event {
    /// The engine queued the request under this id.
    Admitted(RequestId),
    /// The engine refused the request (an empty or too long prompt, a token
    /// outside the vocabulary, bad sampling parameters, ...); nothing
    /// follows. The error names the problem and the fix.
    Rejected(Error),
    /// A step's output for the request; the last one has `finished` set.
    Output(RequestOutput),
}

/// Where a request's [`Event`]s go: a channel to the client that asked.
pub trait Sink: Send + 'static {
    /// Delivers `event`; `false` when the receiver has gone, which cancels
    /// the request.
    fn send(&mut self, event: Event) -> bool;

    /// Whether the receiver has gone, asked before each step so a client
    /// that left is cancelled even while its request produces nothing (a
    /// long prefill). A sink that cannot tell says `false`; `send` still
    /// finds out.
    fn is_closed(&self) -> bool {
        false
    }
}

impl Sink for mpsc::Sender<Event> {
    fn send(&mut self, event: Event) -> bool {
        mpsc::Sender::send(self, event).is_ok()
    }
}

/// Bounds on what a [`Driver`] takes in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DriverLimits {
    /// Requests submitted and not yet finished (waiting, running, or not yet
    /// seen by the engine) beyond which [`Driver::submit`] refuses.
    pub max_pending: usize,
}

impl Default for DriverLimits {
    fn default() -> Self {
        DriverLimits { max_pending: 256 }
    }
}

/// Why [`Driver::submit`] did not take a request.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SubmitError {
    /// Too many requests are unfinished; retry later.
    #[error("{limit} requests are already pending, the limit; retry when some have finished")]
    QueueFull {
        /// [`DriverLimits::max_pending`].
        limit: usize,
    },
    /// The driver is shutting down or has stopped; the reason says which.
    #[error("the engine is not taking requests: {reason}")]
    Stopped {
        /// Shutting down, or the failure that stopped it.
        reason: String,
    },
}

/// What the engine is doing, as of its last step: for metrics, health
/// checks and tests.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DriverState {
    /// Requests waiting for admission.
    pub waiting: usize,
    /// Requests admitted (prefilling or decoding).
    pub running: usize,
    /// KV cache blocks in all.
    pub kv_blocks: usize,
    /// KV cache blocks a new block can come from (free, or holding an
    /// evictable cached prefix).
    pub kv_blocks_available: usize,
    /// The engine's counts (steps, tokens, preemptions, ...).
    pub stats: EngineStats,
    /// Set once the driver has stopped: why.
    pub stopped: Option<String>,
}

/// Fixed facts of the engine a driver runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineInfo {
    /// The model's vocabulary.
    pub vocab: usize,
    /// Prompt plus output tokens a request may reach.
    pub max_model_len: usize,
}

enum Command {
    Submit { prompt: Vec<u32>, params: SamplingParams, sink: Box<dyn Sink> },
    Stop { drain: bool },
}

/// State shared by the driver's handle and its thread.
struct Shared {
    pending: AtomicUsize,
    state: Mutex<DriverState>,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, DriverState> {
        // A panic while holding the lock leaves plain counts behind: still usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The handle to an engine running on its own thread; see [the module](self).
/// Dropping it cancels every unfinished request and joins the thread.
pub struct Driver {
    commands: SyncSender<Command>,
    shared: Arc<Shared>,
    limits: DriverLimits,
    info: EngineInfo,
    thread: Option<JoinHandle<()>>,
}

impl Driver {
    /// Starts a thread, builds the engine there with `make`, and runs it.
    /// Returns `make`'s error if it fails.
    pub fn spawn<M, F>(make: F, limits: DriverLimits) -> Result<Driver>
    where
        M: Module<In = Replicated, Out = SplitHidden> + 'static,
        F: FnOnce() -> Result<Engine<M>> + Send + 'static,
    {
        Self::start(make, limits)
    }

    /// Runs the engines of a tensor-parallel group of `ranks` ranks as one:
    /// `make(rank)` builds rank `rank`'s engine on a thread of its own (its
    /// [`Cx`](tessera_nn::module::Cx) holding that rank's communicators), and
    /// every engine gets the same requests, cancellations and steps in the
    /// same order; clients hear rank 0's outputs. `abort(rank, reason)` stops
    /// the group's communication on behalf of a rank that failed, so that
    /// the others' collectives return instead of waiting for it.
    ///
    /// A failed build returns the first root cause (not another rank's
    /// failure to communicate with it). A failed step, on any rank, stops the
    /// driver like a panic does: the ranks' collectives are no longer in step.
    pub fn spawn_tensor_parallel<M, F, A>(ranks: usize, make: F, abort: A, limits: DriverLimits) -> Result<Driver>
    where
        M: Module<In = Replicated, Out = SplitHidden> + 'static,
        F: Fn(usize) -> Result<Engine<M>> + Send + Sync + 'static,
        A: Fn(usize, &str) + Send + Sync + 'static,
    {
        if ranks == 0 {
            return Err(Error::invalid("Driver::spawn_tensor_parallel", "0 ranks cannot run a model; give at least 1"));
        }
        Self::start(move || Lockstep::build(ranks, make, abort), limits)
    }

    /// Starts the driver's thread, builds the stepper there with `make`, and
    /// runs it.
    fn start<S, F>(make: F, limits: DriverLimits) -> Result<Driver>
    where
        S: Stepper + 'static,
        F: FnOnce() -> Result<S> + Send + 'static,
    {
        if limits.max_pending == 0 {
            return Err(Error::invalid("Driver::spawn", "max_pending is 0, so no request could ever run; allow at least 1"));
        }
        let shared = Arc::new(Shared { pending: AtomicUsize::new(0), state: Mutex::new(DriverState::default()) });
        // Commands are few and small; the bound only keeps a stalled engine
        // from queueing without limit (submit checks `pending` first anyway).
        let (commands, inbox) = mpsc::sync_channel(limits.max_pending + 16);
        let (ready_tx, ready) = mpsc::channel();
        let thread_shared = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("tessera-engine".into())
            .spawn(move || {
                let engine = match catch_unwind(AssertUnwindSafe(make)) {
                    Ok(Ok(engine)) => engine,
                    Ok(Err(e)) => return drop(ready_tx.send(Err(e))),
                    Err(panic) => {
                        return drop(ready_tx.send(Err(Error::invalid("Driver::spawn", format!("building the engine panicked: {}", panic_message(&panic))))))
                    }
                };
                let info = engine.info();
                let mut run = Run { engine, sinks: HashMap::new(), shared: thread_shared, stopping: None };
                run.publish();
                if ready_tx.send(Ok(info)).is_ok() {
                    run.serve(inbox);
                }
            })
            .map_err(|source| Error::Thread { what: "engine", source })?;
        let info = match ready.recv() {
            Ok(Ok(info)) => info,
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(e);
            }
            Err(_) => {
                let _ = thread.join();
                return Err(Error::invalid("Driver::spawn", "the engine's thread ended before the engine was built"));
            }
        };
        Ok(Driver { commands, shared, limits, info, thread: Some(thread) })
    }

    /// Queues `prompt` (token ids) with `params`; `sink` hears what follows
    /// (see [`Event`]). Refuses at once when the queue is full or the driver
    /// has stopped; whether the engine admits the request comes to the sink.
    pub fn submit(&self, prompt: Vec<u32>, params: SamplingParams, sink: impl Sink) -> std::result::Result<(), SubmitError> {
        if let Some(reason) = self.shared.state().stopped.clone() {
            return Err(SubmitError::Stopped { reason });
        }
        let limit = self.limits.max_pending;
        self.shared
            .pending
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < limit).then_some(n + 1))
            .map_err(|_| SubmitError::QueueFull { limit })?;
        self.commands.send(Command::Submit { prompt, params, sink: Box::new(sink) }).map_err(|_| {
            self.shared.pending.fetch_sub(1, Ordering::AcqRel);
            SubmitError::Stopped { reason: self.shared.state().stopped.clone().unwrap_or_else(|| "the engine's thread has ended".into()) }
        })
    }

    /// Requests submitted and not yet finished.
    pub fn pending(&self) -> usize {
        self.shared.pending.load(Ordering::Acquire)
    }

    /// The engine's state as of its last step.
    pub fn state(&self) -> DriverState {
        self.shared.state().clone()
    }

    /// The engine's vocabulary and context length.
    pub fn info(&self) -> EngineInfo {
        self.info
    }

    /// The limits the driver was started with.
    pub fn limits(&self) -> DriverLimits {
        self.limits
    }

    /// Stops taking requests and ends the thread: with `drain`, after every
    /// unfinished request has finished; without, by cancelling them (their
    /// sinks get a last output, [`FinishReason::Aborted`]). Returns the
    /// failure that stopped the engine earlier, if one did.
    pub fn shutdown(mut self, drain: bool) -> Result<()> {
        self.stop(drain);
        match self.shared.state().stopped.clone() {
            Some(reason) if reason != SHUT_DOWN => Err(Error::invalid("Driver::shutdown", reason)),
            _ => Ok(()),
        }
    }

    fn stop(&mut self, drain: bool) {
        let _ = self.commands.send(Command::Stop { drain });
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        self.stop(false);
    }
}

/// [`DriverState::stopped`] after a shutdown that was asked for.
const SHUT_DOWN: &str = "the driver was shut down";

/// What the driver's thread runs: one engine, or the engines of a
/// tensor-parallel group in [`Lockstep`].
trait Stepper {
    fn info(&self) -> EngineInfo;
    fn add_request(&mut self, prompt: Vec<u32>, params: SamplingParams) -> Result<RequestId>;
    fn abort(&mut self, id: RequestId);
    fn has_unfinished(&self) -> bool;
    fn step(&mut self) -> std::result::Result<Vec<RequestOutput>, StepFailure>;
    /// Writes the engine's counts into `state`.
    fn publish(&self, state: &mut DriverState);
}

/// How a step failed.
enum StepFailure {
    /// The requests the step held fail with this; the engine goes on.
    Requests(Error),
    /// The engine cannot go on: the driver stops with this reason.
    Fatal(String),
}

impl<M: Module<In = Replicated, Out = SplitHidden>> Stepper for Engine<M> {
    fn info(&self) -> EngineInfo {
        EngineInfo { vocab: self.vocab(), max_model_len: self.config().max_model_len }
    }

    fn add_request(&mut self, prompt: Vec<u32>, params: SamplingParams) -> Result<RequestId> {
        Engine::add_request(self, prompt, params)
    }

    fn abort(&mut self, id: RequestId) {
        Engine::abort(self, id);
    }

    fn has_unfinished(&self) -> bool {
        Engine::has_unfinished(self)
    }

    fn step(&mut self) -> std::result::Result<Vec<RequestOutput>, StepFailure> {
        match catch_unwind(AssertUnwindSafe(|| Engine::step(self))) {
            Ok(Ok(outputs)) => Ok(outputs),
            Ok(Err(e)) => Err(StepFailure::Requests(e)),
            Err(panic) => Err(StepFailure::Fatal(format!("the engine panicked: {}", panic_message(&panic)))),
        }
    }

    fn publish(&self, state: &mut DriverState) {
        let blocks = self.blocks();
        state.waiting = self.num_waiting();
        state.running = self.num_running();
        state.kv_blocks = blocks.num_blocks();
        state.kv_blocks_available = blocks.available_blocks();
        state.stats = self.stats().clone();
    }
}

/// The engine thread's side.
struct Run<S: Stepper> {
    engine: S,
    sinks: HashMap<RequestId, Box<dyn Sink>>,
    shared: Arc<Shared>,
    /// Set by a stop command: whether to let unfinished requests finish.
    stopping: Option<bool>,
}

impl<S: Stepper> Run<S> {
    fn serve(&mut self, inbox: Receiver<Command>) {
        loop {
            // Sleep while there is nothing to do; otherwise take what has come
            // in since the last step and step again.
            let idle = !self.engine.has_unfinished();
            if idle && self.stopping.is_some() {
                break;
            }
            if idle {
                match inbox.recv() {
                    Ok(command) => self.take(command),
                    Err(_) => break,
                }
            }
            loop {
                match inbox.try_recv() {
                    Ok(command) => self.take(command),
                    Err(TryRecvError::Empty) => break,
                    // The handle is gone without a stop: cancel what is left.
                    Err(TryRecvError::Disconnected) => {
                        self.take(Command::Stop { drain: false });
                        break;
                    }
                }
            }
            let gone: Vec<RequestId> = self.sinks.iter().filter(|(_, s)| s.is_closed()).map(|(&id, _)| id).collect();
            for id in gone {
                self.engine.abort(id);
            }
            if self.engine.has_unfinished() {
                match self.engine.step() {
                    Ok(outputs) => self.deliver(outputs),
                    Err(StepFailure::Requests(e)) => self.fail_all(&format!("the step failed: {e}")),
                    Err(StepFailure::Fatal(reason)) => {
                        // Stopped first: a client told of the failure that
                        // submits again is refused, not queued.
                        self.shared.state().stopped = Some(reason.clone());
                        self.fail_all(&reason);
                        self.publish();
                        return self.refuse_rest(inbox);
                    }
                }
            }
            self.publish();
        }
        self.shared.state().stopped = Some(SHUT_DOWN.into());
        self.publish();
        self.refuse_rest(inbox);
    }

    fn take(&mut self, command: Command) {
        match command {
            Command::Submit { prompt, params, mut sink } => {
                if self.stopping.is_some() {
                    self.finished_one();
                    sink.send(Event::Rejected(Error::invalid("Driver::submit", "the engine is shutting down; send the request elsewhere")));
                    return;
                }
                match self.engine.add_request(prompt, params) {
                    Ok(id) => {
                        if sink.send(Event::Admitted(id)) {
                            self.sinks.insert(id, sink);
                        } else {
                            self.engine.abort(id);
                            self.finished_one();
                        }
                    }
                    Err(e) => {
                        self.finished_one();
                        sink.send(Event::Rejected(e));
                    }
                }
            }
            Command::Stop { drain } => {
                self.stopping = Some(drain);
                if !drain {
                    let ids: Vec<RequestId> = self.sinks.keys().copied().collect();
                    for id in ids {
                        self.engine.abort(id);
                    }
                }
            }
        }
    }

    /// Hands each output to its request's sink; a finished request or a
    /// sink that has gone leaves (the latter cancelled).
    fn deliver(&mut self, outputs: Vec<RequestOutput>) {
        for out in outputs {
            let (id, finished) = (out.id, out.finished.is_some());
            // An output without a sink belongs to a request already failed
            // or cancelled here: nothing to tell anyone.
            let Some(mut sink) = self.sinks.remove(&id) else { continue };
            // A request's slot frees before its last event goes out, so a
            // client that has its answer can submit again at once.
            if finished {
                self.finished_one();
                sink.send(Event::Output(out));
            } else if sink.send(Event::Output(out)) {
                self.sinks.insert(id, sink);
            } else {
                self.finished_one();
                self.engine.abort(id);
            }
        }
    }

    /// Ends every request with `reason` (their sinks are told) and cancels
    /// them in the engine.
    fn fail_all(&mut self, reason: &str) {
        for (id, mut sink) in std::mem::take(&mut self.sinks) {
            self.engine.abort(id);
            self.finished_one();
            sink.send(Event::Output(RequestOutput { id, tokens: Vec::new(), text: String::new(), finished: Some(FinishReason::Error(reason.to_string())) }));
        }
    }

    /// After the loop: every submit still queued is refused with the reason.
    /// (One sent in the instant between this and the thread's end is
    /// dropped unanswered: its client sees its channel close.)
    fn refuse_rest(&mut self, inbox: Receiver<Command>) {
        let reason = self.shared.state().stopped.clone().unwrap_or_else(|| SHUT_DOWN.into());
        while let Ok(command) = inbox.try_recv() {
            if let Command::Submit { mut sink, .. } = command {
                self.finished_one();
                sink.send(Event::Rejected(Error::invalid("Driver::submit", reason.clone())));
            }
        }
    }

    fn finished_one(&self) {
        self.shared.pending.fetch_sub(1, Ordering::AcqRel);
    }

    fn publish(&self) {
        self.engine.publish(&mut self.shared.state());
    }
}

/// The message a panic carried, if it was a string.
fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| panic.downcast_ref::<String>().cloned()).unwrap_or_else(|| "(no message)".into())
}
