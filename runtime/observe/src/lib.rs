//! Observability of a training run: per-step metrics (`metrics.jsonl`), a
//! Chrome / Perfetto trace with one track per rank, a loss-curve PNG, and
//! the FLOP count behind throughput and MFU figures.
//!
//! Its place: on the tensor core alone, so any layer above may report
//! through it. It owns the metrics log, traces, FLOP counts and the loss plot
//! (and the `png` dependency). Users reach it as `tessera::observe`.

mod flops;
mod metrics;
mod plot;
mod trace;

pub use flops::{transformer_flops_per_token, PeakRate};
pub use metrics::{read_metrics, Event, MetricsLog, StepMetrics};
pub use plot::{LinePlot, Rgb, Series, PALETTE};
pub use trace::{Span, Trace};
