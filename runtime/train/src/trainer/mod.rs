//! The training loop: a [`TrainConfig`] run on in-process CPU ranks.
//!
//! One thread per rank of the mesh (`dp × ep × pp × tp`). Each step, every
//! data replica draws `grad_accum` microbatches, the pipeline schedule runs
//! them (gradients accumulate), data-parallel buckets are all-reduced while
//! the backward still runs (or ZeRO reduce-scatters them), weights tied
//! across stages are summed, then, in order:
//!
//! 1. under fp16, the gradients are unscaled and checked: an overflow on any
//!    rank skips the step everywhere and backs the loss scale off;
//! 2. the global gradient norm is measured (each logical parameter once) and
//!    clipped;
//! 3. the [`StabilityMonitor`] judges the loss and the norm: a norm spike
//!    alone is recorded (clipping bounds the update); on a NaN or a loss
//!    spike the update is dropped and, with `stability.rollback`, every rank
//!    reloads the newest valid checkpoint that is not a resume point and
//!    passes over everything drawn since it for good
//!    ([`Batches::exclude_since`]), so the offending data is never seen
//!    again; the event is recorded;
//! 4. AdamW steps at the warmup-cosine learning rate.
//!
//! Every step appends a line to `metrics.jsonl` (written by whichever rank
//! reports last, with times as the maximum over ranks), before its
//! checkpoint; the first `run.trace_steps` steps are recorded in
//! `trace.json` (one track per rank); checkpoints are written every
//! `checkpoint.every` steps and at the end (a job that stops early writes a
//! resume point); `loss.png` plots the loss curve. Every checkpoint holds
//! the whole state of the run (see `run_state`), so a resumed run continues
//! bit for bit. A failure on any rank stops every rank, and the run returns
//! the first root cause; `[faults]` injects failures on purpose.

mod optimizer;
mod preflight;
mod rank;
mod report;
mod state;

use crate::ckpt::Checkpointer;
use crate::ranks::Ranks;
use crate::{Job, RunLock, TrainConfig};
use parking_lot::Mutex;
use rank::{RankRun, Shared};
use report::Collector;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tessera_core::error::panic_message;
use tessera_core::{Device, Error, Result};
use tessera_data::Batches;
use tessera_dist::mesh::{Axis, Mesh};
use tessera_nn::module::{Cx, Replicated, SplitHidden, Staged};
use tessera_observe::{Event, LinePlot, MetricsLog, PeakRate, Series, Trace, PALETTE};

/// Which data replica a [`Batches`] stream serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Replica {
    /// This replica, in `0..count`.
    pub index: usize,
    /// Replicas in all (data-parallel × expert-parallel ranks).
    pub count: usize,
}

/// What the program training a model tells the trainer about it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ModelFacts {
    /// Vocabulary size: the logits' last dimension, unsharded, padding included
    /// (a padded model's `padded_vocab()`, not its tokenizer's size).
    pub vocab: usize,
    /// Training FLOPs per token (see [`tessera_observe::transformer_flops_per_token`]).
    pub flops_per_token: f64,
}

/// What a finished run produced.
#[derive(Clone, Debug)]
pub struct RunSummary {
    /// The run directory.
    pub out: PathBuf,
    /// `(step, loss)` of every step taken (after rollbacks, the replayed steps too).
    pub losses: Vec<(u64, f64)>,
    /// The final checkpoint's directory.
    pub checkpoint: PathBuf,
    /// Events of the run (anomalies, rollbacks, overflows, checkpoints).
    pub events: Vec<(u64, Event)>,
    /// Mean training throughput over the run.
    pub tokens_per_s: f64,
    /// Wall time of the training loop.
    pub elapsed: Duration,
    /// The step the run started from (non-zero when it resumed).
    pub resumed_from: u64,
    /// Whether this process reported the run: always when ranks are
    /// threads; in a job of processes, rank 0 only. Only the primary's
    /// `losses`, `events` and throughput are filled.
    pub primary: bool,
}

impl RunSummary {
    /// What a program tells its user about a finished run of `steps`
    /// planned steps, a line each: whether it resumed (or had already
    /// finished), the loss from first to last step with the throughput, and
    /// every event worth a line (gradient-norm spikes, which clipping
    /// bounds, counted on one line; checkpoints left out).
    pub fn report_lines(&self, steps: u64) -> Vec<String> {
        let mut lines = Vec::new();
        if self.resumed_from >= steps {
            lines.push(format!("the run in {} already finished its {steps} steps (--fresh starts over)", self.out.display()));
        } else if self.resumed_from > 0 {
            lines.push(format!("resumed from the checkpoint of step {}", self.resumed_from));
        }
        if let (Some(first), Some(last)) = (self.losses.first(), self.losses.last()) {
            lines.push(format!(
                "loss {:.3} (step {}) -> {:.3} (step {}) in {:.1}s, {:.0} tokens/s",
                first.1,
                first.0,
                last.1,
                last.0,
                self.elapsed.as_secs_f64(),
                self.tokens_per_s
            ));
        }
        let mut norm_spikes = 0;
        for (step, e) in &self.events {
            match e {
                Event::Checkpoint { .. } => {}
                Event::Anomaly { detail } if detail.contains("gradient-norm spike") => norm_spikes += 1,
                Event::Anomaly { detail } => lines.push(format!("step {step}: anomaly: {detail}")),
                other => lines.push(format!("step {step}: {other:?}")),
            }
        }
        if norm_spikes > 0 {
            lines.push(format!("{norm_spikes} gradient-norm spikes recorded (clipped; see metrics.jsonl)"));
        }
        lines
    }
}

/// Builds a rank's model: `(cx, ep_rank, ep_degree) -> model`.
type BuildModel<'a, M> = Box<dyn Fn(&Cx, usize, usize) -> Result<M> + Sync + 'a>;
/// Opens a data replica's batch stream.
type OpenBatches<'a> = Box<dyn Fn(Replica) -> Result<Box<dyn Batches>> + Sync + 'a>;

/// Runs training as `config` says, on one thread per rank.
///
/// `build(cx, ep_rank, ep)` constructs the model (unmaterialised; the
/// trainer materialises it for each rank's shard); `batches(replica)` opens
/// a replica's data stream.
pub struct Trainer<'a, M> {
    config: TrainConfig,
    facts: ModelFacts,
    build: BuildModel<'a, M>,
    batches: OpenBatches<'a>,
    fresh: bool,
    /// The run directory's lock, when the caller took it already.
    lock: Mutex<Option<RunLock>>,
    /// Where the ranks live, when the caller made the job already.
    job: Option<Job>,
}

impl<'a, M: Staged<In = Replicated, Out = SplitHidden>> Trainer<'a, M> {
    /// A trainer for `config` (validated here).
    pub fn new(
        config: TrainConfig,
        facts: ModelFacts,
        build: impl Fn(&Cx, usize, usize) -> Result<M> + Sync + 'a,
        batches: impl Fn(Replica) -> Result<Box<dyn Batches>> + Sync + 'a,
    ) -> Result<Self> {
        config.validate()?;
        Ok(Trainer { config, facts, build: Box::new(build), batches: Box::new(batches), fresh: false, lock: Mutex::new(None), job: None })
    }

    /// Runs under `lock`, the run directory's lock the caller took before
    /// preparing what the run reads from the directory (data, say);
    /// otherwise [`run`](Self::run) takes it itself.
    pub fn with_run_lock(self, lock: RunLock) -> Self {
        *self.lock.lock() = Some(lock);
        self
    }

    /// Runs in `job`, which the caller made (with [`Job::for_config`]) to
    /// prepare what the run reads on one process first; otherwise
    /// [`run`](Self::run) makes it from the configuration and the
    /// environment.
    ///
    /// An elastic job on another number of processes than the mesh has runs
    /// the configuration [`Job::fit`] makes of it (checked again here).
    pub fn with_job(mut self, job: Job) -> Result<Self> {
        if job.resized().is_some() {
            let fitted = job.fit(&self.config);
            fitted.validate()?;
            self.config = fitted;
        }
        self.job = Some(job);
        Ok(self)
    }

    /// Starts over: the run deletes the checkpoints of earlier jobs in its
    /// directory before it begins (once it holds the directory's lock, so
    /// it never deletes those of a job still running).
    pub fn fresh(mut self, on: bool) -> Self {
        self.fresh = on;
        self
    }

    /// The configuration.
    pub fn config(&self) -> &TrainConfig {
        &self.config
    }

    /// What the run finds in its checkpoint directory before it starts, under
    /// the directory's lock: nothing is destroyed or skipped in silence.
    ///
    /// * Checkpoints it will not resume from (`checkpoint.resume = false`)
    ///   would be pruned away by its own saves: refused unless
    ///   [`fresh`](Self::fresh).
    /// * Checkpoints of which none can be loaded: refused unless `fresh`
    ///   (starting over would look like a resume gone wrong), with every
    ///   checkpoint's reason.
    /// * Damaged checkpoints newer than the one it resumes from are set aside
    ///   (renamed, never deleted; see [`Checkpointer::set_aside`]) and
    ///   reported on stderr; the events are returned for the first metrics line.
    fn inspect_checkpoints(&self, ckpt: &Checkpointer) -> Result<Vec<Event>> {
        let cfg = &self.config;
        if self.fresh {
            return Ok(Vec::new());
        }
        let root = ckpt.root().display().to_string();
        let steps = ckpt.steps()?;
        let scan = ckpt.scan()?;
        let damaged: Vec<&crate::ckpt::Skipped> = scan.skipped.iter().filter(|s| s.dir.is_dir()).collect();
        if !cfg.checkpoint.resume && !steps.is_empty() {
            let newest = steps.last().map(|(s, _)| *s).unwrap_or(0);
            return Err(Error::Checkpoint {
                path: root.to_string(),
                detail: format!("holds checkpoints of an earlier run (the newest of step {newest}) that this run would not resume from and would delete; resume from them (`checkpoint.resume = true`), start over with `--fresh`, or give this run another `run.out`"),
            });
        }
        if scan.valid.is_none() && !damaged.is_empty() {
            let why: Vec<String> = damaged.iter().map(|s| format!("  {}: {}", s.dir.display(), s.reason)).collect();
            return Err(Error::Checkpoint {
                path: root.to_string(),
                detail: format!(
                    "holds {} checkpoint(s) but none can be loaded:\n{}\nrepair or remove them, or start over with `--fresh` (which deletes them)",
                    damaged.len(),
                    why.join("\n")
                ),
            });
        }
        let mut events = Vec::new();
        for s in damaged {
            let reason = s.reason.to_string();
            let to = ckpt.set_aside(&s.dir, &reason)?;
            eprintln!("skipped the checkpoint {}: {reason}; set it aside as {}", s.dir.display(), to.display());
            events.push(Event::SetAside { dir: s.dir.display().to_string(), to: to.display().to_string(), reason });
        }
        Ok(events)
    }

    /// The checkpoint directory of this run.
    pub fn checkpoint_dir(&self) -> PathBuf {
        let dir = Path::new(&self.config.checkpoint.dir);
        if dir.is_absolute() {
            dir.to_path_buf()
        } else {
            Path::new(&self.config.run.out).join(dir)
        }
    }

    /// Trains; writes the run directory; returns what happened.
    ///
    /// Ranks run as threads of this process, or, in a job of processes
    /// (see [`Job`] and [`with_job`](Self::with_job)), this process runs its
    /// own rank: rank 0 alone opens the run directory (its lock, the
    /// configuration, earlier checkpoints) before the others start, and
    /// writes the metrics and plots from every rank's figures.
    pub fn run(&self) -> Result<RunSummary> {
        let cfg = &self.config;
        let out = PathBuf::from(&cfg.run.out);
        // Before the run directory is touched and any rank allocates: a run
        // that cannot work, or cannot fit, is refused here.
        let mesh = preflight::check(cfg, self.facts.vocab, &self.build)?;
        let job = match &self.job {
            Some(job) => job.clone(),
            None => {
                let job = Job::for_config(cfg)?;
                if let Some((dp, accum)) = job.resized() {
                    return Err(Error::config(
                        "mesh.elastic",
                        format!("this job of processes runs the mesh with dp{dp} and grad_accum {accum}; make the job first (`Job::for_config`) and give it to the trainer with `with_job`, which fits the configuration to it"),
                    ));
                }
                job
            }
        };
        let primary = job.is_primary();
        // Held until the run ends: one job per run directory.
        let opened = job.primary_first("opening the run directory", || {
            let lock = self.open_run_dir(&out)?;
            let (ckpt, carried, resume_step) = self.open_checkpoints(&mesh)?;
            Ok((lock, ckpt, carried, resume_step))
        })?;
        let (_lock, ckpt, carried, resume_step) = match opened {
            Some((lock, ckpt, carried, resume_step)) => (Some(lock), ckpt, carried, resume_step),
            None => {
                let ckpt = self.checkpointer(&mesh)?;
                let resume_step = self.resume_step(&ckpt)?;
                (None, ckpt, Vec::new(), resume_step)
            }
        };
        let world_size = mesh.world();
        let ranks = Ranks::new(cfg.mesh.rank_device()?, &mesh, cfg.mesh.timeout(), &job)?;
        if cfg.faults.any() && primary {
            eprintln!("fault injection is on: {}", cfg.faults.describe());
        }
        let tracks = (0..world_size)
            .map(|r| {
                let c = mesh.coords(r)?;
                Ok(format!("rank {r} (dp{} ep{} pp{} tp{})", c[Axis::Dp], c[Axis::Ep], c[Axis::Pp], c[Axis::Tp]))
            })
            .collect::<Result<Vec<_>>>()?;
        let trace = Trace::new(tracks);
        let collector = match primary {
            true => Some(Mutex::new(self.collector(&out, &ranks, carried, resume_step)?)),
            false => None,
        };
        let reports = job.process_job().map(|p| p.control.as_ref());

        let started = Instant::now();
        let shared = Shared { ranks: &ranks, mesh: &mesh, trace: &trace, ckpt: &ckpt, collector: collector.as_ref(), reports };
        let local = ranks.local(world_size);
        let results: Vec<Result<(u64, PathBuf)>> = std::thread::scope(|s| {
            let handles: Vec<_> = local
                .iter()
                .map(|&rank| {
                    let (ranks, shared) = (&ranks, &shared);
                    s.spawn(move || {
                        // A panic is caught so that it, too, aborts the rank's
                        // groups: NCCL peers would otherwise wait for it forever.
                        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| RankRun::setup(self, shared, rank)?.run()))
                            .unwrap_or_else(|panic| Err(Error::RankPanicked { rank, message: panic_message(panic.as_ref()) }));
                        // A rank killed on purpose tells no one, as a dead
                        // process could not: its peers must find out.
                        if let Err(e) = &r {
                            if !matches!(e, Error::FaultInjected { .. }) {
                                ranks.abort(rank, &e.to_string());
                            }
                        }
                        r
                    })
                })
                .collect();
            handles
                .into_iter()
                .zip(&local)
                .map(|(h, &rank)| h.join().unwrap_or_else(|panic| Err(Error::RankPanicked { rank, message: panic_message(panic.as_ref()) })))
                .collect()
        });
        let elapsed = started.elapsed();
        let (resumed_from, checkpoint) = first_root_cause(results)?;
        let (losses, events, tokens) = match collector {
            Some(c) => {
                let c = c.into_inner();
                c.bar.finish();
                (c.losses, c.events, c.tokens)
            }
            None => Default::default(),
        };
        if cfg.run.trace_steps > 0 {
            // Each process of a job of processes traced its own rank.
            job.gather_trace(&trace)?;
            // A run that had nothing left to do keeps the trace of the run that did.
            if primary && !trace.spans().is_empty() {
                trace.write(out.join("trace.json"))?;
            }
        }
        if !losses.is_empty() {
            LinePlot {
                title: "training loss".into(),
                x_label: "step".into(),
                y_label: "loss".into(),
                series: vec![Series { label: "train loss".into(), color: PALETTE[0], points: losses.iter().map(|&(s, l)| (s as f64, l)).collect() }],
            }
            .write_png(out.join("loss.png"))?;
        }
        Ok(RunSummary { out, losses, checkpoint, events, tokens_per_s: tokens as f64 / elapsed.as_secs_f64().max(1e-9), elapsed, resumed_from, primary })
    }

    /// Creates the run directory and takes its lock (one job per
    /// directory, for the whole run); with [`fresh`](Self::fresh), deletes
    /// earlier checkpoints; writes `config.toml`.
    fn open_run_dir(&self, out: &Path) -> Result<RunLock> {
        let cfg = &self.config;
        std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
        let held = self.lock.lock().take();
        let lock = match held {
            Some(lock) => lock,
            None => RunLock::acquire(out)?,
        };
        if let Some(holder) = lock.stale_holder() {
            eprintln!("the last job in {} ({holder}) ended without finishing; its lock went with it", out.display());
        }
        if self.fresh {
            let dir = self.checkpoint_dir();
            if dir.exists() {
                std::fs::remove_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
            }
        }
        let config_path = out.join("config.toml");
        tessera_core::file::write_atomic(&config_path, cfg.to_toml()?.as_bytes()).map_err(|e| Error::io(&config_path, e))?;
        Ok(lock)
    }

    /// The run's checkpointer, with `[faults]` that strike during saves
    /// armed. Unfinished checkpoints of dead jobs are removed and damaged
    /// ones set aside (see [`inspect_checkpoints`](Self::inspect_checkpoints)),
    /// each reported; returns those events for the first metrics line, and
    /// the step the run resumes from.
    fn open_checkpoints(&self, mesh: &Mesh) -> Result<(Checkpointer, Vec<Event>, Option<u64>)> {
        let ckpt = self.checkpointer(mesh)?;
        let cleaned = ckpt.clean_leftovers()?;
        for dir in &cleaned {
            eprintln!("removed {}: an unfinished checkpoint of a job that is no longer running", dir.display());
        }
        let set_aside = self.inspect_checkpoints(&ckpt)?;
        let events = cleaned.iter().map(|d| Event::Cleaned { dir: d.display().to_string() }).chain(set_aside).collect();
        let resume_step = self.resume_step(&ckpt)?;
        Ok((ckpt, events, resume_step))
    }

    /// The step the run resumes from: that of the newest valid checkpoint,
    /// when resuming.
    fn resume_step(&self, ckpt: &Checkpointer) -> Result<Option<u64>> {
        Ok(match ckpt.latest_valid()?.filter(|_| self.config.checkpoint.resume) {
            Some(dir) => Some(ckpt.manifest(&dir)?.step),
            None => None,
        })
    }

    /// The run's checkpointer, with `[faults]` that strike during saves
    /// armed.
    fn checkpointer(&self, mesh: &Mesh) -> Result<Checkpointer> {
        let cfg = &self.config;
        let ckpt = Checkpointer::new(self.checkpoint_dir(), cfg.checkpoint.keep)?.with_timeout(cfg.mesh.timeout());
        let coords_of = |rank: usize| -> Result<crate::ckpt::place::Coords> {
            let c = mesh.coords(rank)?;
            Ok(crate::ckpt::place::Coords { pp: c[Axis::Pp], dp: c[Axis::Dp], ep: c[Axis::Ep], tp: c[Axis::Tp] })
        };
        if let Some(f) = &cfg.faults.io_error {
            ckpt.inject_write_error(coords_of(f.rank)?, f.step);
        }
        if let Some(f) = cfg.faults.kill.as_ref().filter(|k| k.at == crate::KillPoint::Save) {
            ckpt.inject_kill_in_write(coords_of(f.rank)?, f.step);
        }
        Ok(ckpt)
    }

    /// Where ranks report their steps: the metrics log (cut after the line
    /// of `resume_step` when resuming), the progress bar and the figures
    /// MFU is computed from.
    fn collector(&self, out: &Path, ranks: &Ranks, mut carried: Vec<Event>, resume_step: Option<u64>) -> Result<Collector> {
        let cfg = &self.config;
        let metrics_path = out.join("metrics.jsonl");
        let log = match resume_step {
            Some(step) => {
                // The lines of steps a stopped job took after its last
                // checkpoint are replayed now: they go.
                let (log, dropped) = MetricsLog::resume_at(&metrics_path, step)?;
                if dropped > 0 {
                    eprintln!("resuming from step {step}: dropped {dropped} line(s) of later steps from {}, which this job replays", metrics_path.display());
                }
                carried.push(Event::Resumed { from_step: step, dropped_lines: dropped });
                log
            }
            None => MetricsLog::create(&metrics_path)?,
        };
        let bar = if cfg.run.progress { indicatif::ProgressBar::new(cfg.run.steps) } else { indicatif::ProgressBar::hidden() };
        bar.set_style(
            indicatif::ProgressStyle::with_template("{elapsed_precise} [{bar:30}] step {pos}/{len} {msg}")
                .map_err(|e| Error::config("run.progress", e.to_string()))?
                .progress_chars("=> "),
        );
        let replicas = cfg.mesh.dp * cfg.mesh.ep;
        let tokens_per_step = (replicas * cfg.batch.grad_accum * cfg.batch.micro_batch * cfg.batch.seq_len) as u64;
        let peak = match ranks {
            Ranks::Cpu(_) => PeakRate::measure_matmul(&Device::cpu(), 384)?,
            Ranks::Process(_) if matches!(ranks.first_device(), Device::Cpu(_)) => PeakRate::measure_matmul(&Device::cpu(), 384)?,
            Ranks::Process(_) => PeakRate::measure_matmul(&ranks.first_device(), 4096)?,
            // A GPU reaches its rate only on large products.
            Ranks::Cuda { .. } => PeakRate::measure_matmul(&ranks.first_device(), 4096)?,
        }
        .flops_per_s;
        Ok(Collector {
            world: cfg.mesh.world_size(),
            pending: BTreeMap::new(),
            carried,
            log,
            bar,
            losses: Vec::new(),
            events: Vec::new(),
            tokens_per_step,
            flops_per_token: self.facts.flops_per_token,
            peak,
            tokens: 0,
        })
    }

    /// The faults of `[faults]` that strike `rank` as `step` begins: a slow
    /// rank sleeps; a killed one ends (or ends the process); a hung one
    /// waits until its peers give up on it.
    fn strike(&self, rank: usize, step: u64, cx: &Cx) -> Result<()> {
        let f = &self.config.faults;
        if let Some(s) = f.slow.as_ref().filter(|s| s.rank == rank) {
            std::thread::sleep(Duration::from_millis(s.ms));
        }
        if let Some(k) = f.kill.as_ref().filter(|k| k.rank == rank && k.step == step && k.at == crate::KillPoint::Step) {
            if k.process {
                crate::kill_this_process();
            }
            return Err(Error::FaultInjected { rank, detail: format!("killed as step {step} began") });
        }
        if f.hang.as_ref().is_some_and(|h| h.rank == rank && h.step == step) {
            loop {
                if cx.groups().failure().is_some() {
                    return Err(Error::FaultInjected { rank, detail: format!("hung as step {step} began, until the other ranks gave up on it") });
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        Ok(())
    }
}

/// The outcome of a run from its ranks' results: the root cause is the
/// first error that is not a consequence of another rank's failure;
/// failing that, the reason the first failed rank gave when it stopped the
/// others.
fn first_root_cause(results: Vec<Result<(u64, PathBuf)>>) -> Result<(u64, PathBuf)> {
    let mut outcome = None;
    let mut first_err = None;
    for r in results {
        match r {
            Ok(v) => outcome = Some(v),
            Err(Error::PeerFailed { rank, reason }) => {
                let reason = reason.strip_prefix("aborted: ").map(str::to_string).unwrap_or(reason);
                first_err.get_or_insert(Error::RankFailed { rank, reason });
            }
            Err(e) => return Err(e),
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    outcome.ok_or_else(|| Error::topology("trainer", "no rank ran"))
}
