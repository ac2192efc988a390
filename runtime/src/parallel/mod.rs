//! Parallel engines: data parallelism with overlapped, bucketed gradient
//! all-reduces, and pipeline schedules.

pub mod data;
pub mod zero;
pub mod pipeline;
