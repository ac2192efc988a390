//! Pipeline schedules as data, a checker that proves them sound, and a
//! simulator that costs them.
//!
//! A [`Schedule`] is, for every pipeline stage, the ordered list of
//! [`Action`]s that stage runs: forwards and backwards of (microbatch, chunk)
//! pairs, and the point-to-point transfers between stages. The same data is
//! run by an executor, proven deadlock-free by [`Schedule::check`], costed by
//! [`Schedule::simulate`] and drawn by [`Simulation::to_chrome_trace`].
//!
//! # Stages, chunks and virtual stages
//!
//! The model is cut into `stages · chunks` *virtual stages* (consecutive
//! ranges of layers, e.g. `Stack::stage_range(k, stages * chunks)`). Stage `s`
//! holds chunks `0..chunks`, and its chunk `c` is virtual stage
//! `c · stages + s`: with 4 stages and 2 chunks, stage 0 holds virtual stages
//! 0 and 4. So the data flows stage 0 → 1 → … → p−1 → 0 (next chunk) → … .
//! Without interleaving `chunks` is 1 and a virtual stage is a stage.
//!
//! # Semantics an executor must follow
//!
//! - A send does not wait for its receiver: it hands the tensor to the
//!   transport and the stage goes on (an asynchronous send whose buffer lives
//!   until the matching receive completes).
//! - A receive waits until its tensor has arrived.
//!
//! Under these rules a schedule that passes [`Schedule::check`] cannot
//! deadlock, whatever the relative speeds of the stages.
//!
//! ```
//! use tessera::parallel::pipeline::{one_f_one_b, Costs};
//!
//! let schedule = one_f_one_b(4, 8)?;
//! schedule.check()?;
//! let sim = schedule.simulate(&Costs::new(1.0, 2.0))?;
//! // 1F1B idles (p−1)/(m+p−1) of the time: 3/11.
//! assert!((sim.bubble_fraction() - 3.0 / 11.0).abs() < 1e-12);
//! # Ok::<(), tessera::Error>(())
//! ```

mod execute;
mod replay;
mod schedule;
mod simulate;
mod trace;

pub use execute::{layers_of, run_stage, sync_tied_grads, ActionSpan, StageReport};
pub use schedule::{gpipe, interleaved_one_f_one_b, one_f_one_b, zero_bubble_h1, ScheduleKind};
pub use simulate::{Costs, Event, Simulation, StageStats};

use std::fmt;
use tessera_core::{Error, Result};

/// One step of a stage's work.
///
/// `chunk` always names a chunk *of the stage running the action*: a
/// `SendActivation { chunk: c, .. }` sends the output of this stage's chunk
/// `c`; a `RecvActivation { chunk: c, .. }` receives the input of this stage's
/// chunk `c`; `SendGrad` sends the gradient of chunk `c`'s input back; and
/// `RecvGrad` receives the gradient of chunk `c`'s output. `to` and `from`
/// are stage indices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// Runs chunk `chunk`'s forward on `microbatch`, keeping what its backward needs.
    Forward {
        /// The microbatch it works on.
        microbatch: usize,
        /// The chunk (of this stage) it works on.
        chunk: usize,
    },
    /// Runs chunk `chunk`'s backward on `microbatch`, freeing what its forward kept.
    Backward {
        /// The microbatch it works on.
        microbatch: usize,
        /// The chunk (of this stage) it works on.
        chunk: usize,
    },
    /// The first half of a split backward (zero-bubble schedules): the
    /// gradient of chunk `chunk`'s input on `microbatch`, which the previous
    /// stage waits for. The weight gradients are put aside, with what they
    /// read, for the matching [`Action::BackwardWeight`].
    BackwardInput {
        /// The microbatch it works on.
        microbatch: usize,
        /// The chunk (of this stage) it works on.
        chunk: usize,
    },
    /// The second half of a split backward: the weight gradients its
    /// [`Action::BackwardInput`] put aside, which no other stage waits for,
    /// so a schedule can run them where a stage would otherwise idle.
    BackwardWeight {
        /// The microbatch it works on.
        microbatch: usize,
        /// The chunk (of this stage) it works on.
        chunk: usize,
    },
    /// Sends the output of chunk `chunk` on `microbatch` to stage `to`.
    SendActivation {
        /// The receiving stage.
        to: usize,
        /// The microbatch it works on.
        microbatch: usize,
        /// The chunk (of this stage) it works on.
        chunk: usize,
    },
    /// Receives the input of chunk `chunk` on `microbatch` from stage `from`.
    RecvActivation {
        /// The sending stage.
        from: usize,
        /// The microbatch it works on.
        microbatch: usize,
        /// The chunk (of this stage) it works on.
        chunk: usize,
    },
    /// Sends the gradient of chunk `chunk`'s input on `microbatch` to stage `to`.
    SendGrad {
        /// The receiving stage.
        to: usize,
        /// The microbatch it works on.
        microbatch: usize,
        /// The chunk (of this stage) it works on.
        chunk: usize,
    },
    /// Receives the gradient of chunk `chunk`'s output on `microbatch` from stage `from`.
    RecvGrad {
        /// The sending stage.
        from: usize,
        /// The microbatch it works on.
        microbatch: usize,
        /// The chunk (of this stage) it works on.
        chunk: usize,
    },
}

impl Action {
    /// The microbatch the action works on.
    pub fn microbatch(&self) -> usize {
        match *self {
            Action::Forward { microbatch, .. }
            | Action::Backward { microbatch, .. }
            | Action::BackwardInput { microbatch, .. }
            | Action::BackwardWeight { microbatch, .. }
            | Action::SendActivation { microbatch, .. }
            | Action::RecvActivation { microbatch, .. }
            | Action::SendGrad { microbatch, .. }
            | Action::RecvGrad { microbatch, .. } => microbatch,
        }
    }

    /// The chunk (of the stage running the action) the action works on.
    pub fn chunk(&self) -> usize {
        match *self {
            Action::Forward { chunk, .. }
            | Action::Backward { chunk, .. }
            | Action::BackwardInput { chunk, .. }
            | Action::BackwardWeight { chunk, .. }
            | Action::SendActivation { chunk, .. }
            | Action::RecvActivation { chunk, .. }
            | Action::SendGrad { chunk, .. }
            | Action::RecvGrad { chunk, .. } => chunk,
        }
    }

    /// Whether the action computes (a forward, a backward or half of one) rather than communicates.
    pub fn is_compute(&self) -> bool {
        matches!(self, Action::Forward { .. } | Action::Backward { .. } | Action::BackwardInput { .. } | Action::BackwardWeight { .. })
    }

    /// Whether the action ends a unit's backward, freeing what its forward
    /// kept: a whole [`Action::Backward`] or an [`Action::BackwardWeight`].
    pub fn frees_activations(&self) -> bool {
        matches!(self, Action::Backward { .. } | Action::BackwardWeight { .. })
    }

    /// The other stage of a send or receive.
    pub fn peer(&self) -> Option<usize> {
        match *self {
            Action::SendActivation { to, .. } | Action::SendGrad { to, .. } => Some(to),
            Action::RecvActivation { from, .. } | Action::RecvGrad { from, .. } => Some(from),
            Action::Forward { .. } | Action::Backward { .. } | Action::BackwardInput { .. } | Action::BackwardWeight { .. } => None,
        }
    }
}

/// Short forms: `F3.1` (forward of microbatch 3, chunk 1), `B3.1`, its
/// halves `Bx3.1` (input gradient) and `Bw3.1` (weight gradients), `send-act 3.1 → 2`, `recv-act 3.1 ← 0`, `send-grad 3.1 → 0`, `recv-grad 3.1 ← 2`.
impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (mb, c) = (self.microbatch(), self.chunk());
        match *self {
            Action::Forward { .. } => write!(f, "F{mb}.{c}"),
            Action::Backward { .. } => write!(f, "B{mb}.{c}"),
            Action::BackwardInput { .. } => write!(f, "Bx{mb}.{c}"),
            Action::BackwardWeight { .. } => write!(f, "Bw{mb}.{c}"),
            Action::SendActivation { to, .. } => write!(f, "send-act {mb}.{c} → {to}"),
            Action::RecvActivation { from, .. } => write!(f, "recv-act {mb}.{c} ← {from}"),
            Action::SendGrad { to, .. } => write!(f, "send-grad {mb}.{c} → {to}"),
            Action::RecvGrad { from, .. } => write!(f, "recv-grad {mb}.{c} ← {from}"),
        }
    }
}

/// The work of every pipeline stage for one training step, in order.
///
/// Built by [`gpipe`], [`one_f_one_b`], [`interleaved_one_f_one_b`], [`zero_bubble_h1`] (or
/// [`ScheduleKind::build`]), or from hand-written actions by
/// [`Schedule::from_actions`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    name: String,
    stages: usize,
    microbatches: usize,
    chunks: usize,
    actions: Vec<Vec<Action>>,
}

impl Schedule {
    /// A schedule from hand-written per-stage actions, accepted only if
    /// [`Schedule::check`] passes.
    pub fn from_actions(name: impl Into<String>, microbatches: usize, chunks: usize, actions: Vec<Vec<Action>>) -> Result<Schedule> {
        validate("Schedule::from_actions", actions.len(), microbatches, chunks)?;
        let schedule = Schedule { name: name.into(), stages: actions.len(), microbatches, chunks, actions };
        schedule.check()?;
        Ok(schedule)
    }

    /// Built-in schedules are correct by construction (and tested), so they skip the check.
    fn new(name: &str, stages: usize, microbatches: usize, chunks: usize, actions: Vec<Vec<Action>>) -> Schedule {
        Schedule { name: name.to_string(), stages, microbatches, chunks, actions }
    }

    /// The schedule's name (`"1F1B"`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Number of pipeline stages (ranks along the pp axis).
    pub fn stages(&self) -> usize {
        self.stages
    }

    /// Number of microbatches per step.
    pub fn microbatches(&self) -> usize {
        self.microbatches
    }

    /// Model chunks per stage (1 unless interleaved).
    pub fn chunks(&self) -> usize {
        self.chunks
    }

    /// Number of virtual stages: `stages · chunks`.
    pub fn virtual_stages(&self) -> usize {
        self.stages * self.chunks
    }

    /// The virtual stage of `stage`'s chunk `chunk`: `chunk · stages + stage`.
    pub fn virtual_stage(&self, stage: usize, chunk: usize) -> usize {
        chunk * self.stages + stage
    }

    /// The (stage, chunk) holding virtual stage `k`.
    pub fn placement(&self, k: usize) -> (usize, usize) {
        (k % self.stages, k / self.stages)
    }

    /// The actions of `stage`, in the order it runs them (empty past the last stage).
    pub fn actions(&self, stage: usize) -> &[Action] {
        self.actions.get(stage).map_or(&[], Vec::as_slice)
    }

    /// The actions of every stage.
    pub fn all_actions(&self) -> &[Vec<Action>] {
        &self.actions
    }

    /// Proves the schedule sound: every (microbatch, chunk) is forwarded once
    /// and then backwarded once on every stage (whole, or input half then
    /// weight half); every compute has its input
    /// (received, or produced locally by the previous chunk) before it runs;
    /// every send names the stage that consumes its tensor and is received
    /// exactly once; and running the stages together under the
    /// [executor's rules](self#semantics-an-executor-must-follow) cannot
    /// deadlock. The error names the stage, the action and the fix.
    pub fn check(&self) -> Result<()> {
        replay::replay(self, &Costs::new(0.0, 0.0)).map(|_| ())
    }

    /// The most (microbatch, chunk) activations each stage holds at once: those
    /// whose forward ran and whose backward has not (for a split backward,
    /// whose weight half has not: it reads the layers' inputs). With
    /// interleaving a unit is one chunk's activations, about a v-th of a
    /// whole stage's.
    ///
    /// ```
    /// use tessera::parallel::pipeline::{gpipe, one_f_one_b};
    ///
    /// assert_eq!(one_f_one_b(4, 8)?.peak_in_flight(), [4, 3, 2, 1]);
    /// assert_eq!(gpipe(4, 8)?.peak_in_flight(), [8, 8, 8, 8]);
    /// # Ok::<(), tessera::Error>(())
    /// ```
    pub fn peak_in_flight(&self) -> Vec<usize> {
        self.actions
            .iter()
            .map(|actions| {
                let (mut now, mut peak) = (0usize, 0usize);
                for a in actions {
                    if matches!(a, Action::Forward { .. }) {
                        now += 1;
                    } else if a.frees_activations() {
                        now = now.saturating_sub(1);
                    }
                    peak = peak.max(now);
                }
                peak
            })
            .collect()
    }
}

/// One line per stage with its computations, e.g. `stage 0: F0.0 F1.0 B0.0 …`
/// (communication is implied by the data flow and left out).
impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}: {} stages, {} microbatches, {} chunks", self.name, self.stages, self.microbatches, self.chunks)?;
        for (s, actions) in self.actions.iter().enumerate() {
            let line: Vec<String> = actions.iter().filter(|a| a.is_compute()).map(Action::to_string).collect();
            writeln!(f, "stage {s}: {}", line.join(" "))?;
        }
        Ok(())
    }
}

/// Every schedule needs at least one stage, microbatch and chunk.
fn validate(op: &'static str, stages: usize, microbatches: usize, chunks: usize) -> Result<()> {
    for (what, n, fix) in [
        ("stages", stages, "use 1 for no pipeline parallelism"),
        ("microbatches", microbatches, "split the batch into at least one microbatch"),
        ("chunks", chunks, "use 1 chunk per stage unless interleaving"),
    ] {
        if n == 0 {
            return Err(Error::schedule(op, format!("the number of {what} is 0; {fix}")));
        }
    }
    Ok(())
}
