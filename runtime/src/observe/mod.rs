//! Observability of a training run: per-step metrics (`metrics.jsonl`), a
//! Chrome / Perfetto trace with one track per rank, a loss-curve PNG, and
//! the FLOP count behind throughput and MFU figures.

mod flops;
mod metrics;
mod plot;
mod trace;

pub use flops::{transformer_flops_per_token, PeakRate};
pub use metrics::{read_metrics, Event, MetricsLog, StepMetrics};
pub use plot::{LinePlot, Rgb, Series, PALETTE};
pub use trace::{Span, Trace};
