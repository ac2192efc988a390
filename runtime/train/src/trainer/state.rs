//! The state of a rank's run besides the model and the optimizer, which
//! every checkpoint holds, and the rollback that restores it.

use crate::ckpt::Checkpointer;
use crate::{Anomaly, LossScaler, StabilityMonitor};
use serde_json::{json, Value};
use tessera_core::{Device, Error, Result, Tensor};
use tessera_data::Batches;
use tessera_nn::module::{Cx, Fp8Snapshot, Module};
use tessera_observe::Event;
use tessera_optim::OptimizerState;

/// Rollbacks allowed in one run before it gives up: a run that keeps
/// diverging from healthy checkpoints on fresh data needs a human.
const MAX_ROLLBACKS: usize = 5;

/// The data stream, loss scaler, stability monitor and rollback count of
/// one rank: all of it is in every checkpoint (see [`extra`](Self::extra)).
pub(super) struct RunState {
    pub(super) batches: Box<dyn Batches>,
    pub(super) scaler: Option<LossScaler>,
    pub(super) monitor: StabilityMonitor,
    pub(super) rollbacks: usize,
}

impl RunState {
    /// A checkpoint's `extra`: the data cursor (with its exclusions), the
    /// loss scaler, the stability monitor's recent values and warm-up, and
    /// the rollbacks taken. Every random draw of a run is a pure function
    /// of the seed and the step (dropout) or the epoch (the data order), so
    /// no generator state needs saving.
    pub(super) fn extra(&self) -> Value {
        json!({ "data": self.batches.cursor(), "scaler": self.scaler, "monitor": self.monitor.state(), "rollbacks": self.rollbacks })
    }

    /// Resumes from a checkpoint's `extra`: the data stream where it was,
    /// the scaler, the monitor and the rollback count.
    pub(super) fn resume(&mut self, extra: &Value) -> Result<()> {
        if let Some(cursor) = extra.get("data") {
            self.batches.restore(cursor)?;
        }
        self.restore_scaler_and_monitor(extra)?;
        self.rollbacks = extra.get("rollbacks").and_then(Value::as_u64).unwrap_or(0) as usize;
        Ok(())
    }

    /// Restores the loss scaler and the monitor from a checkpoint's `extra`
    /// (a checkpoint written before the monitor was saved leaves it as is).
    fn restore_scaler_and_monitor(&mut self, extra: &Value) -> Result<()> {
        if let (Some(s), Some(saved)) = (self.scaler.as_mut(), extra.get("scaler").filter(|v| !v.is_null())) {
            *s = serde_json::from_value(saved.clone())
                .map_err(|e| Error::config("precision", format!("the checkpoint's loss-scaler state is unreadable: {e}")))?;
        }
        if let Some(saved) = extra.get("monitor").filter(|v| !v.is_null()) {
            self.monitor.restore(saved)?;
        }
        Ok(())
    }

    /// Restores the newest valid checkpoint that is not a resume point
    /// (model, optimizer, loss scaler, stability monitor) and has the data
    /// stream exclude everything drawn since it: the stream keeps its place,
    /// and the data behind the anomaly at `step` is never served again.
    /// Returns the restored step with the newer checkpoints it had to pass
    /// over, or `None` when there is no checkpoint to go back to (the step
    /// is then only skipped).
    pub(super) fn roll_back<M: Module>(
        &mut self,
        ckpt: &Checkpointer,
        model: &M,
        opt: &mut dyn OptimizerState,
        cx: &Cx,
        step: u64,
    ) -> Result<Option<(u64, Vec<Event>)>> {
        if !ckpt.has_regular()? {
            return Ok(None);
        }
        self.rollbacks += 1;
        if self.rollbacks > MAX_ROLLBACKS {
            return Err(Error::Diverged {
                step,
                detail: format!("still unstable after {MAX_ROLLBACKS} rollbacks to healthy checkpoints with fresh data; lower optim.lr, raise optim.warmup or tighten optim.clip"),
            });
        }
        let Some(r) = ckpt.load_latest_valid_regular(model, Some(opt), cx)? else { return Ok(None) };
        let extra = &r.manifest.extra;
        self.restore_scaler_and_monitor(extra)?;
        restore_fp8(cx, extra)?;
        match extra.get("data") {
            Some(since) => self.batches.exclude_since(since)?,
            None => return Err(Error::checkpoint(&r.dir, "holds no data cursor, so the data read since it cannot be excluded on a rollback")),
        }
        // Newer checkpoints it had to pass over are reported, not hidden.
        let skipped = r.skipped.iter().map(|s| Event::Skipped { dir: s.dir.display().to_string(), reason: s.reason.to_string() }).collect();
        Ok(Some((r.manifest.step, skipped)))
    }
}

/// The FP8 scaling state of the whole model for a checkpoint's `extra`:
/// this rank's, merged with every other pipeline stage's (each holds its
/// own layers' operands; tensor- and data-parallel ranks hold the same).
/// Every rank calls it together; without FP8 it is empty and costs no
/// communication.
pub(super) fn fp8_of_every_stage(cx: &Cx, fp8: bool) -> Result<Value> {
    let mine = cx.fp8_snapshot();
    let pp = &cx.groups().pp;
    if !fp8 || pp.size() == 1 {
        return Ok(serde_json::to_value(mine).expect("plain data serialises"));
    }
    // Each stage's snapshot as JSON bytes, one f32 per byte (exact),
    // padded to the longest.
    let bytes = serde_json::to_vec(&mine).expect("plain data serialises");
    let lens = pp.all_gather(&Tensor::from_vec(vec![bytes.len() as f32], [1], &Device::cpu())?, 0)?.to_vec::<f32>()?;
    let width = lens.iter().fold(0.0f32, |a, &b| a.max(b)) as usize;
    let mut row: Vec<f32> = bytes.iter().map(|&b| f32::from(b)).collect();
    row.resize(width, 0.0);
    let all = pp.all_gather(&Tensor::from_vec(row, [width], &Device::cpu())?, 0)?.to_vec::<f32>()?;
    let mut merged = Fp8Snapshot::new();
    for (stage, len) in lens.iter().enumerate() {
        let theirs: Vec<u8> = all[stage * width..stage * width + *len as usize].iter().map(|&b| b as u8).collect();
        let theirs: Fp8Snapshot = serde_json::from_slice(&theirs)
            .map_err(|e| Error::state_mismatch("FP8 checkpoint state", format!("stage {stage}'s FP8 scalings arrived unreadable: {e}")))?;
        merged.extend(theirs);
    }
    Ok(serde_json::to_value(merged).expect("plain data serialises"))
}

/// Puts back the FP8 scalings a checkpoint's `extra` holds (a checkpoint
/// without them, or a run without FP8, leaves the state as it is).
pub(super) fn restore_fp8(cx: &Cx, extra: &Value) -> Result<()> {
    let Some(saved) = extra.get("fp8").filter(|v| v.as_object().is_some_and(|o| !o.is_empty())) else { return Ok(()) };
    let saved: Fp8Snapshot =
        serde_json::from_value(saved.clone()).map_err(|e| Error::config("precision.fp8", format!("the checkpoint's FP8 scaling state is unreadable: {e}")))?;
    cx.restore_fp8(&saved)
}

/// An anomaly as the metrics line and the console report it.
pub(super) fn describe(a: &Anomaly) -> String {
    match a {
        Anomaly::NonFinite { step, loss, grad_norm } => format!("step {step}: non-finite loss {loss} or gradient norm {grad_norm}"),
        Anomaly::LossSpike { step, loss, average } => format!("step {step}: loss spike {loss:.4} (average {average:.4})"),
        Anomaly::GradNormSpike { step, grad_norm, average } => format!("step {step}: gradient-norm spike {grad_norm:.4} (average {average:.4})"),
    }
}
