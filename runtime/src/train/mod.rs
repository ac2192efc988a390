//! Training utilities: global gradient-norm clipping, dynamic loss scaling
//! and learning-rate schedules.

mod clip;
mod scaler;
mod schedule;

pub use clip::{clip_grad_norm, global_grad_norm};
pub use scaler::LossScaler;
pub use schedule::WarmupCosine;
