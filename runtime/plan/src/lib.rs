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
//!   it or for a node of its GPUs (what `tessera profile` writes);
//! - [`job`]: a launched job of processes as a profile, over its own
//!   communicators (Tessera's, MPI, NCCL), inside and between nodes;
//! - [`memory`]: the bytes of a rank's parameters, gradients and optimizer
//!   states by precision and ZeRO stage;
//! - [`estimate`]: the cost model: a layout's step time (compute, model-
//!   parallel communication, the pipeline's bubble, data-parallel
//!   communication, the optimizer) and memory per rank, from the model's
//!   own description and a profile;
//! - [`search`]: every layout of a model over a cluster, estimated,
//!   filtered by memory and ranked, keeping the parts of a layout
//!   [`fixed`] by the user.

pub mod collective;
pub mod estimate;
pub mod fixed;
pub mod job;
pub mod machine;
pub mod measure;
pub mod memory;
pub mod profile;
pub mod search;
