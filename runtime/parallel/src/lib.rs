//! Parallel engines: data parallelism with overlapped, bucketed gradient
//! all-reduces, and pipeline schedules.
//!
//! Its place: above the module system, optimizers and communicators, below
//! the trainer. It owns the engines that spread one model over many ranks:
//! data parallelism, ZeRO and pipelines (tensor, sequence and expert
//! parallelism live in the layers themselves). Users reach it as
//! `tessera::parallel`.

mod buckets;
pub mod data;
pub mod local_sgd;
pub mod pipeline;
mod powersgd;
pub mod zero;
