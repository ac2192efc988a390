//! Training utilities: global gradient-norm clipping, dynamic loss scaling,
//! learning-rate schedules, a stability monitor, and the configured
//! training loop ([`Trainer`], [`TrainConfig`]).

mod clip;
mod config;
mod faults;
mod memory_check;
mod monitor;
mod ranks;
mod run_lock;
mod scaler;
mod schedule;
mod suggest;
mod trainer;

pub use clip::{clip_grad_norm, clip_to_norm, global_grad_norm};
pub use config::{BatchConfig, CheckpointConfig, DataConfig, MeshConfig, OptimConfig, PrecisionConfig, RankDevice, RecomputeConfig, RunConfig, StabilityConfig, TrainConfig, ZeroSection};
pub use faults::{AtStep, FaultConfig, KillFault, KillPoint, RankAtStep, SlowRank};
pub(crate) use faults::kill_this_process;
pub use monitor::{Anomaly, MonitorState, StabilityMonitor};
pub use run_lock::{RunLock, LOCK_FILE};
pub use scaler::LossScaler;
pub use schedule::WarmupCosine;
pub use suggest::closest;
pub use crate::data::Batches;
pub use trainer::{ModelFacts, Replica, RunSummary, Trainer};
