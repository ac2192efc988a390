//! Training utilities: global gradient-norm clipping, dynamic loss scaling,
//! learning-rate schedules and a stability monitor.

mod clip;
mod monitor;
mod scaler;
mod schedule;

pub use clip::{clip_grad_norm, global_grad_norm};
pub use monitor::{Anomaly, StabilityMonitor};
pub use scaler::LossScaler;
pub use schedule::WarmupCosine;
