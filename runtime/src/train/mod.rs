//! Training utilities that span ranks: global gradient-norm clipping and
//! dynamic loss scaling.

mod clip;
mod scaler;

pub use clip::{clip_grad_norm, global_grad_norm};
pub use scaler::LossScaler;
