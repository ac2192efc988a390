//! The simulator: a schedule's stages run together in discrete time with
//! given costs, reporting busy time, idle time and the pipeline bubble.

use super::{replay, Action, Schedule};
use tessera_core::{Error, Result};

/// The cost of each action, in any unit of time (the trace reads it as µs).
///
/// Costs are per *chunk*: with `v` chunks per stage, a chunk's forward is
/// about `1/v` of a whole stage's. A whole backward costs `backward`; split
/// in two, its weight half costs `weight` and its input half the rest. Sends
/// cost the sender nothing (they do not wait); a tensor arrives `latency`
/// after it was sent, and a receive waits until then.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Costs {
    /// One chunk's forward on one microbatch.
    pub forward: f64,
    /// One chunk's whole backward on one microbatch.
    pub backward: f64,
    /// The weight-gradient part of `backward` (at most `backward`).
    pub weight: f64,
    /// From a send to the tensor's arrival at the receiver.
    pub latency: f64,
}

impl Costs {
    /// Forward and backward costs, with instant transfers and the
    /// backward's weight half taken as half of it (a layer of matrix
    /// products spends as much on `dX = dY·W` as on `dW = dYᵀ·X`).
    pub fn new(forward: f64, backward: f64) -> Self {
        Costs { forward, backward, weight: backward / 2.0, latency: 0.0 }
    }

    /// The same costs with transfers taking `latency`.
    pub fn with_latency(mut self, latency: f64) -> Self {
        self.latency = latency;
        self
    }

    /// The same costs with the backward's weight half taking `weight`.
    pub fn with_weight(mut self, weight: f64) -> Self {
        self.weight = weight;
        self
    }

    /// What the input half of a split backward costs: `backward − weight`.
    pub fn input(&self) -> f64 {
        self.backward - self.weight
    }

    fn validate(&self) -> Result<()> {
        for (name, x) in [("forward", self.forward), ("backward", self.backward), ("weight", self.weight), ("latency", self.latency)] {
            if !(x.is_finite() && x >= 0.0) {
                return Err(Error::invalid("Schedule::simulate", format!("the {name} cost is {x}; costs must be finite and at least 0")));
            }
        }
        if self.weight > self.backward {
            return Err(Error::invalid(
                "Schedule::simulate",
                format!("the weight half costs {} of a backward that costs {}; it is a part of the backward, at most all of it", self.weight, self.backward),
            ));
        }
        Ok(())
    }
}

/// One action of one stage, with when it started and ended. A receive's span
/// is the time its stage waited for the tensor (empty if it had arrived); a
/// send's span is empty.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Event {
    /// The stage that ran the action.
    pub stage: usize,
    /// The action.
    pub action: Action,
    /// When it started.
    pub start: f64,
    /// When it ended.
    pub end: f64,
}

/// One stage's totals over a simulated step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StageStats {
    /// Time spent computing forwards and backwards (or their halves).
    pub busy: f64,
    /// Time not computing within the makespan: waiting for tensors, and
    /// before the first and after the last computation.
    pub idle: f64,
    /// The most (microbatch, chunk) activations held at once.
    pub peak_in_flight: usize,
}

/// The outcome of [`Schedule::simulate`].
#[derive(Clone, Debug, PartialEq)]
pub struct Simulation {
    pub(super) name: String,
    pub(super) makespan: f64,
    pub(super) stages: Vec<StageStats>,
    pub(super) events: Vec<Event>,
}

impl Schedule {
    /// Runs the schedule with `costs`, after checking it as [`Schedule::check`] does.
    ///
    /// ```
    /// use tessera::parallel::pipeline::{gpipe, Costs};
    ///
    /// let sim = gpipe(2, 2)?.simulate(&Costs::new(1.0, 1.0))?;
    /// // stage 0: F0 F1 .  .  B0 B1
    /// // stage 1: .  F0 F1 B0 B1 .
    /// assert_eq!(sim.makespan(), 6.0);
    /// assert_eq!(sim.idle_time(), 4.0);
    /// # Ok::<(), tessera::Error>(())
    /// ```
    pub fn simulate(&self, costs: &Costs) -> Result<Simulation> {
        costs.validate()?;
        let run = replay::replay(self, costs)?;
        let makespan = run.finish.iter().copied().fold(0.0, f64::max);
        let stages =
            run.busy.iter().zip(self.peak_in_flight()).map(|(&busy, peak_in_flight)| StageStats { busy, idle: makespan - busy, peak_in_flight }).collect();
        Ok(Simulation { name: self.name().to_string(), makespan, stages, events: run.events })
    }
}

impl Simulation {
    /// The name of the schedule simulated.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// From the start to the end of the last action of any stage.
    pub fn makespan(&self) -> f64 {
        self.makespan
    }

    /// Per stage: busy and idle time, peak activations.
    pub fn stages(&self) -> &[StageStats] {
        &self.stages
    }

    /// Every action of every stage with its times, in the order they were replayed.
    pub fn events(&self) -> &[Event] {
        &self.events
    }

    /// Busy time summed over the stages.
    pub fn busy_time(&self) -> f64 {
        self.stages.iter().map(|s| s.busy).sum()
    }

    /// Idle time summed over the stages.
    pub fn idle_time(&self) -> f64 {
        self.stages.iter().map(|s| s.idle).sum()
    }

    /// The fraction of all stages' time spent idle: idle / (stages · makespan);
    /// 0 when nothing takes time.
    pub fn bubble_fraction(&self) -> f64 {
        let total = self.makespan * self.stages.len() as f64;
        if total > 0.0 {
            self.idle_time() / total
        } else {
            0.0
        }
    }
}
