//! Parallel engines: pipeline schedules (and, later, data parallelism and ZeRO).

pub mod pipeline;
