//! A Chrome / Perfetto trace of a run: one track per rank.
//!
//! Ranks record spans (a name, a category, a start and an end) into a shared
//! [`Trace`]; [`Trace::write`] produces trace-event JSON that Perfetto
//! (ui.perfetto.dev) and `chrome://tracing` open, with one named track per
//! rank.

use parking_lot::Mutex;
use serde_json::{json, Value};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;
use tessera_core::{Error, Result};

/// One recorded span.
#[derive(Clone, Debug, PartialEq)]
pub struct Span {
    /// World rank: the track it is drawn on.
    pub rank: usize,
    /// What ran (e.g. `F3`, `B3.1`, `dp sync`, `optimizer`).
    pub name: String,
    /// Its category (`compute`, `comm`, `wait`, `step`), which Perfetto can filter on.
    pub category: &'static str,
    /// Start, in microseconds since the trace began.
    pub start_us: f64,
    /// Duration in microseconds.
    pub duration_us: f64,
}

#[derive(Debug)]
struct Inner {
    origin: Instant,
    tracks: Vec<String>,
    spans: Vec<Span>,
}

/// A trace shared by every rank of a run (cloning shares it).
#[derive(Clone, Debug)]
pub struct Trace(Arc<Mutex<Inner>>);

impl Trace {
    /// A trace with one track per rank, labelled by `tracks[rank]`
    /// (e.g. `rank 3 (dp1 tp1 pp0)`); times count from now.
    pub fn new(tracks: Vec<String>) -> Self {
        Trace(Arc::new(Mutex::new(Inner { origin: Instant::now(), tracks, spans: Vec::new() })))
    }

    fn lock(&self) -> parking_lot::MutexGuard<'_, Inner> {
        // A rank that panicked while recording leaves complete spans behind:
        // the data stays usable.
        self.0.lock()
    }

    /// Records a span of `rank` from `start` to `end`.
    pub fn record(&self, rank: usize, name: impl Into<String>, category: &'static str, start: Instant, end: Instant) {
        let mut inner = self.lock();
        let start_us = start.saturating_duration_since(inner.origin).as_secs_f64() * 1e6;
        let duration_us = end.saturating_duration_since(start).as_secs_f64() * 1e6;
        inner.spans.push(Span { rank, name: name.into(), category, start_us, duration_us });
    }

    /// Runs `f` and records it as a span of `rank`.
    pub fn span<T>(&self, rank: usize, name: impl Into<String>, category: &'static str, f: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let out = f();
        self.record(rank, name, category, start, Instant::now());
        out
    }

    /// Every span recorded so far.
    pub fn spans(&self) -> Vec<Span> {
        self.lock().spans.clone()
    }

    /// The trace as Chrome trace-event JSON.
    pub fn to_json(&self) -> Value {
        let inner = self.lock();
        let mut events = vec![json!({"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "tessera run"}})];
        for (rank, label) in inner.tracks.iter().enumerate() {
            events.push(json!({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": label}}));
            events.push(json!({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": rank, "args": {"sort_index": rank}}));
        }
        for s in &inner.spans {
            events.push(json!({"name": s.name, "cat": s.category, "ph": "X", "pid": 0, "tid": s.rank, "ts": s.start_us, "dur": s.duration_us}));
        }
        json!({"traceEvents": events, "displayTimeUnit": "ms"})
    }

    /// Writes the trace to `path` (e.g. `trace.json`).
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let text = serde_json::to_string(&self.to_json()).map_err(|e| Error::io(path, e.into()))?;
        tessera_core::file::write_atomic(path, text.as_bytes()).map_err(|e| Error::io(path, e))
    }
}
