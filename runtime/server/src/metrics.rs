//! What `GET /metrics` reports, in Prometheus' text format (version
//! 0.0.4): counts the server keeps (requests by endpoint and status, time
//! to first token, time per output token) and the engine's state as of its
//! last step (queue, running requests, KV cache use, preemptions, tokens).
//!
//! | metric | type | what |
//! |---|---|---|
//! | `tessera_requests_total{endpoint, status}` | counter | requests answered |
//! | `tessera_prompt_tokens_total` | counter | prompt tokens of admitted requests |
//! | `tessera_generation_tokens_total` | counter | tokens generated |
//! | `tessera_time_to_first_token_seconds` | histogram | from submission to the first token |
//! | `tessera_time_per_output_token_seconds` | histogram | between tokens after the first, per request |
//! | `tessera_requests_waiting` | gauge | requests waiting for admission |
//! | `tessera_requests_running` | gauge | requests admitted (prefilling or decoding) |
//! | `tessera_requests_pending` | gauge | requests submitted and not finished (the 429 limit counts these) |
//! | `tessera_kv_cache_usage_ratio` | gauge | share of KV blocks in use (not free nor evictable) |
//! | `tessera_preemptions_total` | counter | sequences preempted for KV room |
//! | `tessera_engine_steps_total` | counter | model forwards |
//! | `tessera_spec_proposed_tokens_total` | counter | tokens a speculative drafter proposed |
//! | `tessera_spec_accepted_tokens_total` | counter | proposed tokens the model accepted |

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::Duration;

use tessera_serve::driver::Driver;

/// Upper bounds of the latency histograms' buckets, in seconds.
const BUCKETS: [f64; 14] = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];

/// A Prometheus histogram with [`BUCKETS`].
#[derive(Clone, Debug, Default)]
struct Histogram {
    /// Observations at or below each bound (not cumulative; summed when written).
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    fn observe(&mut self, secs: f64) {
        if let Some(i) = BUCKETS.iter().position(|&b| secs <= b) {
            self.counts[i] += 1;
        }
        self.count += 1;
        self.sum += secs;
    }

    fn write(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (bound, n) in BUCKETS.iter().zip(self.counts) {
            cumulative += n;
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}", self.count, self.sum, self.count);
    }
}

#[derive(Debug, Default)]
struct Counts {
    /// (endpoint, status) → requests.
    requests: BTreeMap<(&'static str, u16), u64>,
    prompt_tokens: u64,
    ttft: Histogram,
    tpot: Histogram,
}

/// The server's own counts; the engine's come from the driver when written.
#[derive(Debug, Default)]
pub struct Metrics {
    counts: Mutex<Counts>,
}

impl Metrics {
    fn counts(&self) -> std::sync::MutexGuard<'_, Counts> {
        self.counts.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A request to `endpoint` answered with `status`.
    pub fn request(&self, endpoint: &'static str, status: u16) {
        *self.counts().requests.entry((endpoint, status)).or_default() += 1;
    }

    /// An admitted request of `tokens` prompt tokens.
    pub fn prompt(&self, tokens: usize) {
        self.counts().prompt_tokens += tokens as u64;
    }

    /// A finished request: the wait for its first token, and the time its
    /// later `tokens - 1` tokens took.
    pub fn finished(&self, first_token: Option<Duration>, after_first: Duration, tokens: usize) {
        let mut c = self.counts();
        if let Some(t) = first_token {
            c.ttft.observe(t.as_secs_f64());
        }
        if tokens > 1 {
            c.tpot.observe(after_first.as_secs_f64() / (tokens - 1) as f64);
        }
    }

    /// Everything, as Prometheus text.
    pub fn render(&self, driver: &Driver) -> String {
        let state = driver.state();
        let c = self.counts();
        let mut out = String::new();
        let _ = writeln!(out, "# HELP tessera_requests_total Requests answered, by endpoint and HTTP status.\n# TYPE tessera_requests_total counter");
        for ((endpoint, status), n) in &c.requests {
            let _ = writeln!(out, "tessera_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}} {n}");
        }
        let mut scalar = |name: &str, kind: &str, help: &str, value: f64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}");
        };
        scalar("tessera_prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", c.prompt_tokens as f64);
        scalar("tessera_generation_tokens_total", "counter", "Tokens generated.", state.stats.tokens_generated as f64);
        scalar("tessera_requests_waiting", "gauge", "Requests waiting for admission.", state.waiting as f64);
        scalar("tessera_requests_running", "gauge", "Requests admitted (prefilling or decoding).", state.running as f64);
        scalar("tessera_requests_pending", "gauge", "Requests submitted and not finished.", driver.pending() as f64);
        let used = state.kv_blocks.saturating_sub(state.kv_blocks_available);
        let ratio = if state.kv_blocks == 0 { 0.0 } else { used as f64 / state.kv_blocks as f64 };
        scalar("tessera_kv_cache_usage_ratio", "gauge", "Share of KV cache blocks in use.", ratio);
        scalar("tessera_preemptions_total", "counter", "Sequences preempted for KV cache room.", state.stats.preemptions as f64);
        scalar("tessera_engine_steps_total", "counter", "Model forwards.", state.stats.steps as f64);
        scalar("tessera_spec_proposed_tokens_total", "counter", "Tokens a speculative drafter proposed.", state.stats.draft_proposed as f64);
        scalar("tessera_spec_accepted_tokens_total", "counter", "Proposed tokens the model accepted.", state.stats.draft_accepted as f64);
        c.ttft.write(&mut out, "tessera_time_to_first_token_seconds", "From submission to the first token.");
        c.tpot.write(&mut out, "tessera_time_per_output_token_seconds", "Between tokens after the first, per request.");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative_and_count_everything() {
        let mut h = Histogram::default();
        for s in [0.0005, 0.003, 0.003, 0.7, 100.0] {
            h.observe(s);
        }
        let mut out = String::new();
        h.write(&mut out, "x", "test");
        assert!(out.contains("x_bucket{le=\"0.001\"} 1\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"0.005\"} 3\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"1\"} 4\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"30\"} 4\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"+Inf\"} 5\nx_sum 100.7065\nx_count 5\n"), "{out}");
    }
}
