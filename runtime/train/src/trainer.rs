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

use super::{clip_to_norm, global_grad_norm, Anomaly, LossScaler, StabilityMonitor, TrainConfig, WarmupCosine};
use crate::ckpt::{Checkpointer, OptimizerState};
use super::ranks::Ranks;
use tessera_data::Batches;
use tessera_dist::mesh::{Axis, Mesh};
use tessera_dist::Communicator;
use tessera_core::{Error, Result};
use tessera_nn::module::{self, Act, Cx, Module, Replicated, SplitHidden, Staged};
use super::RunLock;
use tessera_nn::{vocab_parallel_cross_entropy, vocab_parallel_cross_entropy_backward};
use tessera_observe::{Event, LinePlot, MetricsLog, PeakRate, Series, StepMetrics, Trace, PALETTE};
use tessera_core::ops;
use tessera_optim::AdamW;
use tessera_parallel::data::DataParallel;
use tessera_parallel::pipeline::ScheduleKind;
use tessera_parallel::zero::{Stage, Zero, ZeroConfig};
use tessera_core::{Device, Tensor};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Rollbacks allowed in one run before it gives up: a run that keeps
/// diverging from healthy checkpoints on fresh data needs a human.
const MAX_ROLLBACKS: usize = 5;

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
    /// Vocabulary size (the logits' last dimension, unsharded).
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
}

/// One rank's figures for one step.
#[derive(Clone, Debug, Default)]
struct RankStep {
    rank: usize,
    loss: f64,
    grad_norm: Option<f64>,
    lr: f64,
    loss_scale: Option<f64>,
    step_time: f64,
    compute: f64,
    exposed: f64,
    bubble: f64,
    peak_memory: usize,
    skipped: bool,
    events: Vec<Event>,
}

/// Where ranks report their steps; the last to report a step writes it.
struct Collector {
    world: usize,
    pending: BTreeMap<u64, Vec<RankStep>>,
    /// What happened before the first step (start-up clean-up), reported
    /// on the first metrics line.
    carried: Vec<Event>,
    log: MetricsLog,
    bar: indicatif::ProgressBar,
    losses: Vec<(u64, f64)>,
    events: Vec<(u64, Event)>,
    tokens_per_step: u64,
    flops_per_token: f64,
    peak: f64,
    tokens: u64,
}

impl Collector {
    fn report(&mut self, step: u64, r: RankStep) -> Result<()> {
        let entry = self.pending.entry(step).or_default();
        entry.push(r);
        if entry.len() < self.world {
            return Ok(());
        }
        let mut ranks = self.pending.remove(&step).unwrap_or_default();
        ranks.sort_by_key(|r| r.rank);
        let max = |f: fn(&RankStep) -> f64| ranks.iter().map(f).fold(0.0, f64::max);
        let first = &ranks[0];
        let step_time = max(|r| r.step_time);
        let tokens_per_s = self.tokens_per_step as f64 / step_time.max(1e-9);
        let mut events: Vec<Event> = std::mem::take(&mut self.carried);
        events.extend(ranks.iter().flat_map(|r| r.events.iter().cloned()));
        let m = StepMetrics {
            step,
            loss: first.loss,
            grad_norm: first.grad_norm,
            lr: first.lr,
            loss_scale: first.loss_scale,
            tokens: self.tokens_per_step,
            tokens_per_s,
            mfu: self.flops_per_token * tokens_per_s / self.peak,
            step_time_s: step_time,
            compute_s: max(|r| r.compute),
            exposed_comm_s: max(|r| r.exposed),
            bubble_s: max(|r| r.bubble),
            peak_memory: ranks.iter().map(|r| r.peak_memory).collect(),
            skipped: first.skipped,
            events: events.clone(),
        };
        self.log.write(&m)?;
        if !m.skipped {
            self.tokens += self.tokens_per_step;
        }
        self.losses.push((step, m.loss));
        self.events.extend(events.into_iter().map(|e| (step, e)));
        self.bar.set_position(step);
        self.bar.set_message(format!("loss {:.4}  {:.0} tok/s  mfu {:.1}%", m.loss, tokens_per_s, 100.0 * m.mfu));
        Ok(())
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
        Ok(Trainer { config, facts, build: Box::new(build), batches: Box::new(batches), fresh: false, lock: Mutex::new(None) })
    }

    /// Runs under `lock`, the run directory's lock the caller took before
    /// preparing what the run reads from the directory (data, say);
    /// otherwise [`run`](Self::run) takes it itself.
    pub fn with_run_lock(self, lock: RunLock) -> Self {
        *self.lock.lock().unwrap_or_else(|e| e.into_inner()) = Some(lock);
        self
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
            return Err(Error::invalid(
                "trainer",
                format!("`{root}` holds checkpoints of an earlier run (the newest of step {newest}) that this run would not resume from and would delete; resume from them (`checkpoint.resume = true`), start over with `--fresh`, or give this run another `run.out`"),
            ));
        }
        if scan.valid.is_none() && !damaged.is_empty() {
            let why: Vec<String> = damaged.iter().map(|s| format!("  {}: {}", s.dir.display(), s.reason)).collect();
            return Err(Error::invalid(
                "trainer",
                format!("`{root}` holds {} checkpoint(s) but none can be loaded:\n{}\nrepair or remove them, or start over with `--fresh` (which deletes them)", damaged.len(), why.join("\n")),
            ));
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
    pub fn run(&self) -> Result<RunSummary> {
        let cfg = &self.config;
        let out = PathBuf::from(&cfg.run.out);
        std::fs::create_dir_all(&out).map_err(|e| Error::io(&out, e))?;
        // One job per run directory, for the whole run.
        let held = self.lock.lock().unwrap_or_else(|e| e.into_inner()).take();
        let lock = match held {
            Some(lock) => lock,
            None => RunLock::acquire(&out)?,
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
        std::fs::write(&config_path, cfg.to_toml()?).map_err(|e| Error::io(&config_path, e))?;

        // Before any rank allocates: a run that cannot fit is refused here,
        // not aborted by the allocator.
        if cfg.mesh.rank_device()? == super::RankDevice::Cpu {
            let probe = (self.build)(&Cx::new(Device::cpu()), 0, 1)?;
            super::memory_check::check(cfg, &probe, self.facts.vocab)?;
        }
        let world_size = cfg.mesh.world_size();
        let mesh = Mesh::parse(&format!("pp{},dp{},ep{},tp{}", cfg.mesh.pp, cfg.mesh.dp, cfg.mesh.ep, cfg.mesh.tp), world_size, world_size)?;
        let ranks = Ranks::new(cfg.mesh.rank_device()?, &mesh, cfg.mesh.timeout())?;
        if cfg.faults.any() {
            eprintln!("fault injection is on: {}", cfg.faults.describe());
        }
        let tracks = (0..world_size)
            .map(|r| {
                let c = mesh.coords(r)?;
                Ok(format!("rank {r} (dp{} ep{} pp{} tp{})", c[Axis::Dp], c[Axis::Ep], c[Axis::Pp], c[Axis::Tp]))
            })
            .collect::<Result<Vec<_>>>()?;
        let trace = Trace::new(tracks);
        let ckpt = Checkpointer::new(self.checkpoint_dir(), cfg.checkpoint.keep)?.with_timeout(cfg.mesh.timeout());
        let coords_of = |rank: usize| -> Result<crate::ckpt::place::Coords> {
            let c = mesh.coords(rank)?;
            Ok(crate::ckpt::place::Coords { pp: c[Axis::Pp], dp: c[Axis::Dp], ep: c[Axis::Ep], tp: c[Axis::Tp] })
        };
        if let Some(f) = &cfg.faults.io_error {
            ckpt.inject_write_error(coords_of(f.rank)?, f.step);
        }
        if let Some(f) = cfg.faults.kill.as_ref().filter(|k| k.at == super::KillPoint::Save) {
            ckpt.inject_kill_in_write(coords_of(f.rank)?, f.step);
        }
        let cleaned = ckpt.clean_leftovers()?;
        for dir in &cleaned {
            eprintln!("removed {}: an unfinished checkpoint of a job that is no longer running", dir.display());
        }
        let set_aside = self.inspect_checkpoints(&ckpt)?;
        let resume_step = match ckpt.latest_valid()?.filter(|_| cfg.checkpoint.resume) {
            Some(dir) => Some(ckpt.manifest(&dir)?.step),
            None => None,
        };
        let metrics_path = out.join("metrics.jsonl");
        let mut carried: Vec<Event> = cleaned.iter().map(|d| Event::Cleaned { dir: d.display().to_string() }).chain(set_aside).collect();
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
        let peak = match &ranks {
            Ranks::Cpu(_) => PeakRate::measure_matmul(&Device::cpu(), 384)?,
            // A GPU reaches its rate only on large products.
            Ranks::Cuda { .. } => PeakRate::measure_matmul(&ranks.first_device(), 4096)?,
        }
        .flops_per_s;
        let collector = Mutex::new(Collector {
            world: world_size,
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
        });

        let started = Instant::now();
        let results: Vec<Result<(u64, PathBuf)>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..world_size)
                .map(|rank| {
                    let (ranks, mesh, trace, ckpt, collector) = (&ranks, &mesh, &trace, &ckpt, &collector);
                    s.spawn(move || {
                        // A panic is caught so that it, too, aborts the rank's
                        // groups: NCCL peers would otherwise wait for it forever.
                        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run_rank(ranks, mesh, rank, trace, ckpt, collector)))
                            .unwrap_or_else(|_| Err(Error::invalid("trainer", format!("rank {rank} panicked; see its message above"))));
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
            handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(Error::invalid("trainer", "a rank's thread could not be joined")))).collect()
        });
        let elapsed = started.elapsed();
        // The root cause is the first error that is not a consequence of
        // another rank's failure; failing that, the reason the first failed
        // rank gave when it stopped the others.
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
        let (resumed_from, checkpoint) = outcome.ok_or_else(|| Error::invalid("trainer", "no rank ran"))?;
        let collector = collector.into_inner().unwrap_or_else(|e| e.into_inner());
        collector.bar.finish();
        // A run that had nothing left to do keeps the trace of the run that did.
        if cfg.run.trace_steps > 0 && !trace.spans().is_empty() {
            trace.write(out.join("trace.json"))?;
        }
        if !collector.losses.is_empty() {
            LinePlot {
                title: "training loss".into(),
                x_label: "step".into(),
                y_label: "loss".into(),
                series: vec![Series { label: "train loss".into(), color: PALETTE[0], points: collector.losses.iter().map(|&(s, l)| (s as f64, l)).collect() }],
            }
            .write_png(out.join("loss.png"))?;
        }
        Ok(RunSummary {
            out,
            losses: collector.losses,
            checkpoint,
            events: collector.events,
            tokens_per_s: collector.tokens as f64 / elapsed.as_secs_f64().max(1e-9),
            elapsed,
            resumed_from,
        })
    }

    /// One rank's whole run: returns the step it started from and the final checkpoint.
    fn run_rank(&self, ranks: &Ranks, mesh: &Mesh, rank: usize, trace: &Trace, ckpt: &Checkpointer, collector: &Mutex<Collector>) -> Result<(u64, PathBuf)> {
        let cfg = &self.config;
        let (dev, groups) = ranks.take(mesh, rank)?;
        let c = mesh.coords(rank)?;
        let (d, e, stage) = (c[Axis::Dp], c[Axis::Ep], c[Axis::Pp]);
        let (dp, ep, pp) = (cfg.mesh.dp, cfg.mesh.ep, cfg.mesh.pp);
        let (tp_group, dp_group, ep_group, pp_group) = (groups.tp.clone(), groups.dp.clone(), groups.ep.clone(), groups.pp.clone());
        let mut cx = Cx::new(dev.clone()).with_seed(cfg.run.seed).with_groups(groups).with_sequence_parallel(cfg.mesh.sp).with_dtype(cfg.precision.dtype()?);
        if pp > 1 {
            // Each stage materialises (and checkpoints) only its own layers.
            let chunks = match cfg.mesh.schedule_kind()? {
                ScheduleKind::Interleaved { chunks } => chunks,
                _ => 1,
            };
            cx = cx.with_pipeline_chunks(chunks);
        }
        cx.set_recompute_override(cfg.recompute.to_override()?);
        let model = module::build((self.build)(&cx, e, ep)?, &cx)?;

        // Gradient synchronisation: ZeRO, overlapped buckets, or (with
        // expert parallelism, whose non-expert gradients also sum over the
        // expert group) an explicit average after the backward.
        let zero = match cfg.zero.to_stage()? {
            Some(stage) => Some(Arc::new(Zero::new(&model, dp_group.clone(), ZeroConfig::new(stage).with_adamw(cfg.optim.adamw()).with_bucket_bytes(cfg.mesh.bucket_bytes))?)),
            None => None,
        };
        let overlap = (zero.is_none() && dp > 1 && ep == 1).then(|| DataParallel::new(&model, dp_group.clone(), cfg.mesh.bucket_bytes).map(Arc::new)).transpose()?;
        if let Some(z) = &zero {
            cx = cx.with_hooks(z.clone());
        }
        if let Some(o) = &overlap {
            cx = cx.with_hooks(o.clone());
        }
        let mut opt = if zero.is_none() { Some(AdamW::new(&model, cfg.optim.adamw())?) } else { None };
        // The optimizer state checkpoints hold: AdamW's, or this rank's ZeRO shard.
        let mut zero_state = zero.clone();
        let schedule = cfg.mesh.schedule_kind()?.build(pp, cfg.batch.grad_accum)?;
        let lr_schedule = WarmupCosine::new(cfg.optim.lr, cfg.optim.min_lr, cfg.optim.warmup.min(cfg.run.steps), cfg.run.steps)?;
        let mut monitor = StabilityMonitor::new(cfg.stability.spike_factor, cfg.stability.window, cfg.stability.warmup)?;
        let mut scaler = if cfg.precision.scales_loss()? {
            Some(LossScaler::new().with_initial_scale(cfg.precision.initial_scale)?.with_hysteresis(cfg.precision.hysteresis)?)
        } else {
            None
        };
        let mut batches = (self.batches)(Replica { index: d * ep + e, count: dp * ep })?;

        let mut done = 0u64;
        let mut rollbacks = 0;
        if cfg.checkpoint.resume {
            if let Some(r) = ckpt.load_latest_valid(&model, state_mut(&mut opt, &mut zero_state), &cx)? {
                done = r.manifest.step;
                let extra = &r.manifest.extra;
                if let Some(cursor) = extra.get("data") {
                    batches.restore(cursor)?;
                }
                restore_state(extra, &mut scaler, &mut monitor)?;
                rollbacks = extra.get("rollbacks").and_then(Value::as_u64).unwrap_or(0) as usize;
            }
        }
        let resumed_from = done;
        let mut last_saved: Option<(u64, PathBuf)> = None;
        let mut pending_save: Option<crate::ckpt::SaveHandle> = None;
        let micro = cfg.batch.grad_accum;
        let last_stage = stage == pp - 1;

        let stop = cfg.run.steps.min(cfg.run.stop_after.unwrap_or(u64::MAX));
        let mut nan_fault = cfg.faults.nan.clone();
        while done < stop {
            let step_started = Instant::now();
            self.strike(rank, done + 1, &cx)?;
            let tracing = done < cfg.run.trace_steps;
            let lr = lr_schedule.lr(done + 1);
            let mut events = Vec::new();
            let mut inputs = Vec::with_capacity(micro);
            let mut targets = Vec::with_capacity(micro);
            for _ in 0..micro {
                let (x, y) = batches.next_batch(&dev)?;
                inputs.push(x);
                targets.push(y);
            }
            let scale = scaler.as_ref().map_or(1.0, |s| s.scale());
            let vocab = self.facts.vocab;
            let ignore = batches.ignore_index();
            // Dropout draws a fresh mask each step, at the rows this replica
            // holds in the step's global batch (replica after replica).
            cx.set_step(done);
            cx.set_batch_offset(((d * ep + e) * micro * cfg.batch.micro_batch) as u64);
            // `faults.nan`: the step's loss, and so every gradient, is NaN,
            // once (a replay of the step after a rollback is healthy).
            let poison = if nan_fault.take_if(|f| f.step == done + 1).is_some() { f64::NAN } else { 1.0 };
            let report = tessera_parallel::pipeline::run_stage(&model, &mut cx, &schedule, stage, &inputs, |mb, logits: &Act<SplitHidden>| {
                let (l, saved) = vocab_parallel_cross_entropy(&*tp_group, logits, &targets[mb], vocab, ignore)?;
                let dl = vocab_parallel_cross_entropy_backward(logits, &targets[mb], vocab, ignore, &saved, poison * scale / micro as f64)?;
                Ok((poison * l.to_scalar()?, dl))
            })?;
            if tracing {
                for s in &report.spans {
                    let category = if s.action.is_compute() { "compute" } else { "pipeline" };
                    trace.record(rank, s.action.to_string(), category, s.start, s.end);
                }
            }

            let sync_started = Instant::now();
            let exposed = match (&overlap, &zero) {
                (Some(o), _) => o.finish()?.exposed,
                (None, Some(z)) => {
                    z.finish()?;
                    sync_started.elapsed()
                }
                (None, None) if dp * ep > 1 => {
                    average_grads(&model, &*dp_group, &*ep_group, dp * ep)?;
                    sync_started.elapsed()
                }
                _ => Duration::ZERO,
            };
            tessera_parallel::pipeline::sync_tied_grads(&model, &cx)?;
            if tracing {
                trace.record(rank, "grad sync", "comm", sync_started, Instant::now());
            }

            // The step's loss, the same on every rank: the mean over the
            // replicas' microbatches, from the last stage.
            let local = if last_stage { report.losses.iter().map(|(_, l)| l).sum::<f64>() / micro as f64 } else { 0.0 };
            let mut t = Tensor::from_vec(vec![local], [1], &dev)?;
            for g in [&dp_group, &ep_group, &pp_group] {
                t = g.all_reduce_sum(&t)?;
            }
            let loss = t.to_scalar()? / (dp * ep) as f64;

            let finite = match &scaler {
                Some(s) => s.unscale_and_check(&model, &cx)?,
                None => true,
            };
            let measurable = !matches!(zero.as_ref().map(|z| z.stage()), Some(Stage::Two | Stage::Three));
            // Measured once: the monitor judges it, clipping scales by it.
            let grad_norm = if finite && measurable { Some(global_grad_norm(&model, &cx)?) } else { None };
            if let Some(norm) = grad_norm.filter(|n| n.is_finite() && cfg.optim.clip > 0.0) {
                clip_to_norm(&model, norm, cfg.optim.clip)?;
            }
            // Judged under the number of the metrics line it lands on.
            let anomaly = if finite { monitor.observe(done + 1, loss, grad_norm.unwrap_or(0.0)) } else { None };

            let opt_started = Instant::now();
            let mut skipped = true;
            // A gradient-norm spike alone is recorded, not acted on: clipping
            // already bounds the update, and norms rise legitimately when a
            // model starts learning something new. NaNs and loss spikes are
            // what rollbacks are for.
            let anomaly = match anomaly {
                Some(a @ Anomaly::GradNormSpike { .. }) => {
                    events.push(Event::Anomaly { detail: describe(&a) });
                    monitor.learn(loss, grad_norm.unwrap_or(0.0));
                    None
                }
                other => other,
            };
            if let Some(a) = anomaly {
                events.push(Event::Anomaly { detail: describe(&a) });
                module::zero_grad(&model)?;
                if cfg.stability.rollback {
                    // Every rank must see the same newest checkpoint: let
                    // saves in flight land (rank 0's wait covers the merged
                    // manifest), then meet every rank of the mesh.
                    if let Some(h) = pending_save.take() {
                        h.wait()?;
                    }
                    for g in [&tp_group, &dp_group, &ep_group, &pp_group] {
                        g.barrier()?;
                    }
                    let state = RunState { batches: batches.as_mut(), scaler: &mut scaler, monitor: &mut monitor, rollbacks: &mut rollbacks };
                    if let Some((to, skipped)) = self.roll_back(ckpt, &model, state_mut(&mut opt, &mut zero_state), &cx, state, done)? {
                        if rank == 0 {
                            for e in &skipped {
                                if let Event::Skipped { dir, reason } = e {
                                    eprintln!("rolling back past the checkpoint {dir}, which cannot be loaded: {reason}");
                                }
                            }
                            // Resume points of the abandoned future must not be resumed from.
                            for dir in ckpt.drop_resume_points_after(to)? {
                                eprintln!("dropped the resume point {}: the run rolled back to step {to}", dir.display());
                            }
                        }
                        events.extend(skipped);
                        events.push(Event::Rollback { to_step: to, skipped_batches: (done + 1 - to) * micro as u64 });
                        let r = step_report(rank, loss, grad_norm, lr, &scaler, step_started, &report, exposed, &dev, true, events);
                        collector.lock().unwrap_or_else(|e| e.into_inner()).report(done + 1, r)?;
                        done = to;
                        continue;
                    }
                }
            } else if !finite {
                module::zero_grad(&model)?;
                if let Some(s) = scaler.as_mut() {
                    s.update(false);
                    events.push(Event::Overflow { scale: s.scale() });
                }
            } else {
                match (&zero, opt.as_mut()) {
                    (Some(z), _) => z.step(lr)?,
                    (None, Some(o)) => {
                        o.step(lr)?;
                        o.zero_grad();
                    }
                    (None, None) => unreachable!("an optimizer exists without ZeRO"),
                }
                if let Some(s) = scaler.as_mut() {
                    s.update(true);
                }
                skipped = false;
            }
            if tracing {
                trace.record(rank, "optimizer", "compute", opt_started, Instant::now());
            }
            done += 1;
            let scheduled = cfg.checkpoint.every > 0 && done.is_multiple_of(cfg.checkpoint.every);
            let save_now = !skipped && (scheduled || done == stop);
            if save_now {
                events.push(Event::Checkpoint { dir: ckpt.step_dir(done).display().to_string() });
            }
            if tracing {
                trace.record(rank, format!("step {done}"), "step", step_started, Instant::now());
            }
            // The step's line is written before its checkpoint: a job killed
            // during the save leaves the line, which the next job, resuming
            // from the checkpoint before, drops and writes again.
            let r = step_report(rank, loss, grad_norm, lr, &scaler, step_started, &report, exposed, &dev, skipped, events);
            collector.lock().unwrap_or_else(|e| e.into_inner()).report(done, r)?;
            if save_now {
                let extra = run_state(batches.as_ref(), &scaler, &monitor, rollbacks);
                if let Some(h) = pending_save.take() {
                    h.wait()?;
                }
                let state = state_of(&opt, &zero);
                let dir = if !scheduled && done < cfg.run.steps {
                    // A job stopping early: the next job resumes here, but
                    // rollbacks go where they would in an unstopped run.
                    trace.span(rank, "checkpoint", "io", || ckpt.save_resume_point(done, &model, state, &cx, extra))?
                } else if cfg.checkpoint.background && done < stop {
                    // Snapshot now, write while training goes on; the next
                    // save (or a rollback's load) waits for it.
                    pending_save = Some(trace.span(rank, "checkpoint snapshot", "io", || ckpt.save_in_background(done, &model, state, &cx, extra))?);
                    ckpt.step_dir(done)
                } else {
                    trace.span(rank, "checkpoint", "io", || ckpt.save(done, &model, state, &cx, extra))?
                };
                last_saved = Some((done, dir));
            }
        }
        if let Some(h) = pending_save.take() {
            h.wait()?;
        }
        // The final state is always in a checkpoint (the last step may have
        // been skipped, and so not saved).
        let last = match last_saved {
            Some((step, dir)) if step == done => dir,
            _ => {
                let extra = run_state(batches.as_ref(), &scaler, &monitor, rollbacks);
                if done < cfg.run.steps {
                    ckpt.save_resume_point(done, &model, state_of(&opt, &zero), &cx, extra)?
                } else {
                    ckpt.save(done, &model, state_of(&opt, &zero), &cx, extra)?
                }
            }
        };
        Ok((resumed_from, last))
    }

    /// The faults of `[faults]` that strike `rank` as `step` begins: a slow
    /// rank sleeps; a killed one ends (or ends the process); a hung one
    /// waits until its peers give up on it.
    fn strike(&self, rank: usize, step: u64, cx: &Cx) -> Result<()> {
        let f = &self.config.faults;
        if let Some(s) = f.slow.as_ref().filter(|s| s.rank == rank) {
            std::thread::sleep(Duration::from_millis(s.ms));
        }
        if let Some(k) = f.kill.as_ref().filter(|k| k.rank == rank && k.step == step && k.at == super::KillPoint::Step) {
            if k.process {
                super::kill_this_process();
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

    /// Restores the newest valid checkpoint that is not a resume point
    /// (model, optimizer, loss scaler, stability monitor) and has the data
    /// stream exclude everything drawn since it: the stream keeps its place,
    /// and the data behind the anomaly is never served again. Returns the
    /// restored step, or `None` when there is no checkpoint to go back to
    /// (the step is then only skipped).
    fn roll_back(&self, ckpt: &Checkpointer, model: &M, opt: Option<&mut dyn OptimizerState>, cx: &Cx, state: RunState<'_>, step: u64) -> Result<Option<(u64, Vec<Event>)>> {
        if !ckpt.has_regular()? {
            return Ok(None);
        }
        *state.rollbacks += 1;
        if *state.rollbacks > MAX_ROLLBACKS {
            return Err(Error::invalid(
                "trainer",
                format!("step {step}: still unstable after {MAX_ROLLBACKS} rollbacks to healthy checkpoints with fresh data; lower optim.lr, raise optim.warmup or tighten optim.clip"),
            ));
        }
        let Some(r) = ckpt.load_latest_valid_regular(model, opt, cx)? else { return Ok(None) };
        let extra = &r.manifest.extra;
        restore_state(extra, state.scaler, state.monitor)?;
        match extra.get("data") {
            Some(since) => state.batches.exclude_since(since)?,
            None => return Err(Error::invalid("trainer", format!("the checkpoint `{}` holds no data cursor, so the data since it cannot be excluded", r.dir.display()))),
        }
        // Newer checkpoints it had to pass over are reported, not hidden.
        let skipped = r.skipped.iter().map(|s| Event::Skipped { dir: s.dir.display().to_string(), reason: s.reason.to_string() }).collect();
        Ok(Some((r.manifest.step, skipped)))
    }
}

/// The state of a rank's run besides the model and optimizer: all of it is
/// in every checkpoint (see [`run_state`]).
struct RunState<'a> {
    batches: &'a mut dyn Batches,
    scaler: &'a mut Option<LossScaler>,
    monitor: &'a mut StabilityMonitor,
    rollbacks: &'a mut usize,
}

/// A checkpoint's `extra`: the data cursor (with its exclusions), the loss
/// scaler, the stability monitor's averages and warm-up, and the rollbacks
/// taken. Every random draw of a run is a pure function of the seed and
/// the step (dropout) or the epoch (the data order), so no generator state
/// needs saving.
fn run_state(batches: &dyn Batches, scaler: &Option<LossScaler>, monitor: &StabilityMonitor, rollbacks: usize) -> Value {
    json!({ "data": batches.cursor(), "scaler": scaler, "monitor": monitor.state(), "rollbacks": rollbacks })
}

/// Restores the loss scaler and the monitor from a checkpoint's `extra`
/// (a checkpoint written before the monitor was saved leaves it as is).
fn restore_state(extra: &Value, scaler: &mut Option<LossScaler>, monitor: &mut StabilityMonitor) -> Result<()> {
    if let (Some(s), Some(saved)) = (scaler.as_mut(), extra.get("scaler").filter(|v| !v.is_null())) {
        *s = serde_json::from_value(saved.clone()).map_err(|e| Error::config("precision", format!("the checkpoint's loss-scaler state is unreadable: {e}")))?;
    }
    if let Some(saved) = extra.get("monitor").filter(|v| !v.is_null()) {
        monitor.restore(saved)?;
    }
    Ok(())
}

fn state_of<'s>(opt: &'s Option<AdamW>, zero: &'s Option<Arc<Zero>>) -> Option<&'s dyn OptimizerState> {
    match (opt, zero) {
        (Some(o), _) => Some(o),
        (None, Some(z)) => Some(&**z),
        (None, None) => None,
    }
}

fn state_mut<'s>(opt: &'s mut Option<AdamW>, zero: &'s mut Option<Arc<Zero>>) -> Option<&'s mut dyn OptimizerState> {
    match (opt, zero) {
        (Some(o), _) => Some(o),
        (None, Some(z)) => Some(z),
        (None, None) => None,
    }
}

fn describe(a: &Anomaly) -> String {
    match a {
        Anomaly::NonFinite { step, loss, grad_norm } => format!("step {step}: non-finite loss {loss} or gradient norm {grad_norm}"),
        Anomaly::LossSpike { step, loss, average } => format!("step {step}: loss spike {loss:.4} (average {average:.4})"),
        Anomaly::GradNormSpike { step, grad_norm, average } => format!("step {step}: gradient-norm spike {grad_norm:.4} (average {average:.4})"),
    }
}

#[allow(clippy::too_many_arguments)]
fn step_report(
    rank: usize,
    loss: f64,
    grad_norm: Option<f64>,
    lr: f64,
    scaler: &Option<LossScaler>,
    started: Instant,
    report: &tessera_parallel::pipeline::StageReport,
    exposed: Duration,
    dev: &Device,
    skipped: bool,
    events: Vec<Event>,
) -> RankStep {
    RankStep {
        rank,
        loss,
        grad_norm,
        lr,
        loss_scale: scaler.as_ref().map(|s| s.scale()),
        step_time: started.elapsed().as_secs_f64(),
        compute: report.compute.as_secs_f64(),
        exposed: exposed.as_secs_f64(),
        bubble: report.waiting.as_secs_f64(),
        peak_memory: dev.memory_stats().peak,
        skipped,
        // Every rank sees the same events; one copy is enough.
        events: if rank == 0 { events } else { Vec::new() },
    }
}

/// Averages every gradient over the data replicas when expert parallelism
/// is on: an expert's gradient already holds every expert-parallel rank's
/// tokens (the all-to-all brought them), every other parameter is also
/// replicated over the expert group and sums over it.
fn average_grads<M: Module>(model: &M, dp: &dyn Communicator, ep: &dyn Communicator, replicas: usize) -> Result<()> {
    // Each parameter once, with whether the visitor places it in an expert.
    let mut params: Vec<(tessera_nn::module::Param, bool)> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    module::visit_params(model, |e| {
        if seen.insert(e.param.id()) {
            params.push((e.param.clone(), e.expert.is_some()));
        }
        Ok(())
    })?;
    for (p, expert) in params {
        let Some(g) = p.grad() else { continue };
        let mut g = dp.all_reduce_sum(&g)?;
        if !expert {
            g = ep.all_reduce_sum(&g)?;
        }
        p.set_grad(ops::scale(&g, 1.0 / replicas as f64)?)?;
    }
    Ok(())
}
