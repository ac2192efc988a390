//! One rank's run: its model, optimizer and data stream are set up, it
//! resumes, takes its steps (rolling back when one goes bad) and saves.

use super::optimizer::{GradSync, RankOptimizer};
use super::report::{Collector, Pass, RankStep};
use super::state::{describe, fp8_of_every_stage, restore_fp8, RunState};
use super::{Replica, Trainer};
use crate::ckpt::{Checkpointer, SaveHandle};
use crate::ranks::Ranks;
use crate::{clip_factor, Anomaly, AtStep, LossScaler, NormClasses, StabilityMonitor, WarmupCosine};
use parking_lot::Mutex;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;
use tessera_core::{Device, Result, Tensor};
use tessera_dist::mesh::{Axis, Mesh};
use tessera_dist::Communicator;
use tessera_nn::module::{self, Act, Cx, Replicated, SplitHidden, Staged};
use tessera_nn::{vocab_parallel_cross_entropy, vocab_parallel_cross_entropy_backward};
use tessera_observe::{Event, Trace};
use tessera_optim::AdamW;
use tessera_optim::OptimizerState;
use tessera_parallel::data::{DataParallel, SyncStats};
use tessera_parallel::local_sgd::{LocalSgd, WithOuterMomentum};
use tessera_parallel::pipeline::{run_stage, sync_tied_grads, Schedule};
use tessera_parallel::zero::{Zero, ZeroConfig};

/// What every rank of a run shares.
pub(super) struct Shared<'s> {
    pub(super) ranks: &'s Ranks,
    pub(super) mesh: &'s Mesh,
    pub(super) trace: &'s Trace,
    pub(super) ckpt: &'s Checkpointer,
    /// Where steps are reported: in the primary process only.
    pub(super) collector: Option<&'s Mutex<Collector>>,
    /// In a job of processes, the whole job, over which every rank's
    /// figures reach the primary.
    pub(super) reports: Option<&'s dyn Communicator>,
}

/// One rank of a run, from its set-up to its final checkpoint.
pub(super) struct RankRun<'r, 'a, M> {
    trainer: &'r Trainer<'a, M>,
    shared: &'r Shared<'r>,
    rank: usize,
    dev: Device,
    cx: Cx,
    model: M,
    tp: Arc<dyn Communicator>,
    dp: Arc<dyn Communicator>,
    ep: Arc<dyn Communicator>,
    pp: Arc<dyn Communicator>,
    /// This rank's pipeline stage.
    stage: usize,
    /// This rank's data replica and the number of them (dp × ep).
    replica: Replica,
    sync: GradSync,
    optimizer: RankOptimizer,
    /// With `[local_sgd]`: the replicas train apart and meet every few steps.
    local_sgd: Option<LocalSgd>,
    /// Where each parameter's squared gradient counts in the global norm:
    /// fixed once the model is materialised, so built once, not every step.
    norm_classes: NormClasses,
    schedule: Schedule,
    lr_schedule: WarmupCosine,
    state: RunState,
    /// `faults.nan`, until it strikes (once: the replay of its step after
    /// a rollback is healthy).
    nan_fault: Option<AtStep>,
    pending_save: Option<SaveHandle>,
    last_saved: Option<(u64, PathBuf)>,
}

impl<'r, 'a, M: Staged<In = Replicated, Out = SplitHidden>> RankRun<'r, 'a, M> {
    /// Builds rank `rank`'s context, model (its shard, materialised),
    /// gradient synchronisation, optimizer and data stream.
    pub(super) fn setup(trainer: &'r Trainer<'a, M>, shared: &'r Shared<'r>, rank: usize) -> Result<Self> {
        let cfg = &trainer.config;
        let (dev, groups) = shared.ranks.take(shared.mesh, rank)?;
        let c = shared.mesh.coords(rank)?;
        let (d, e, stage) = (c[Axis::Dp], c[Axis::Ep], c[Axis::Pp]);
        // `dp`: the ranks gradients are averaged over (data × context parallel).
        let (dp, ep, pp) = (cfg.mesh.dp * cfg.mesh.cp, cfg.mesh.ep, cfg.mesh.pp);
        let (tp_group, dp_group, ep_group, pp_group) = (groups.tp.clone(), groups.dp.clone(), groups.ep.clone(), groups.pp.clone());
        let replicas_group = groups.replicas.clone();
        let outer = cfg.local_sgd.outer()?;
        let mut cx = Cx::new(dev.clone())
            .with_seed(cfg.run.seed)
            .with_groups(groups)
            .with_sequence_parallel(cfg.mesh.sp)
            .with_tp_overlap(cfg.mesh.tp_overlap)
            .with_dtype(cfg.precision.dtype()?);
        if cfg.precision.half_params()? {
            cx = cx.with_half_params();
        }
        if let Some(recipe) = cfg.precision.fp8_recipe()? {
            cx = cx.with_fp8(recipe)?;
        }
        if pp > 1 {
            // Each stage materialises (and checkpoints) only its own layers.
            let chunks = cfg.mesh.schedule_kind()?.chunks();
            cx = cx.with_pipeline_chunks(chunks);
        }
        cx.set_recompute_override(cfg.recompute.to_override()?);
        if cfg.recompute.offload {
            cx = cx.with_activation_offload(Device::cpu());
        }
        let model = module::build((trainer.build)(&cx, e, ep)?, &cx)?;
        let norm_classes = NormClasses::of(&model, &cx)?;

        // Gradient synchronisation: ZeRO, or buckets all-reduced while the
        // backward runs (with expert parallelism, the experts' gradients
        // over the data-parallel group, every other over all replicas).
        let (sync, optimizer) = match cfg.zero.to_stage()? {
            Some(stage) => {
                let config = ZeroConfig::new(stage).with_adamw(cfg.optim.adamw()).with_bucket_bytes(cfg.mesh.bucket_bytes).with_offload(cfg.zero.offload);
                let zero = Arc::new(match ep {
                    1 => Zero::new(&model, dp_group.clone(), config)?,
                    _ => Zero::with_experts(&model, cx.groups(), config)?,
                });
                cx = cx.with_hooks(zero.clone());
                (GradSync::Zero(zero.clone()), RankOptimizer::Zero(zero))
            }
            None => {
                // Local SGD: no gradient crosses replicas; they meet in `step`.
                let sync = if dp * ep > 1 && outer.is_none() {
                    let overlap = match ep {
                        1 => DataParallel::new(&model, dp_group.clone(), cfg.mesh.bucket_bytes)?,
                        _ => DataParallel::with_experts(&model, replicas_group.clone(), dp_group.clone(), cfg.mesh.bucket_bytes)?,
                    };
                    let overlap = Arc::new(overlap.with_compression(cfg.mesh.compression()?)?);
                    cx = cx.with_hooks(overlap.clone());
                    GradSync::Overlapped(overlap)
                } else {
                    GradSync::None
                };
                (sync, RankOptimizer::AdamW(AdamW::new(&model, cfg.optim.adamw())?))
            }
        };
        let local_sgd = match outer {
            Some(outer) => Some(match ep {
                1 => LocalSgd::new(&model, dp_group.clone(), None, outer)?,
                _ => LocalSgd::new(&model, replicas_group.clone(), Some(dp_group.clone()), outer)?,
            }),
            None => None,
        };
        let schedule = cfg.mesh.schedule_kind()?.build(pp, cfg.batch.grad_accum)?;
        let lr_schedule = WarmupCosine::new(cfg.optim.lr, cfg.optim.min_lr, cfg.optim.warmup.min(cfg.run.steps), cfg.run.steps)?;
        let monitor = StabilityMonitor::new(cfg.stability.spike_factor, cfg.stability.window, cfg.stability.warmup)?.with_min_rise(cfg.stability.min_rise)?;
        let scaler = if cfg.precision.scales_loss()? {
            Some(LossScaler::new().with_initial_scale(cfg.precision.initial_scale)?.with_hysteresis(cfg.precision.hysteresis)?)
        } else {
            None
        };
        // Context-parallel ranks read the same rows (each keeps its chunks of them).
        let replica = Replica { index: d * ep + e, count: cfg.mesh.dp * ep };
        let batches = (trainer.batches)(replica)?;
        Ok(RankRun {
            trainer,
            shared,
            rank,
            dev,
            cx,
            model,
            tp: tp_group,
            dp: dp_group,
            ep: ep_group,
            pp: pp_group,
            stage,
            replica,
            sync,
            optimizer,
            local_sgd,
            norm_classes,
            schedule,
            lr_schedule,
            state: RunState { batches, scaler, monitor, rollbacks: 0 },
            nan_fault: cfg.faults.nan.clone(),
            pending_save: None,
            last_saved: None,
        })
    }

    /// Resumes (when configured), trains to the configured stop and makes
    /// sure the final state is in a checkpoint; returns the step it started
    /// from and that checkpoint.
    pub(super) fn run(mut self) -> Result<(u64, PathBuf)> {
        let cfg = &self.trainer.config;
        let resumed_from = self.resume()?;
        self.start_local_sgd()?;
        let stop = cfg.run.steps.min(cfg.run.stop_after.unwrap_or(u64::MAX));
        let mut done = resumed_from;
        while done < stop {
            done = self.step(done, stop)?;
        }
        let last = self.finish(done)?;
        Ok((resumed_from, last))
    }

    /// Loads the newest valid checkpoint, with `checkpoint.resume`; returns
    /// its step (0 without one).
    fn resume(&mut self) -> Result<u64> {
        if !self.trainer.config.checkpoint.resume {
            return Ok(0);
        }
        let mut state = WithOuterMomentum::new(self.optimizer.state_mut(), self.local_sgd.as_mut());
        match self.shared.ckpt.load_latest_valid(&self.model, Some(&mut state), &self.cx)? {
            Some(r) => {
                self.state.resume(&r.manifest.extra)?;
                restore_fp8(&self.cx, &r.manifest.extra)?;
                Ok(r.manifest.step)
            }
            None => Ok(0),
        }
    }

    /// Takes step `done + 1` (the steps after `stop` are another job's);
    /// returns the steps done after it: `done + 1`, or the step a rollback
    /// went back to.
    fn step(&mut self, done: u64, stop: u64) -> Result<u64> {
        let trainer = self.trainer;
        let cfg = &trainer.config;
        let started = Instant::now();
        trainer.strike(self.rank, done + 1, &self.cx)?;
        let tracing = done < cfg.run.trace_steps;
        let mut pass = self.forward_backward(done, started, tracing)?;
        // The step's FP8 amaxes set the next step's scales.
        self.cx.end_fp8_step()?;
        let mut events = Vec::new();

        // The gradients' global norm, measured once on the (loss-scaled)
        // gradients: not finite on an fp16 overflow. The monitor judges it;
        // the loss scale and clipping are applied inside the update
        // (`grad_scale`), so gradients held in half precision are never
        // rewritten. A ZeRO engine measures it over its shards, each class
        // of parameter summed over the groups it is split over (tp, ep, pp).
        let loss_scale = self.state.scaler.as_ref().map_or(1.0, |s| s.scale());
        let scaled = match self.optimizer.zero() {
            Some(zero) => {
                let classes = &self.norm_classes;
                let squares = zero.grad_squares(NormClasses::COUNT, |p| classes.class(p))?;
                let squares = <[f64; NormClasses::COUNT]>::try_from(squares)
                    .map_err(|_| tessera_core::Error::state_mismatch("trainer", "the engine returned another number of norm classes"))?;
                classes.norm(squares, &self.cx)?
            }
            None => self.norm_classes.grad_norm(&self.model, &self.cx)?,
        };
        // Under Local SGD each replica has gradients of its own: each clips
        // by its own norm, but what is judged (an overflow, a spike) is
        // their root mean square, the same on every rank (not finite when
        // any is not), so that every replica skips or rolls back together.
        let own = scaled;
        let scaled = match self.local_sgd {
            Some(_) => self.over_replicas(own * own)?.sqrt(),
            None => own,
        };
        // Under loss scaling a norm that is not finite is an overflow (the
        // scale backs off); otherwise it is the monitor's to judge.
        let finite = self.state.scaler.is_none() || scaled.is_finite();
        pass.grad_norm = finite.then_some(scaled / loss_scale);
        let mut grad_scale = 1.0 / loss_scale;
        if finite && own.is_finite() && cfg.optim.clip > 0.0 {
            grad_scale *= clip_factor(own / loss_scale, cfg.optim.clip);
        }
        let norm = pass.grad_norm.unwrap_or(0.0);
        // Judged under the number of the metrics line it lands on.
        let anomaly = if finite { self.state.monitor.observe(done + 1, pass.loss, norm) } else { None };

        let opt_started = Instant::now();
        let mut skipped = true;
        // A gradient-norm spike alone is recorded, not acted on: clipping
        // already bounds the update, and norms rise legitimately when a
        // model starts learning something new. NaNs and loss spikes are
        // what rollbacks are for.
        let anomaly = match anomaly {
            Some(a @ Anomaly::GradNormSpike { .. }) => {
                events.push(Event::Anomaly { detail: describe(&a) });
                self.state.monitor.learn(pass.loss, norm);
                None
            }
            other => other,
        };
        if let Some(a) = anomaly {
            events.push(Event::Anomaly { detail: describe(&a) });
            self.optimizer.discard_grads(&self.model)?;
            if cfg.stability.rollback {
                if let Some(to) = self.roll_back(done, &mut events)? {
                    self.start_local_sgd()?;
                    self.report(done + 1, &pass, true, events)?;
                    return Ok(to);
                }
            }
        } else if !finite {
            self.optimizer.discard_grads(&self.model)?;
            if let Some(s) = self.state.scaler.as_mut() {
                s.update(false);
                events.push(Event::Overflow { scale: s.scale() });
            }
        } else {
            self.optimizer.step(pass.lr, grad_scale)?;
            if let Some(s) = self.state.scaler.as_mut() {
                s.update(true);
            }
            skipped = false;
        }
        let trace = self.shared.trace;
        if tracing {
            trace.record(self.rank, "optimizer", "compute", opt_started, Instant::now());
        }
        let done = done + 1;
        // The replicas meet every `local_sgd.every` steps and after the
        // last, so that the run ends (and checkpoints fall) on one model.
        if self.local_sgd.as_ref().is_some_and(|l| l.due(done) || done == cfg.run.steps) {
            let met = Instant::now();
            pass.sync = self.meet()?;
            if tracing {
                trace.record(self.rank, "outer step", "comm", met, Instant::now());
            }
        }
        let scheduled = cfg.checkpoint.every > 0 && done.is_multiple_of(cfg.checkpoint.every);
        let save_now = !skipped && (scheduled || done == stop);
        if save_now {
            events.push(Event::Checkpoint { dir: self.shared.ckpt.step_dir(done).display().to_string() });
        }
        if tracing {
            trace.record(self.rank, format!("step {done}"), "step", started, Instant::now());
        }
        // The step's line is written before its checkpoint: a job killed
        // during the save leaves the line, which the next job, resuming
        // from the checkpoint before, drops and writes again.
        self.report(done, &pass, skipped, events)?;
        if save_now {
            self.save(done, scheduled, stop)?;
        }
        Ok(done)
    }

    /// Runs step `done + 1`'s microbatches through the pipeline schedule
    /// (gradients accumulate) and synchronises the gradients; the loss is
    /// the mean over the replicas' microbatches, the same on every rank.
    fn forward_backward(&mut self, done: u64, started: Instant, tracing: bool) -> Result<Pass> {
        let trainer = self.trainer;
        let cfg = &trainer.config;
        let lr = self.lr_schedule.lr(done + 1);
        let micro = cfg.batch.grad_accum;
        let mut inputs = Vec::with_capacity(micro);
        let mut targets = Vec::with_capacity(micro);
        // Under context parallelism each rank keeps its chunks of every sequence.
        let context = self.cx.context_split();
        for _ in 0..micro {
            let (x, y) = self.state.batches.next_batch(&self.dev)?;
            inputs.push(context.local_of(&x, 1)?);
            targets.push(context.local_of(&y, 1)?);
        }
        let scale = self.state.scaler.as_ref().map_or(1.0, |s| s.scale());
        let vocab = trainer.facts.vocab;
        let ignore = self.state.batches.ignore_index();
        // Dropout draws a fresh mask each step, at the rows this replica
        // holds in the step's global batch (replica after replica).
        self.cx.set_step(done);
        self.cx.set_batch_offset((self.replica.index * micro * cfg.batch.micro_batch) as u64);
        // `faults.nan`: the step's loss, and so every gradient, is NaN.
        let poison = if self.nan_fault.take_if(|f| f.step == done + 1).is_some() { f64::NAN } else { 1.0 };
        let tp = self.tp.clone();
        let report = run_stage(&self.model, &mut self.cx, &self.schedule, self.stage, &inputs, |mb, logits: &Act<SplitHidden>| {
            let (l, saved) = vocab_parallel_cross_entropy(&*tp, logits, &targets[mb], vocab, ignore)?;
            let dl = vocab_parallel_cross_entropy_backward(logits, &targets[mb], vocab, ignore, &saved, poison * scale / micro as f64)?;
            Ok((poison * l.to_scalar()?, dl))
        })?;
        let trace = self.shared.trace;
        if tracing {
            for s in &report.spans {
                let category = if s.action.is_compute() { "compute" } else { "pipeline" };
                trace.record(self.rank, s.action.to_string(), category, s.start, s.end);
            }
        }

        let sync_started = Instant::now();
        // A weight tied across stages (the embedding and the head) sums over
        // them. A ZeRO engine reduces tied parameters only in `finish`, so
        // they sum before it; data parallelism averages them first, as it
        // always has (the same sum in another order would round otherwise,
        // and earlier runs would not reproduce bit for bit).
        let sync = match &self.sync {
            GradSync::Zero(_) => {
                sync_tied_grads(&self.model, &self.cx)?;
                self.sync.finish()?
            }
            _ => {
                let sync = self.sync.finish()?;
                sync_tied_grads(&self.model, &self.cx)?;
                sync
            }
        };
        if tracing {
            trace.record(self.rank, "grad sync", "comm", sync_started, Instant::now());
        }

        // Only the last stage computed losses.
        let last_stage = self.stage == cfg.mesh.pp - 1;
        let local = if last_stage { report.losses.iter().map(|(_, l)| l).sum::<f64>() / micro as f64 } else { 0.0 };
        let mut t = Tensor::from_vec(vec![local], [1], &self.dev)?;
        for g in [&self.dp, &self.ep, &self.pp] {
            t = g.all_reduce_sum(&t)?;
        }
        // Every rank of the data-parallel group (dp × cp) and the expert
        // group added its mean: context-parallel ranks the means over their
        // chunks, which average to the sequences' mean.
        let loss = t.to_scalar()? / (self.dp.size() * self.ep.size()) as f64;
        Ok(Pass { started, lr, loss, grad_norm: None, report, sync })
    }

    /// The sum of `x` over the data replicas, over their count.
    fn over_replicas(&self, x: f64) -> Result<f64> {
        let mut t = Tensor::from_vec(vec![x], [1], &self.dev)?;
        for g in [&self.dp, &self.ep] {
            t = g.all_reduce_sum(&t)?;
        }
        Ok(t.to_scalar()? / self.replica.count as f64)
    }

    /// Local SGD's global parameters from the model as it is now (the same
    /// on every replica: initialised from one seed, or loaded).
    fn start_local_sgd(&mut self) -> Result<()> {
        let Some(local) = self.local_sgd.as_mut() else { return Ok(()) };
        let values = local.params().iter().map(|p| self.optimizer.master_or_value(p)).collect::<Result<_>>()?;
        local.start(values)
    }

    /// The replicas meet: the outer step, and every replica set to its result.
    fn meet(&mut self) -> Result<SyncStats> {
        let Some(local) = self.local_sgd.as_mut() else { return Ok(SyncStats::default()) };
        let values: Vec<Tensor> = local.params().iter().map(|p| self.optimizer.master_or_value(p)).collect::<Result<_>>()?;
        let (global, stats) = local.meet(&values)?;
        for (p, v) in local.params().iter().zip(global) {
            self.optimizer.set_master_or_value(p, v)?;
        }
        Ok(stats)
    }

    /// After an anomaly in step `done + 1`, every rank goes back to the
    /// newest healthy checkpoint together (see [`RunState::roll_back`]) and
    /// records why in `events`. Returns the step it went back to, or `None`
    /// when there is none (the step is then only skipped).
    fn roll_back(&mut self, done: u64, events: &mut Vec<Event>) -> Result<Option<u64>> {
        let ckpt = self.shared.ckpt;
        // Every rank must see the same newest checkpoint: let saves in
        // flight land (rank 0's wait covers the merged manifest), then meet
        // every rank of the mesh.
        if let Some(h) = self.pending_save.take() {
            h.wait()?;
        }
        for g in [&self.tp, &self.dp, &self.ep, &self.pp] {
            g.barrier()?;
        }
        let Some((to, skipped)) =
            self.state.roll_back(ckpt, &self.model, &mut WithOuterMomentum::new(self.optimizer.state_mut(), self.local_sgd.as_mut()), &self.cx, done)?
        else {
            return Ok(None);
        };
        if self.rank == 0 {
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
        let micro = self.trainer.config.batch.grad_accum as u64;
        events.push(Event::Rollback { to_step: to, skipped_batches: (done + 1 - to) * micro });
        Ok(Some(to))
    }

    /// Reports this rank's figures of step `step` to the collector, which
    /// writes the metrics line once every rank has.
    fn report(&self, step: u64, pass: &Pass, skipped: bool, events: Vec<Event>) -> Result<()> {
        let r = RankStep::new(self.rank, pass, &self.state.scaler, &self.dev, skipped, events);
        let Some(comm) = self.shared.reports else {
            let collector = self.shared.collector.expect("ranks that are threads share the primary's collector");
            return collector.lock().report(step, r);
        };
        // Ranks are processes: every rank's figures, gathered.
        let rows = comm.all_gather(&r.to_row(&Device::cpu())?, 0)?;
        if let Some(collector) = self.shared.collector {
            let mut collector = collector.lock();
            for theirs in RankStep::from_rows(&rows.to_vec::<f64>()?, r)? {
                collector.report(step, theirs)?;
            }
        }
        Ok(())
    }

    /// Saves the state after step `done`: as a resume point when a job
    /// stops early (the next job resumes there, but rollbacks go where they
    /// would in an unstopped run); in the background when configured and
    /// training goes on (the next save, or a rollback's load, waits for
    /// it); otherwise now.
    fn save(&mut self, done: u64, scheduled: bool, stop: u64) -> Result<()> {
        let cfg = &self.trainer.config;
        let (ckpt, trace, rank) = (self.shared.ckpt, self.shared.trace, self.rank);
        let extra = self.extra()?;
        if let Some(h) = self.pending_save.take() {
            h.wait()?;
        }
        let state = WithOuterMomentum::new(self.optimizer.state_mut(), self.local_sgd.as_mut());
        let state = Some(&state as &dyn OptimizerState);
        let dir = if !scheduled && done < cfg.run.steps {
            trace.span(rank, "checkpoint", "io", || ckpt.save_resume_point(done, &self.model, state, &self.cx, extra))?
        } else if cfg.checkpoint.background && done < stop {
            let handle = trace.span(rank, "checkpoint snapshot", "io", || ckpt.save_in_background(done, &self.model, state, &self.cx, extra))?;
            self.pending_save = Some(handle);
            ckpt.step_dir(done)
        } else {
            trace.span(rank, "checkpoint", "io", || ckpt.save(done, &self.model, state, &self.cx, extra))?
        };
        self.last_saved = Some((done, dir));
        Ok(())
    }

    /// A checkpoint's `extra`: the run state, and the FP8 scalings of
    /// every pipeline stage (collective: every rank saves together).
    fn extra(&self) -> Result<serde_json::Value> {
        let mut extra = self.state.extra();
        extra["fp8"] = fp8_of_every_stage(&self.cx, self.trainer.config.precision.fp8)?;
        Ok(extra)
    }

    /// Waits for a save in flight and makes sure the state after step
    /// `done` is in a checkpoint (the last step may have been skipped, and
    /// so not saved); returns that checkpoint.
    fn finish(mut self, done: u64) -> Result<PathBuf> {
        if let Some(h) = self.pending_save.take() {
            h.wait()?;
        }
        if let Some((step, dir)) = self.last_saved.take() {
            if step == done {
                return Ok(dir);
            }
        }
        let extra = self.extra()?;
        let ckpt = self.shared.ckpt;
        let state = WithOuterMomentum::new(self.optimizer.state_mut(), self.local_sgd.as_mut());
        let state = Some(&state as &dyn OptimizerState);
        if done < self.trainer.config.run.steps {
            ckpt.save_resume_point(done, &self.model, state, &self.cx, extra)
        } else {
            ckpt.save(done, &self.model, state, &self.cx, extra)
        }
    }
}
