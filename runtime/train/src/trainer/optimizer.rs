//! What updates a rank's parameters, and how its gradients are made the
//! same on every data replica first.

use std::sync::Arc;
use tessera_core::{Error, Result, Tensor};
use tessera_nn::module::{self, Module, Param};
use tessera_optim::{AdamW, OptimizerState};
use tessera_parallel::data::{DataParallel, SyncStats};
use tessera_parallel::zero::Zero;

/// The optimizer of one rank: AdamW over the rank's whole model, or this
/// rank's shard of a ZeRO engine (which holds the shard's master weights
/// and moments).
pub(super) enum RankOptimizer {
    AdamW(AdamW),
    Zero(Arc<Zero>),
}

impl RankOptimizer {
    /// The state checkpoints save and restore.
    pub(super) fn state_mut(&mut self) -> &mut dyn OptimizerState {
        match self {
            RankOptimizer::AdamW(o) => o,
            RankOptimizer::Zero(z) => z,
        }
    }

    /// Updates the parameters at learning rate `lr` from the synchronised
    /// gradients multiplied by `grad_scale` inside the update (the clipping
    /// factor over the loss scale); the gradients are then cleared.
    pub(super) fn step(&mut self, lr: f64, grad_scale: f64) -> Result<()> {
        match self {
            RankOptimizer::AdamW(o) => {
                o.step_scaled(lr, grad_scale)?;
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

    /// `param`'s full-precision value (its master copy where it has one).
    pub(super) fn master_or_value(&self, param: &Param) -> Result<Tensor> {
        match self {
            RankOptimizer::AdamW(o) => o.master_or_value(param),
            RankOptimizer::Zero(_) => Err(Error::state_mismatch("trainer", "ZeRO shards the parameters' master copies; Local SGD needs them whole")),
        }
    }

    /// Sets `param`'s full-precision value (its master copy where it has one).
    pub(super) fn set_master_or_value(&mut self, param: &Param, value: Tensor) -> Result<()> {
        match self {
            RankOptimizer::AdamW(o) => o.set_master_or_value(param, value),
            RankOptimizer::Zero(_) => Err(Error::state_mismatch("trainer", "ZeRO shards the parameters' master copies; Local SGD needs them whole")),
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
    /// One replica: nothing to do.
    None,
}

impl GradSync {
    /// Finishes the synchronisation; returns its communication figures.
    pub(super) fn finish(&self) -> Result<SyncStats> {
        match self {
            GradSync::Overlapped(o) => o.finish(),
            GradSync::Zero(z) => {
                z.finish()?;
                Ok(z.sync_stats())
            }
            GradSync::None => Ok(SyncStats::default()),
        }
    }
}
