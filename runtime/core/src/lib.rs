//! Tessera's tensor core: dtypes, shapes, tensors, the devices and backends
//! that hold and compute them, and the differentiable operations ([`ops`])
//! every layer is built from.
//!
//! This is the bottom of Tessera's runtime: it imports only the kernels crate
//! (`tessera-kernels`) and knows nothing of meshes, modules or training.
//! Every other runtime crate builds on it and shares its [`Error`] type. Users
//! reach it through the `tessera` facade (`tessera::Tensor`, `tessera::ops`).

pub mod backend;
pub mod error;
pub mod file;
pub mod ops;
pub mod tensor;

pub use backend::{BackendDevice, Device, MemoryStats};
pub use error::{Error, Result};
pub use half::{bf16, f16};
pub use tensor::{DType, Element, Init, Shape, Tensor};
pub use tessera_kernels::rng::RngKey;
