//! What ranks report of each step, and the metrics line, progress bar and
//! summary made of it.

use crate::LossScaler;
use std::collections::BTreeMap;
use std::time::Instant;
use tessera_core::{Device, Error, Result, Tensor};
use tessera_observe::{Event, MetricsLog, StepMetrics};
use tessera_parallel::data::SyncStats;
use tessera_parallel::pipeline::StageReport;

/// What a rank measured of one step's forward, backward and synchronisation.
pub(super) struct Pass {
    /// When the step began.
    pub(super) started: Instant,
    /// The step's learning rate.
    pub(super) lr: f64,
    /// The step's loss, the same on every rank.
    pub(super) loss: f64,
    /// The global gradient norm, where it was measured.
    pub(super) grad_norm: Option<f64>,
    /// The pipeline stage's compute and waiting times.
    pub(super) report: StageReport,
    /// Gradient communication in all (wall time in flight) and what the
    /// backward did not hide.
    pub(super) sync: SyncStats,
}

/// One rank's figures for one step.
#[derive(Clone, Debug, Default)]
pub(super) struct RankStep {
    rank: usize,
    loss: f64,
    grad_norm: Option<f64>,
    lr: f64,
    loss_scale: Option<f64>,
    step_time: f64,
    compute: f64,
    comm: f64,
    exposed: f64,
    grad_bytes: f64,
    bubble: f64,
    peak_memory: usize,
    skipped: bool,
    events: Vec<Event>,
}

/// Where ranks report their steps; the last to report a step writes it.
pub(super) struct Collector {
    pub(super) world: usize,
    pub(super) pending: BTreeMap<u64, Vec<RankStep>>,
    /// What happened before the first step (start-up clean-up), reported
    /// on the first metrics line.
    pub(super) carried: Vec<Event>,
    pub(super) log: MetricsLog,
    pub(super) bar: indicatif::ProgressBar,
    pub(super) losses: Vec<(u64, f64)>,
    pub(super) events: Vec<(u64, Event)>,
    pub(super) tokens_per_step: u64,
    pub(super) flops_per_token: f64,
    pub(super) peak: f64,
    pub(super) tokens: u64,
}

impl RankStep {
    /// Rank `rank`'s figures for the step `pass` measured, as it ended.
    pub(super) fn new(rank: usize, pass: &Pass, scaler: &Option<LossScaler>, dev: &Device, skipped: bool, events: Vec<Event>) -> Self {
        RankStep {
            rank,
            loss: pass.loss,
            grad_norm: pass.grad_norm,
            lr: pass.lr,
            loss_scale: scaler.as_ref().map(|s| s.scale()),
            step_time: pass.started.elapsed().as_secs_f64(),
            compute: pass.report.compute.as_secs_f64(),
            comm: pass.sync.comm.as_secs_f64(),
            exposed: pass.sync.exposed.as_secs_f64(),
            grad_bytes: pass.sync.bytes as f64,
            bubble: pass.report.waiting.as_secs_f64(),
            peak_memory: dev.memory_stats().peak,
            skipped,
            // Every rank sees the same events; one copy is enough.
            events: if rank == 0 { events } else { Vec::new() },
        }
    }
}

/// Figures of a [`RankStep`] as a row of numbers, for gathering.
const ROW: usize = 15;

impl RankStep {
    /// This rank's figures as a `[1, ROW]` tensor (its events stay here:
    /// every rank sees the same, and the primary keeps its own).
    pub(super) fn to_row(&self, dev: &Device) -> Result<Tensor> {
        let flag = |b: bool| if b { 1.0 } else { 0.0 };
        let row = vec![
            self.rank as f64,
            self.loss,
            flag(self.grad_norm.is_some()),
            self.grad_norm.unwrap_or(0.0),
            self.lr,
            flag(self.loss_scale.is_some()),
            self.loss_scale.unwrap_or(0.0),
            self.step_time,
            self.compute,
            self.comm,
            self.exposed,
            self.bubble,
            self.peak_memory as f64,
            flag(self.skipped),
            self.grad_bytes,
        ];
        Tensor::from_vec(row, [1, ROW], dev)
    }

    /// Every rank's figures from the gathered rows; `own` (this rank's,
    /// with its events) stands for its own row.
    pub(super) fn from_rows(rows: &[f64], own: RankStep) -> Result<Vec<RankStep>> {
        if !rows.len().is_multiple_of(ROW) {
            return Err(Error::state_mismatch("trainer", format!("gathered {} figures, not rows of {ROW}", rows.len())));
        }
        let mut own = Some(own);
        Ok(rows
            .chunks(ROW)
            .map(|r| {
                let rank = r[0] as usize;
                match own.take_if(|o| o.rank == rank) {
                    Some(o) => o,
                    None => RankStep {
                        rank,
                        loss: r[1],
                        grad_norm: (r[2] != 0.0).then_some(r[3]),
                        lr: r[4],
                        loss_scale: (r[5] != 0.0).then_some(r[6]),
                        step_time: r[7],
                        compute: r[8],
                        comm: r[9],
                        exposed: r[10],
                        bubble: r[11],
                        peak_memory: r[12] as usize,
                        skipped: r[13] != 0.0,
                        grad_bytes: r[14],
                        events: Vec::new(),
                    },
                }
            })
            .collect())
    }
}

impl Collector {
    pub(super) fn report(&mut self, step: u64, r: RankStep) -> Result<()> {
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
            comm_s: max(|r| r.comm),
            exposed_comm_s: max(|r| r.exposed),
            grad_bytes: max(|r| r.grad_bytes) as u64,
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
