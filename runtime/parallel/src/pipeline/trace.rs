//! A simulation drawn as a Chrome / Perfetto trace: one track per stage.

use super::{Action, Simulation};
use std::fmt::Write;

impl Simulation {
    /// The simulation as Chrome trace-event JSON (open it in Perfetto or
    /// `chrome://tracing`): one track per stage, forwards and backwards as
    /// slices (and the halves of a split backward), waits for a tensor as `wait` slices, sends as instants. Costs
    /// are written as microseconds, the format's unit.
    ///
    /// ```
    /// use tessera::parallel::pipeline::{one_f_one_b, Costs};
    ///
    /// let trace = one_f_one_b(2, 2)?.simulate(&Costs::new(1.0, 2.0))?.to_chrome_trace();
    /// assert!(trace.starts_with("{\"traceEvents\":["));
    /// assert!(trace.contains("\"name\":\"stage 1\""));
    /// # Ok::<(), tessera::Error>(())
    /// ```
    pub fn to_chrome_trace(&self) -> String {
        let mut events: Vec<String> =
            vec![format!(r#"{{"name":"process_name","ph":"M","pid":0,"tid":0,"args":{{"name":"pipeline: {}"}}}}"#, escape(&self.name))];
        for s in 0..self.stages.len() {
            events.push(format!(r#"{{"name":"thread_name","ph":"M","pid":0,"tid":{s},"args":{{"name":"stage {s}"}}}}"#));
            events.push(format!(r#"{{"name":"thread_sort_index","ph":"M","pid":0,"tid":{s},"args":{{"sort_index":{s}}}}}"#));
        }
        for e in &self.events {
            let (mb, c) = (e.action.microbatch(), e.action.chunk());
            let args = format!(r#"{{"microbatch":{mb},"chunk":{c}}}"#);
            let category = match e.action {
                Action::Forward { .. } => "forward",
                Action::Backward { .. } => "backward",
                Action::BackwardInput { .. } => "backward-input",
                Action::BackwardWeight { .. } => "backward-weight",
                Action::RecvActivation { .. } | Action::RecvGrad { .. } => "wait",
                Action::SendActivation { .. } | Action::SendGrad { .. } => "send",
            };
            let name = escape(&e.action.to_string());
            let mut line = String::new();
            match category {
                "send" => {
                    let _ = write!(line, r#"{{"name":"{name}","cat":"send","ph":"i","s":"t","ts":{},"pid":0,"tid":{},"args":{args}}}"#, e.start, e.stage);
                }
                // A receive whose tensor was already there took no time: nothing to draw.
                "wait" if e.end <= e.start => continue,
                _ => {
                    let _ = write!(
                        line,
                        r#"{{"name":"{name}","cat":"{category}","ph":"X","ts":{},"dur":{},"pid":0,"tid":{},"args":{args}}}"#,
                        e.start,
                        e.end - e.start,
                        e.stage
                    );
                }
            }
            events.push(line);
        }
        format!("{{\"traceEvents\":[\n{}\n],\"displayTimeUnit\":\"ms\"}}\n", events.join(",\n"))
    }
}

/// Escapes a string for a JSON string literal.
fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for ch in s.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out
}
