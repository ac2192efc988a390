//! `metrics.jsonl`: one JSON object per training step.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};

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
    /// A checkpoint was written.
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
    /// A held-out evaluation ran.
    Eval {
        /// Exact-match accuracy in [0, 1].
        accuracy: f64,
    },
}

/// The figures of one optimizer step, as written to `metrics.jsonl`.
///
/// Times are seconds of wall clock. `compute_s`, `exposed_comm_s` and
/// `bubble_s` split the step: time in kernels, time waiting on data-parallel
/// communication that the backward did not hide, and time pipeline stages
/// spent idle waiting for a neighbour. Each is the maximum over the ranks
/// (the slowest rank sets the step time).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// Optimizer steps taken, counting this one.
    pub step: u64,
    /// Mean loss over the step's tokens (all replicas).
    pub loss: f64,
    /// Global gradient norm before clipping (each logical parameter counted
    /// once); not measured under ZeRO stages 2 and 3, whose gradients are sharded.
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
    /// Data-parallel communication time not hidden behind the backward.
    pub exposed_comm_s: f64,
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

    /// The file written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes one step.
    pub fn write(&mut self, m: &StepMetrics) -> Result<()> {
        let line = serde_json::to_string(m).map_err(|e| Error::io(&self.path, e))?;
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
        out.push(serde_json::from_str(&line).map_err(|e| Error::io(path, format!("line {}: {e}", i + 1)))?);
    }
    Ok(out)
}
