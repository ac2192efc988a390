//! Training utilities that span ranks: global gradient-norm clipping.

mod clip;

pub use clip::{clip_grad_norm, global_grad_norm};
