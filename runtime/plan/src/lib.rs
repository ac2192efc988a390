//! Tessera's planner: what a cluster can do, and what a parallel layout of
//! a model will cost on it.
//!
//! It is being built in pieces; docs/planner.md says what exists:
//!
//! - [`profile`]: a cluster's devices (peak rates, memory) and links
//!   (inside a node, between nodes), read from TOML; profiles of 8-GPU
//!   A100, H100 and H200 nodes ship with it ([`profile::shipped`]);
//! - [`collective`]: the time of each collective over a link;
//! - [`measure`]: this machine, measured: matrix-product rates by shape
//!   and dtype, memory bandwidth, and a communicator's all-reduce fitted to
//!   a latency and a bandwidth per group size;
//! - [`machine`]: this machine as a profile, for the CPU ranks that share
//!   it (what `tessera profile` writes);
//! - [`memory`]: the bytes of a rank's parameters, gradients and optimizer
//!   states by precision and ZeRO stage.

pub mod collective;
pub mod machine;
pub mod measure;
pub mod memory;
pub mod profile;
