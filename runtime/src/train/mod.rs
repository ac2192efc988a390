//! Training utilities: global gradient-norm clipping, dynamic loss scaling,
//! learning-rate schedules, a stability monitor, and the configured
//! training loop ([`Trainer`], [`TrainConfig`]).

mod clip;
mod config;
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
pub use monitor::{Anomaly, StabilityMonitor};
pub use run_lock::{RunLock, LOCK_FILE};
pub use scaler::LossScaler;
pub use schedule::WarmupCosine;
pub use suggest::closest;
pub use trainer::{Batches, ModelFacts, Replica, RunSummary, Trainer};
