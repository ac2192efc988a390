//! The engine's state as checkpoints save and restore it: this rank's
//! shards of the parameters' master copy and of AdamW's moments.

use super::{ShardState, Stage, Zero};
use tessera_core::{Error, Result, Tensor};
use tessera_optim::{adamw_info, OptimizerInfo, OptimizerState, SharedOptimizerState, StatePiece, StateSlot, TensorKind};

impl OptimizerState for Zero {
    fn info(&self) -> OptimizerInfo {
        adamw_info(&self.config().adamw)
    }

    fn zero_stage(&self) -> Option<u8> {
        Some(match self.stage() {
            Stage::One => 1,
            Stage::Two => 2,
            Stage::Three => 3,
        })
    }

    fn pieces(&self) -> Result<Vec<StatePiece>> {
        let state = self.shard_state()?;
        let mut out = Vec::new();
        for p in self.shard_pieces() {
            let len = p.elements.len();
            for (kind, shard) in [(TensorKind::Param, &state.params), (TensorKind::AdamM, &state.m), (TensorKind::AdamV, &state.v)] {
                let slot = StateSlot { name: p.name.clone(), param: p.param.clone(), kind, elements: Some(p.elements.clone()) };
                out.push(StatePiece { slot, tensor: shard.narrow(0, p.offset, len)?, steps: state.steps });
            }
        }
        Ok(out)
    }

    fn slots(&self) -> Vec<StateSlot> {
        self.shard_pieces()
            .into_iter()
            .flat_map(|p| TensorKind::ALL.map(|kind| StateSlot { name: p.name.clone(), param: p.param.clone(), kind, elements: Some(p.elements.clone()) }))
            .collect()
    }

    fn restore(&mut self, values: Vec<(Tensor, Option<u64>)>, steps: u64) -> Result<()> {
        restore_zero(self, values, steps)
    }
}

impl SharedOptimizerState for Zero {
    fn restore_shared(&self, values: Vec<(Tensor, Option<u64>)>, steps: u64) -> Result<()> {
        restore_zero(self, values, steps)
    }
}

/// Lays the restored pieces end to end into this rank's shards (zeros past
/// the last parameter) and hands them to the engine.
fn restore_zero(zero: &Zero, values: Vec<(Tensor, Option<u64>)>, steps: u64) -> Result<()> {
    const OP: &str = "Zero::restore";
    let pieces = zero.shard_pieces();
    if values.len() != 3 * pieces.len() {
        return Err(Error::state_mismatch(OP, format!("{} values for {} slots; pass one per slot", values.len(), 3 * pieces.len())));
    }
    let current = zero.shard_state()?;
    let (len, dtype, device) = (current.params.elem_count(), current.params.dtype(), current.params.device().clone());
    let mut parts: [Vec<Tensor>; 3] = Default::default();
    let mut counts: Vec<u64> = Vec::new();
    for (i, (t, s)) in values.into_iter().enumerate() {
        let t = if t.dtype() == dtype { t } else { t.to_dtype(dtype)? };
        // Read onto the device the engine keeps its state on (the host's
        // memory with offload).
        let t = if t.device().same(&device) { t } else { t.to_device(&device)? };
        parts[i % 3].push(t.reshape([t.elem_count()])?);
        counts.extend(s.filter(|_| i % 3 != 0));
    }
    counts.sort_unstable();
    counts.dedup();
    let steps = match counts.as_slice() {
        [] => steps,
        [one] => *one,
        many => {
            return Err(Error::unsupported(
                OP,
                format!("the checkpoint's moments were updated {many:?} times for different parameters; ZeRO keeps one update count, so restore such a checkpoint with `AdamW`"),
            ))
        }
    };
    let shard = |parts: Vec<Tensor>| -> Result<Tensor> {
        let have: usize = parts.iter().map(Tensor::elem_count).sum();
        let mut parts = parts;
        if have < len {
            parts.push(Tensor::zeros([len - have], dtype, &device)?);
        }
        Tensor::concat_flat(&parts.iter().collect::<Vec<_>>())
    };
    let [params, m, v] = parts;
    zero.load_shard_state(ShardState { params: shard(params)?, m: shard(m)?, v: shard(v)?, steps })
}
