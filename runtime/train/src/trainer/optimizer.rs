//! What updates a rank's parameters, and how its gradients are made the
//! same on every data replica first.

use std::sync::Arc;
use std::time::{Duration, Instant};
use tessera_core::{ops, Result};
use tessera_dist::Communicator;
use tessera_nn::module::{self, Module, Param};
use tessera_optim::{AdamW, OptimizerState};
use tessera_parallel::data::DataParallel;
use tessera_parallel::zero::Zero;

/// The optimizer of one rank: AdamW over the rank's whole model, or this
/// rank's shard of a ZeRO engine (which holds the shard's master weights
/// and moments).
pub(super) enum RankOptimizer {
    AdamW(AdamW),
    Zero(Arc<Zero>),
}

impl RankOptimizer {
    /// The state checkpoints save.
    pub(super) fn state(&self) -> &dyn OptimizerState {
        match self {
            RankOptimizer::AdamW(o) => o,
            RankOptimizer::Zero(z) => &**z,
        }
    }

    /// The state a checkpoint restores.
    pub(super) fn state_mut(&mut self) -> &mut dyn OptimizerState {
        match self {
            RankOptimizer::AdamW(o) => o,
            RankOptimizer::Zero(z) => z,
        }
    }

    /// Updates the parameters at learning rate `lr` from the synchronised
    /// gradients, which are then cleared. A ZeRO engine multiplies them by
    /// `grad_scale` in its update (the clipping factor over the loss
    /// scale); AdamW's gradients were scaled in place, so it takes 1.
    pub(super) fn step(&mut self, lr: f64, grad_scale: f64) -> Result<()> {
        match self {
            RankOptimizer::AdamW(o) => {
                debug_assert_eq!(grad_scale, 1.0, "AdamW's gradients are scaled in place");
                o.step(lr)?;
                o.zero_grad();
                Ok(())
            }
            RankOptimizer::Zero(z) => z.step_scaled(lr, grad_scale),
        }
    }

    /// Drops this step's gradients without an update (an overflow, an anomaly).
    pub(super) fn discard_grads<M: Module>(&self, model: &M) -> Result<()> {
        match self {
            RankOptimizer::AdamW(_) => module::zero_grad(model),
            RankOptimizer::Zero(z) => z.discard_grads(),
        }
    }

    /// The ZeRO engine, which holds the averaged gradients (whole at stage
    /// 1, a shard at stages 2 and 3) and measures their norm itself.
    pub(super) fn zero(&self) -> Option<&Zero> {
        match self {
            RankOptimizer::Zero(z) => Some(z),
            RankOptimizer::AdamW(_) => None,
        }
    }
}

/// How a rank's gradients are made the same on every data replica after
/// the backward.
pub(super) enum GradSync {
    /// Buckets all-reduced while the backward still ran.
    Overlapped(Arc<DataParallel>),
    /// ZeRO's reduce-scatter (or, at stage 1, its all-reduce).
    Zero(Arc<Zero>),
    /// With expert parallelism: every gradient averaged after the backward
    /// over `replicas` data replicas (see [`average_grads`]).
    Averaged { dp: Arc<dyn Communicator>, ep: Arc<dyn Communicator>, replicas: usize },
    /// One replica: nothing to do.
    None,
}

impl GradSync {
    /// Finishes the synchronisation; returns the communication time the
    /// backward did not hide.
    pub(super) fn finish<M: Module>(&self, model: &M) -> Result<Duration> {
        let started = Instant::now();
        match self {
            GradSync::Overlapped(o) => return Ok(o.finish()?.exposed),
            GradSync::Zero(z) => z.finish()?,
            GradSync::Averaged { dp, ep, replicas } => average_grads(model, &**dp, &**ep, *replicas)?,
            GradSync::None => return Ok(Duration::ZERO),
        }
        Ok(started.elapsed())
    }
}

/// Averages every gradient over the data replicas when expert parallelism
/// is on: an expert's gradient already holds every expert-parallel rank's
/// tokens (the all-to-all brought them), every other parameter is also
/// replicated over the expert group and sums over it.
fn average_grads<M: Module>(model: &M, dp: &dyn Communicator, ep: &dyn Communicator, replicas: usize) -> Result<()> {
    // Each parameter once, with whether the visitor places it in an expert.
    let mut params: Vec<(Param, bool)> = Vec::new();
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
