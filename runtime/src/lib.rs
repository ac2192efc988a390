//! Tessera: define a model once as an annotated Rust struct, train and serve it
//! across many devices.
//!
//! This crate is what users depend on. It holds the tensor runtime
//! ([`Tensor`], [`Device`]), the backends that execute it, the differentiable
//! operations ([`ops`]) from which every layer is built, and the module
//! system ([`module`]) that models are written in.

pub mod backend;
pub mod dist;
mod error;
pub mod module;
pub mod nn;
pub mod ops;
pub mod tensor;

pub use backend::{BackendDevice, Device, MemoryStats};
pub use error::{Error, Result};
pub use half::{bf16, f16};
pub use tensor::{DType, Element, Init, Shape, Tensor};
pub use tessera_kernels::rng::RngKey;

/// The names most programs need.
pub mod prelude {
    pub use crate::module::{Act, Cx, Module, Param, PartialSum, Replicated, SplitHidden, SplitSeq};
    pub use crate::{DType, Device, Init, RngKey, Shape, Tensor};
}
