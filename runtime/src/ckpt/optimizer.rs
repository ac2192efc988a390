//! The optimizer state a checkpoint saves and restores: AdamW's moments,
//! held whole by [`AdamW`] or sharded over the data-parallel group by a
//! [`Zero`] engine (which then holds the parameters' master copy too).

use super::manifest::{OptimizerInfo, TensorKind};
use crate::error::{Error, Result};
use crate::module::Param;
use crate::optim::{AdamW, AdamWConfig};
use crate::parallel::zero::{ShardState, Stage, Zero};
use crate::tensor::Tensor;
use std::ops::Range;
use std::sync::Arc;

/// A place in the model state that an optimizer saves or restores: part
/// of one parameter's tensor of one kind.
#[derive(Clone, Debug)]
pub struct StateSlot {
    /// The parameter's dotted name (its first, for a tied weight).
    pub name: String,
    /// The parameter.
    pub param: Param,
    /// The parameter's values or one of its moments.
    pub kind: TensorKind,
    /// The elements of the parameter's local (tensor-parallel) shard,
    /// flattened row-major, that the slot covers; `None` for all of them.
    pub elements: Option<Range<usize>>,
}

/// The value of a [`StateSlot`] on this rank.
#[derive(Clone, Debug)]
pub struct StatePiece {
    /// Where it belongs.
    pub slot: StateSlot,
    /// Its elements (the local shard's shape, or one dimension for a range of them).
    pub tensor: Tensor,
    /// For a moment: the updates applied to the parameter so far.
    pub steps: u64,
}

/// Optimizer state that checkpoints save and restore; implemented by
/// [`AdamW`] and by the [`Zero`] engine (also behind an `Arc`).
///
/// Pass it to [`Checkpointer::save`](super::Checkpointer::save) as
/// `Some(&opt)` and to [`Checkpointer::load`](super::Checkpointer::load) as
/// `Some(&mut opt)`.
pub trait OptimizerState: Send + Sync {
    /// The hyper-parameters the manifest records.
    fn info(&self) -> OptimizerInfo;

    /// The ZeRO stage that shards this state over the data-parallel group,
    /// or `None` when every replica holds all of it.
    fn zero_stage(&self) -> Option<u8>;

    /// This rank's state. The tensors may be views of the live state: a
    /// checkpoint copies their bytes before the next update.
    fn pieces(&self) -> Result<Vec<StatePiece>>;

    /// The places this rank's state fills, in the order
    /// [`restore`](Self::restore) takes their values. Parameters listed here
    /// are restored through the optimizer, not set on the model.
    fn slots(&self) -> Vec<StateSlot>;

    /// Installs the value of every slot (in the order of
    /// [`slots`](Self::slots)), each with the update count recorded for it;
    /// `steps` is the checkpoint's overall update count (the largest),
    /// for state that covers no parameter. Every rank calls it together.
    fn restore(&mut self, values: Vec<(Tensor, Option<u64>)>, steps: u64) -> Result<()>;
}

fn adamw_info(c: &AdamWConfig) -> OptimizerInfo {
    OptimizerInfo { kind: "adamw".into(), beta1: c.beta1, beta2: c.beta2, eps: c.eps, weight_decay: c.weight_decay }
}

impl OptimizerState for AdamW {
    fn info(&self) -> OptimizerInfo {
        adamw_info(self.config())
    }

    fn zero_stage(&self) -> Option<u8> {
        None
    }

    fn pieces(&self) -> Result<Vec<StatePiece>> {
        let mut out = Vec::new();
        for s in self.moments() {
            for (kind, t) in [(TensorKind::AdamM, s.m), (TensorKind::AdamV, s.v)] {
                let slot = StateSlot { name: s.name.to_string(), param: s.param.clone(), kind, elements: None };
                out.push(StatePiece { slot, tensor: t.clone(), steps: s.steps });
            }
        }
        Ok(out)
    }

    fn slots(&self) -> Vec<StateSlot> {
        self.moments()
            .iter()
            .flat_map(|s| [TensorKind::AdamM, TensorKind::AdamV].map(|kind| StateSlot { name: s.name.to_string(), param: s.param.clone(), kind, elements: None }))
            .collect()
    }

    fn restore(&mut self, values: Vec<(Tensor, Option<u64>)>, steps: u64) -> Result<()> {
        let slots = self.slots();
        if values.len() != slots.len() {
            return Err(Error::invalid("AdamW::restore", format!("{} values for {} slots; pass one per slot", values.len(), slots.len())));
        }
        let mut values = values.into_iter();
        for pair in slots.chunks(2) {
            let (m, m_steps) = values.next().expect("counted");
            let (v, _) = values.next().expect("counted");
            self.load_state(&pair[0].param, m, v, m_steps.unwrap_or(steps))?;
        }
        Ok(())
    }
}

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

impl OptimizerState for Arc<Zero> {
    fn info(&self) -> OptimizerInfo {
        (**self).info()
    }

    fn zero_stage(&self) -> Option<u8> {
        (**self).zero_stage()
    }

    fn pieces(&self) -> Result<Vec<StatePiece>> {
        (**self).pieces()
    }

    fn slots(&self) -> Vec<StateSlot> {
        (**self).slots()
    }

    fn restore(&mut self, values: Vec<(Tensor, Option<u64>)>, steps: u64) -> Result<()> {
        restore_zero(self, values, steps)
    }
}

/// Lays the restored pieces end to end into this rank's shards (zeros past
/// the last parameter) and hands them to the engine.
fn restore_zero(zero: &Zero, values: Vec<(Tensor, Option<u64>)>, steps: u64) -> Result<()> {
    const OP: &str = "Zero::restore";
    let pieces = zero.shard_pieces();
    if values.len() != 3 * pieces.len() {
        return Err(Error::invalid(OP, format!("{} values for {} slots; pass one per slot", values.len(), 3 * pieces.len())));
    }
    let current = zero.shard_state()?;
    let (len, dtype, device) = (current.params.elem_count(), current.params.dtype(), current.params.device().clone());
    let mut parts: [Vec<Tensor>; 3] = Default::default();
    let mut counts: Vec<u64> = Vec::new();
    for (i, (t, s)) in values.into_iter().enumerate() {
        let t = if t.dtype() == dtype { t } else { t.to_dtype(dtype)? };
        parts[i % 3].push(t.reshape([t.elem_count()])?);
        counts.extend(s.filter(|_| i % 3 != 0));
    }
    counts.sort_unstable();
    counts.dedup();
    let steps = match counts.as_slice() {
        [] => steps,
        [one] => *one,
        many => {
            return Err(Error::invalid(
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
