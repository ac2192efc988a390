//! Training utilities: global gradient-norm clipping, dynamic loss scaling,
//! learning-rate schedules, a stability monitor, and the configured
//! training loop ([`Trainer`], [`TrainConfig`]).
//!
//! Its place: the top of the runtime. It imports every layer below (dist,
//! nn, optim, parallel, data, observe) and owns what a run needs beyond them:
//! the configured [`Trainer`], clipping, loss scaling, schedules, the stability
//! monitor, fault injection and checkpoints ([`ckpt`]). Users reach it as
//! `tessera::train` and `tessera::ckpt`.

pub mod ckpt;

mod clip;
mod config;
mod faults;
mod job;
mod memory_check;
mod monitor;
mod ranks;
mod run_lock;
mod scaler;
mod schedule;
mod suggest;
mod trainer;

pub use clip::{clip_factor, clip_grad_norm, clip_to_norm, global_grad_norm, NormClasses};
pub use config::{
    BatchConfig, CheckpointConfig, DataConfig, LaunchMode, MeshConfig, OptimConfig, PrecisionConfig, ProcessComms, RankDevice, RecomputeConfig, RunConfig,
    StabilityConfig, TrainConfig, ZeroSection,
};
pub(crate) use faults::kill_this_process;
pub use faults::{AtStep, FaultConfig, KillFault, KillPoint, RankAtStep, SlowRank};
pub use job::Job;
pub use memory_check::planned_layout;
pub use monitor::{Anomaly, MonitorState, StabilityMonitor};
pub use run_lock::{RunLock, LOCK_FILE};
pub use scaler::LossScaler;
pub use schedule::WarmupCosine;
pub use suggest::closest;
pub use tessera_data::Batches;
pub use trainer::{ModelFacts, Replica, RunSummary, Trainer};
