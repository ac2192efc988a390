//! `metrics.jsonl`: one JSON object per training step.

use serde::{Deserialize, Serialize};
use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use tessera_core::{Error, Result};

/// Something that happened during a step besides the update itself.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Event {
    /// The loss or gradient norm was not finite, or spiked.
    Anomaly {
        /// What was seen, in words (e.g. "loss 9.1 > 3 × average 2.2").
        detail: String,
    },
    /// The run went back to a healthy checkpoint and skipped data.
    Rollback {
        /// The step of the checkpoint restored.
        to_step: u64,
        /// Batches of data skipped so that the offending data is not seen again.
        skipped_batches: u64,
    },
    /// An fp16 gradient overflowed: the step was skipped and the scale lowered.
    Overflow {
        /// The loss scale after backing off.
        scale: f64,
    },
    /// The step's state is being saved as a checkpoint (the line is written
    /// before the save; a save that fails ends the run with its error).
    Checkpoint {
        /// Its directory.
        dir: String,
    },
    /// A checkpoint could not be loaded (its reason given) and was set aside
    /// under another name, never to be deleted by pruning.
    SetAside {
        /// The checkpoint's directory.
        dir: String,
        /// Where it is now.
        to: String,
        /// Why it could not be loaded.
        reason: String,
    },
    /// A rollback passed over a checkpoint that could not be loaded.
    Skipped {
        /// The checkpoint's directory.
        dir: String,
        /// Why it could not be loaded.
        reason: String,
    },
    /// An unfinished checkpoint directory of a job that is gone was removed
    /// when this run started.
    Cleaned {
        /// The directory removed.
        dir: String,
    },
    /// The run resumed from a checkpoint; the lines of the steps after it,
    /// which it replays, were dropped from the log.
    Resumed {
        /// The checkpoint's step.
        from_step: u64,
        /// Lines dropped (steps a killed job took after that checkpoint).
        dropped_lines: u64,
    },
    /// A held-out evaluation ran.
    Eval {
        /// Exact-match accuracy in [0, 1].
        accuracy: f64,
    },
}

/// The figures of one optimizer step, as written to `metrics.jsonl`.
///
/// Times are seconds of wall clock. `compute_s`, `exposed_comm_s` and
/// `bubble_s` split the step (`comm_s` overlaps `compute_s`): time in kernels, time waiting on data-parallel
/// communication that the backward did not hide, and time pipeline stages
/// spent idle waiting for a neighbour. Each is the maximum over the ranks
/// (the slowest rank sets the step time).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// Optimizer steps taken, counting this one.
    pub step: u64,
    /// Mean loss over the step's tokens (all replicas). JSON has no NaN: a
    /// non-finite loss is written `null` and read back as NaN.
    #[serde(deserialize_with = "null_as_nan")]
    pub loss: f64,
    /// Global gradient norm before clipping (each logical parameter counted
    /// once; under ZeRO measured over the shards). `null` in the file when
    /// it was not finite (the step's anomaly event gives the value).
    pub grad_norm: Option<f64>,
    /// Learning rate of this step.
    pub lr: f64,
    /// The fp16 loss scale, when loss scaling is on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    /// Tokens trained on in this step (all replicas).
    pub tokens: u64,
    /// Training throughput.
    pub tokens_per_s: f64,
    /// Model FLOP utilisation: model FLOP/s over the peak FLOP/s of the hardware.
    pub mfu: f64,
    /// Wall time of the step.
    pub step_time_s: f64,
    /// Time in compute.
    pub compute_s: f64,
    /// Data-parallel gradient communication in all: the wall time during
    /// which at least one bucket was in flight (maximum over the ranks).
    /// `comm_s − exposed_comm_s` ran while the backward did.
    #[serde(default)]
    pub comm_s: f64,
    /// Data-parallel communication time not hidden behind the backward.
    pub exposed_comm_s: f64,
    /// Bytes of gradients one rank sent into the data-parallel collectives
    /// this step (after compression; the most over the ranks).
    #[serde(default)]
    pub grad_bytes: u64,
    /// Pipeline bubble: time a stage waited on its neighbours.
    pub bubble_s: f64,
    /// Peak bytes allocated by each rank during the step, by world rank.
    pub peak_memory: Vec<usize>,
    /// Whether the update was skipped (overflow or anomaly).
    #[serde(default)]
    pub skipped: bool,
    /// What else happened.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub events: Vec<Event>,
}

/// Reads a number, or `null` (what serde_json writes for NaN and infinities) as NaN.
fn null_as_nan<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// Appends [`StepMetrics`] to a `metrics.jsonl` file, one line per step,
/// flushed at once so a crashed run keeps every step it finished.
#[derive(Debug)]
pub struct MetricsLog {
    path: PathBuf,
    out: BufWriter<File>,
}

impl MetricsLog {
    /// Creates (or truncates) the file.
    pub fn create(path: impl Into<PathBuf>) -> Result<Self> {
        let path = path.into();
        let file = File::create(&path).map_err(|e| Error::io(&path, e))?;
        Ok(MetricsLog { path, out: BufWriter::new(file) })
    }

    /// Opens the file for appending (a resumed run continues its log).
    pub fn append(path: impl Into<PathBuf>) -> Result<Self> {
        let path = path.into();
        let file = File::options().create(true).append(true).open(&path).map_err(|e| Error::io(&path, e))?;
        Ok(MetricsLog { path, out: BufWriter::new(file) })
    }

    /// Opens the log of a run that resumes from the checkpoint of `step`:
    /// the lines after the last one of `step` describe steps taken after
    /// that checkpoint by a job that was stopped before its next one, and
    /// are replayed, so they are dropped (the file is cut after that line).
    /// Returns the log and the number of lines dropped. A log with no line
    /// of `step` (written by something else, or edited) is kept whole.
    pub fn resume_at(path: impl Into<PathBuf>, step: u64) -> Result<(Self, u64)> {
        let path = path.into();
        let text = match std::fs::read(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(Error::io(&path, e)),
        };
        // Byte offset after each line, and the line's step (if it reads).
        let mut cut = None;
        let mut offset = 0usize;
        for line in text.split_inclusive(|&b| b == b'\n') {
            offset += line.len();
            let step_of = serde_json::from_slice::<serde_json::Value>(line).ok().and_then(|v| v.get("step").and_then(|s| s.as_u64()));
            if step_of == Some(step) && line.ends_with(b"\n") {
                cut = Some(offset);
            }
        }
        // Without a line of `step`, only a last line cut short by a kill goes.
        let cut = cut.or_else(|| (!text.is_empty() && !text.ends_with(b"\n")).then(|| text.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1)));
        let dropped = match cut {
            Some(at) if at < text.len() => {
                let file = File::options().write(true).open(&path).map_err(|e| Error::io(&path, e))?;
                file.set_len(at as u64).and_then(|()| file.sync_all()).map_err(|e| Error::io(&path, e))?;
                text[at..].split_inclusive(|&b| b == b'\n').filter(|l| !l.iter().all(u8::is_ascii_whitespace)).count() as u64
            }
            _ => 0,
        };
        Ok((Self::append(path)?, dropped))
    }

    /// The file written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes one step.
    pub fn write(&mut self, m: &StepMetrics) -> Result<()> {
        let line = serde_json::to_string(m).map_err(|e| Error::io(&self.path, e.into()))?;
        writeln!(self.out, "{line}").and_then(|_| self.out.flush()).map_err(|e| Error::io(&self.path, e))
    }
}

/// Reads a `metrics.jsonl` file back; a malformed line is an error naming it.
pub fn read_metrics(path: impl AsRef<Path>) -> Result<Vec<StepMetrics>> {
    let path = path.as_ref();
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    let mut out = Vec::new();
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|e| Error::io(path, e))?;
        if line.trim().is_empty() {
            continue;
        }
        out.push(
            serde_json::from_str(&line).map_err(|e| Error::io(path, std::io::Error::new(std::io::ErrorKind::InvalidData, format!("line {}: {e}", i + 1))))?,
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(step: u64) -> String {
        serde_json::to_string(&StepMetrics { step, loss: step as f64, ..StepMetrics::default() }).unwrap() + "\n"
    }

    #[test]
    fn a_resumed_log_drops_the_lines_it_replays() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let steps = |p: &Path| read_metrics(p).unwrap().iter().map(|m| m.step).collect::<Vec<_>>();
        // Steps 1-5 (3 twice: a rollback replayed it), and half a line.
        let text = [1, 2, 3, 4, 3, 4, 5].map(line).concat() + "{\"step\": 6, \"lo";
        std::fs::write(&path, &text).unwrap();
        let (mut log, dropped) = MetricsLog::resume_at(&path, 4).unwrap();
        assert_eq!(dropped, 2, "step 5 and the cut line");
        log.write(&StepMetrics { step: 5, ..StepMetrics::default() }).unwrap();
        assert_eq!(steps(&path), vec![1, 2, 3, 4, 3, 4, 5], "cut after the last line of step 4");
        // No line of the step: kept whole, only a cut line goes.
        std::fs::write(&path, [1, 2].map(line).concat() + "{\"st").unwrap();
        let (_, dropped) = MetricsLog::resume_at(&path, 9).unwrap();
        assert_eq!((dropped, steps(&path)), (1, vec![1, 2]));
        let (_, dropped) = MetricsLog::resume_at(&path, 9).unwrap();
        assert_eq!((dropped, steps(&path)), (0, vec![1, 2]));
        std::fs::remove_file(&path).unwrap();
        let (_, dropped) = MetricsLog::resume_at(&path, 3).unwrap();
        assert_eq!(dropped, 0, "a missing log is started");
    }
}
