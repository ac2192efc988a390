//! The optimizer state a checkpoint saves and restores: AdamW's moments,
//! held whole by [`AdamW`] or sharded over the data-parallel group by a ZeRO
//! engine (which then holds the parameters' master copy too, and implements
//! [`OptimizerState`] beside its own type), and Local SGD's outer momentum.

use super::{AdamW, AdamWConfig};
use serde::{Deserialize, Serialize};
use std::ops::Range;
use std::sync::Arc;
use tessera_core::tensor::Tensor;
use tessera_core::{Error, Result};
use tessera_nn::module::Param;

/// What a stored tensor is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TensorKind {
    // The discriminants are the positions in `EVERY`.
    /// A parameter's values.
    Param,
    /// AdamW's first moment of a parameter.
    AdamM,
    /// AdamW's second moment of a parameter.
    AdamV,
    /// Local SGD's (DiLoCo's) outer momentum of a parameter, the same on
    /// every data replica; only in a checkpoint of such a run.
    OuterMomentum,
}

impl TensorKind {
    /// The kinds an AdamW checkpoint holds for every parameter: its values
    /// and its moments, in the order pieces are listed.
    pub const ALL: [TensorKind; 3] = [TensorKind::Param, TensorKind::AdamM, TensorKind::AdamV];

    /// Every kind.
    pub const EVERY: [TensorKind; 4] = [TensorKind::Param, TensorKind::AdamM, TensorKind::AdamV, TensorKind::OuterMomentum];

    /// `param`, `adam_m`, `adam_v`, `outer_momentum`.
    pub fn name(self) -> &'static str {
        match self {
            TensorKind::Param => "param",
            TensorKind::AdamM => "adam_m",
            TensorKind::AdamV => "adam_v",
            TensorKind::OuterMomentum => "outer_momentum",
        }
    }

    /// The key of parameter `param`'s tensor of this kind in a rank file:
    /// the name itself, or suffixed `.adam_m`, `.adam_v`, `.outer_momentum`.
    pub fn key(self, param: &str) -> String {
        match self {
            TensorKind::Param => param.to_string(),
            other => format!("{param}.{}", other.name()),
        }
    }
}

/// The optimizer whose state a checkpoint holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OptimizerInfo {
    /// `adamw`.
    pub kind: String,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Denominator epsilon.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
}

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
/// [`AdamW`] and by the ZeRO engine (also behind an `Arc`).
///
/// A checkpointer (`tessera::ckpt::Checkpointer`) takes it in `save` as
/// `Some(&opt)` and in `load` as `Some(&mut opt)`.
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

/// Optimizer state that restores through a shared reference, synchronising
/// inside: an engine that is shared behind an `Arc` while it runs (ZeRO is
/// also each rank's module hook). Such state is [`OptimizerState`] behind
/// the `Arc` too.
pub trait SharedOptimizerState: OptimizerState {
    /// [`OptimizerState::restore`] through `&self`.
    fn restore_shared(&self, values: Vec<(Tensor, Option<u64>)>, steps: u64) -> Result<()>;
}

impl<T: SharedOptimizerState> OptimizerState for Arc<T> {
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
        (**self).restore_shared(values, steps)
    }
}

/// The manifest record of AdamW with these hyper-parameters.
pub fn adamw_info(c: &AdamWConfig) -> OptimizerInfo {
    OptimizerInfo { kind: "adamw".into(), beta1: c.beta1, beta2: c.beta2, eps: c.eps, weight_decay: c.weight_decay }
}

impl OptimizerState for AdamW {
    fn info(&self) -> OptimizerInfo {
        adamw_info(self.config())
    }

    fn zero_stage(&self) -> Option<u8> {
        None
    }

    /// The moments of every parameter, and the master copy (as the
    /// parameter's values, in f32) of each held in half precision.
    fn pieces(&self) -> Result<Vec<StatePiece>> {
        let mut out = Vec::new();
        for s in self.moments() {
            let master = s.master.map(|t| (TensorKind::Param, t));
            for (kind, t) in master.into_iter().chain([(TensorKind::AdamM, s.m), (TensorKind::AdamV, s.v)]) {
                let slot = StateSlot { name: s.name.to_string(), param: s.param.clone(), kind, elements: None };
                out.push(StatePiece { slot, tensor: t.clone(), steps: s.steps });
            }
        }
        Ok(out)
    }

    fn slots(&self) -> Vec<StateSlot> {
        let mut out = Vec::new();
        for s in self.moments() {
            let master = s.master.map(|_| TensorKind::Param);
            for kind in master.into_iter().chain([TensorKind::AdamM, TensorKind::AdamV]) {
                out.push(StateSlot { name: s.name.to_string(), param: s.param.clone(), kind, elements: None });
            }
        }
        out
    }

    fn restore(&mut self, values: Vec<(Tensor, Option<u64>)>, steps: u64) -> Result<()> {
        let slots = self.slots();
        if values.len() != slots.len() {
            return Err(Error::state_mismatch("AdamW::restore", format!("{} values for {} slots; pass one per slot", values.len(), slots.len())));
        }
        let mut values = values.into_iter();
        let mut slots = slots.into_iter();
        while let Some(slot) = slots.next() {
            if slot.kind == TensorKind::Param {
                let (master, _) = values.next().expect("counted");
                self.load_master(&slot.param, master)?;
                slots.next();
            }
            let (m, m_steps) = values.next().expect("counted");
            let (v, _) = values.next().expect("counted");
            slots.next();
            self.load_state(&slot.param, m, v, m_steps.unwrap_or(steps))?;
        }
        Ok(())
    }
}
