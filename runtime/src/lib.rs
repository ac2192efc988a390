//! Tessera: define a model once as an annotated Rust struct, train and serve it
//! across many devices.
//!
//! This crate is what users depend on. It holds the tensor runtime
//! ([`Tensor`], [`Device`]), the backends that execute it, and the
//! differentiable operations ([`ops`]) from which every layer is built: each
//! has a forward and a hand-written backward.

pub mod backend;
mod error;
pub mod ops;
pub mod tensor;

pub use backend::{BackendDevice, Device, MemoryStats};
pub use error::{Error, Result};
pub use tensor::{DType, Element, Shape, Tensor};
pub use tessera_kernels::rng::RngKey;
pub use tensor::Init;
pub use half::{bf16, f16};

/// The names most programs need.
pub mod prelude {
    pub use crate::{DType, Device, Init, RngKey, Shape, Tensor};
}
