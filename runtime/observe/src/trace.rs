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
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tessera_core::{Error, Result};

/// The categories spans are recorded under (a merged span keeps its own
/// when it is one of these).
const CATEGORIES: [&str; 7] = ["compute", "comm", "wait", "step", "io", "pipeline", "other"];

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
    /// The wall-clock time of `origin`, which places the traces of
    /// different processes on one time line.
    origin_wall: SystemTime,
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
        Trace(Arc::new(Mutex::new(Inner { origin: Instant::now(), origin_wall: SystemTime::now(), tracks, spans: Vec::new() })))
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

    /// The spans recorded so far, with the wall-clock time they count from,
    /// as JSON text: what another process's trace [`merge`](Self::merge)s.
    pub fn export(&self) -> String {
        let inner = self.lock();
        let origin_us = inner.origin_wall.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs_f64() * 1e6;
        let spans: Vec<Value> =
            inner.spans.iter().map(|s| json!({"rank": s.rank, "name": s.name, "cat": s.category, "start": s.start_us, "dur": s.duration_us})).collect();
        json!({"origin_us": origin_us, "spans": spans}).to_string()
    }

    /// Adds the spans of another process's trace ([`export`](Self::export)),
    /// moved onto this trace's time line by the two traces' wall-clock
    /// origins (the same clock on one machine; across machines, as close as
    /// their clocks agree). A span of a category this crate does not record
    /// is filed as `other`.
    pub fn merge(&self, exported: &str) -> Result<()> {
        let bad = |detail: String| Error::invalid("Trace::merge", detail);
        let v: Value = serde_json::from_str(exported).map_err(|e| bad(format!("not an exported trace: {e}")))?;
        let origin_us = v["origin_us"].as_f64().ok_or_else(|| bad("no origin_us".into()))?;
        let spans = v["spans"].as_array().ok_or_else(|| bad("no spans".into()))?;
        let mut inner = self.lock();
        let ours = inner.origin_wall.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs_f64() * 1e6;
        let shift = origin_us - ours;
        for s in spans {
            let field = |k: &str| s[k].as_f64().ok_or_else(|| bad(format!("a span without {k}")));
            let rank = s["rank"].as_u64().ok_or_else(|| bad("a span without rank".into()))? as usize;
            let name = s["name"].as_str().unwrap_or_default().to_string();
            let category = CATEGORIES.iter().copied().find(|c| Some(*c) == s["cat"].as_str()).unwrap_or("other");
            inner.spans.push(Span { rank, name, category, start_us: field("start")? + shift, duration_us: field("dur")? });
        }
        Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Another process's spans land on this trace's time line, shifted by
    /// the difference of the two origins, with their ranks, names and
    /// categories; a damaged export is an error.
    #[test]
    fn merged_spans_keep_their_place_in_time() {
        let ours = Trace::new(vec!["rank 0".into(), "rank 1".into()]);
        std::thread::sleep(Duration::from_millis(20));
        let theirs = Trace::new(vec!["rank 0".into(), "rank 1".into()]);
        let t0 = Instant::now();
        theirs.record(1, "F0", "compute", t0, t0 + Duration::from_millis(5));
        theirs.record(1, "odd", "made-up", t0, t0 + Duration::from_millis(1));
        ours.record(0, "F0", "compute", t0, t0 + Duration::from_millis(5));
        ours.merge(&theirs.export()).unwrap();
        let spans = ours.spans();
        assert_eq!(spans.len(), 3);
        let (mine, merged) = (&spans[0], &spans[1]);
        assert_eq!((merged.rank, merged.name.as_str(), merged.category), (1, "F0", "compute"));
        assert_eq!(spans[2].category, "other");
        assert!((merged.duration_us - mine.duration_us).abs() < 1.0);
        // The same instant, seen from both origins: within the clocks' jitter.
        assert!((merged.start_us - mine.start_us).abs() < 2_000.0, "{} vs {}", merged.start_us, mine.start_us);
        assert!(ours.merge("{not json").is_err());
        assert!(ours.merge(r#"{"origin_us": 1.0, "spans": [{"rank": 0}]}"#).is_err());
    }
}
