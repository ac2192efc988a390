//! Local SGD and DiLoCo: data replicas train apart and meet every `H` steps.
//!
//! Between meetings every replica takes its own optimizer steps (the inner
//! steps: AdamW in the trainer) on its own data, exchanging nothing. At a
//! meeting each replica offers the change it made since the last one, the
//! outer gradient `Δ = θ_global − θ_local`; the mean `Δ̄` over the replicas
//! is one all-reduce of the parameters, and an outer optimizer, SGD with
//! Nesterov momentum `μ` at rate `η`, moves the shared parameters:
//!
//! ```text
//! v ← μ·v + Δ̄
//! θ_global ← θ_global − η·(Δ̄ + μ·v)
//! ```
//!
//! after which every replica starts the next round from `θ_global`. With
//! `η = 1, μ = 0` this is Local SGD (the replicas' parameters averaged);
//! DiLoCo (Douillard et al., 2023) takes `η = 0.7, μ = 0.9`. The traffic is
//! one all-reduce of the parameters every `H` steps instead of one of the
//! gradients every step: `H` times fewer bytes, and `H − 1` of every `H`
//! steps wait on no other replica.
//!
//! The global parameters and the momentum are kept in the master dtype
//! (f32, or f64 for an f64 model) on the parameter's device; the caller
//! reads and writes each parameter's full-precision value (its optimizer's
//! master copy where it has one). The momentum, the same on every replica,
//! goes into checkpoints beside the optimizer's state
//! ([`WithOuterMomentum`]); the global parameters are the parameters
//! themselves at a meeting, where checkpoints fall.

use crate::data::SyncStats;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;
use tessera_core::ops;
use tessera_core::tensor::{DType, Tensor};
use tessera_core::{Error, Result};
use tessera_dist::Communicator;
use tessera_nn::module::{self, Module, Param};
use tessera_optim::{OptimizerInfo, OptimizerState, StatePiece, StateSlot, TensorKind};

/// The outer optimizer's settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OuterConfig {
    /// Inner steps between meetings (`H`), at least 1.
    pub every: u64,
    /// The outer learning rate `η`, in (0, 2): 1 with no momentum averages
    /// the replicas.
    pub lr: f64,
    /// The outer Nesterov momentum `μ`, in [0, 1).
    pub momentum: f64,
}

impl OuterConfig {
    /// DiLoCo's published settings: `η = 0.7`, `μ = 0.9`, every `every` steps.
    pub fn diloco(every: u64) -> Self {
        OuterConfig { every, lr: 0.7, momentum: 0.9 }
    }

    /// Local SGD: the replicas' parameters averaged every `every` steps.
    pub fn averaging(every: u64) -> Self {
        OuterConfig { every, lr: 1.0, momentum: 0.0 }
    }

    /// An error naming the setting that is out of range.
    pub fn check(&self) -> Result<()> {
        if self.every == 0 {
            return Err(Error::invalid("LocalSgd", "the replicas must meet every H ≥ 1 steps (1 meets after every step)"));
        }
        if !(self.lr > 0.0 && self.lr < 2.0) {
            return Err(Error::invalid("LocalSgd", format!("an outer learning rate of {} is outside (0, 2); 0.7 is DiLoCo's, 1 averages", self.lr)));
        }
        if !(0.0..1.0).contains(&self.momentum) {
            return Err(Error::invalid("LocalSgd", format!("an outer momentum of {} is outside [0, 1); 0.9 is DiLoCo's, 0 is none", self.momentum)));
        }
        Ok(())
    }
}

/// One rank's share of Local SGD / DiLoCo: the global parameters of its
/// shard, the outer momentum, and the groups it meets over.
///
/// With expert parallelism an expert's parameters are held by the replicas
/// of the data-parallel group only (the `experts` group): they meet there,
/// every other parameter over all replicas.
pub struct LocalSgd {
    replicas: Arc<dyn Communicator>,
    experts: Option<Arc<dyn Communicator>>,
    config: OuterConfig,
    /// The parameters this rank holds, each once (a tied weight is one).
    params: Vec<Param>,
    is_expert: Vec<bool>,
    /// `θ_global`, in the master dtype; set by [`start`](Self::start).
    global: Vec<Tensor>,
    /// `v`, once the first meeting made it (or a checkpoint restored it).
    velocity: Vec<Option<Tensor>>,
    /// Meetings so far (restored with the momentum).
    meetings: u64,
}

impl LocalSgd {
    /// The engine for `model`'s parameters on this rank, meeting over
    /// `replicas` (and, for experts' parameters, over `experts`).
    pub fn new<M: Module>(model: &M, replicas: Arc<dyn Communicator>, experts: Option<Arc<dyn Communicator>>, config: OuterConfig) -> Result<Self> {
        config.check()?;
        let mut params: Vec<Param> = Vec::new();
        let mut is_expert = Vec::new();
        let mut seen = HashMap::new();
        module::visit_params(model, |e| {
            // Other stages' parameters are theirs to meet over.
            if e.param.is_remote() || seen.contains_key(&e.param.id()) {
                return Ok(());
            }
            seen.insert(e.param.id(), params.len());
            params.push(e.param.clone());
            is_expert.push(experts.is_some() && e.expert.is_some());
            Ok(())
        })?;
        let n = params.len();
        Ok(LocalSgd { replicas, experts, config, params, is_expert, global: Vec::new(), velocity: vec![None; n], meetings: 0 })
    }

    /// The parameters, in the order [`start`](Self::start) and
    /// [`meet`](Self::meet) take and give their values.
    pub fn params(&self) -> &[Param] {
        &self.params
    }

    /// The settings.
    pub fn config(&self) -> OuterConfig {
        self.config
    }

    /// Whether the replicas meet after step `step` (counted from 1).
    pub fn due(&self, step: u64) -> bool {
        step.is_multiple_of(self.config.every)
    }

    /// Starts from `values` (every parameter's full-precision value, the
    /// same on every replica: after initialisation, a resume or a
    /// rollback), with the outer momentum it holds: none at first, or what
    /// a checkpoint restored ([`WithOuterMomentum`]).
    pub fn start(&mut self, values: Vec<Tensor>) -> Result<()> {
        self.check_values("LocalSgd::start", &values)?;
        self.global = values.iter().map(|v| v.to_dtype(master(v.dtype()))).collect::<Result<_>>()?;
        for (v, g) in self.velocity.iter_mut().zip(&self.global) {
            if let Some(t) = v.as_ref().filter(|t| t.dtype() != g.dtype()) {
                *v = Some(t.to_dtype(g.dtype())?);
            }
        }
        Ok(())
    }

    /// The outer momentum of every parameter, once a meeting made it (with
    /// no momentum configured, never).
    pub fn momentum(&self) -> &[Option<Tensor>] {
        &self.velocity
    }

    /// Meetings so far.
    pub fn meetings(&self) -> u64 {
        self.meetings
    }

    /// The meeting: `locals` are this replica's full-precision values now;
    /// returns the new global values (new tensors, each in its local's
    /// dtype) for the caller to set, and what the all-reduces cost.
    pub fn meet(&mut self, locals: &[Tensor]) -> Result<(Vec<Tensor>, SyncStats)> {
        if self.global.is_empty() {
            return Err(Error::state_mismatch("LocalSgd::meet", "no global parameters yet; call `start` with the initial values first"));
        }
        self.check_values("LocalSgd::meet", locals)?;
        let started = Instant::now();
        let mut stats = SyncStats::default();
        for experts in [false, true] {
            let group = match (&self.experts, experts) {
                (_, false) => &self.replicas,
                (Some(g), true) => g,
                (None, true) => continue,
            };
            let ids: Vec<usize> = (0..self.params.len()).filter(|&i| self.is_expert[i] == experts).collect();
            if ids.is_empty() {
                continue;
            }
            // Δ = θ_global − θ_local, every parameter of the group in one buffer.
            let deltas: Vec<Tensor> =
                ids.iter().map(|&i| ops::sub(&self.global[i], &same_dtype(&locals[i], self.global[i].dtype())?)).collect::<Result<_>>()?;
            let flat = Tensor::concat_flat(&deltas.iter().collect::<Vec<_>>())?;
            stats.bytes += flat.elem_count() * flat.dtype().size_in_bytes();
            stats.buckets += 1;
            let mean = ops::scale(&group.all_reduce_sum(&flat)?, 1.0 / group.size() as f64)?;
            let mut offset = 0;
            for &i in &ids {
                let shape = self.params[i].local_shape();
                let n = shape.elem_count();
                let d = mean.narrow(0, offset, n)?.reshape(shape)?.contiguous()?;
                offset += n;
                self.step(i, &d)?;
            }
        }
        self.meetings += 1;
        let out = self.global.iter().zip(locals).map(|(g, l)| g.to_dtype(l.dtype())).collect::<Result<_>>()?;
        // Nothing runs beside the meeting: all of it is on the critical path.
        stats.comm = started.elapsed();
        stats.exposed = stats.comm;
        Ok((out, stats))
    }

    /// The outer Nesterov step of parameter `i` with mean outer gradient `d`.
    fn step(&mut self, i: usize, d: &Tensor) -> Result<()> {
        let (lr, mu) = (self.config.lr, self.config.momentum);
        let g = &self.global[i];
        ops::axpy(g, -lr, d)?;
        if mu > 0.0 {
            let v = match self.velocity[i].take() {
                // v ← μ·v + Δ̄
                Some(v) => {
                    let v = ops::scale(&v, mu)?;
                    ops::axpy(&v, 1.0, d)?;
                    v
                }
                None => d.to_dtype(d.dtype())?,
            };
            ops::axpy(g, -lr * mu, &v)?;
            self.velocity[i] = Some(v);
        }
        Ok(())
    }

    fn check_values(&self, op: &'static str, values: &[Tensor]) -> Result<()> {
        if values.len() != self.params.len() {
            return Err(Error::state_mismatch(op, format!("{} values for the {} parameters of this rank", values.len(), self.params.len())));
        }
        for (p, v) in self.params.iter().zip(values) {
            if v.shape() != &p.local_shape() {
                return Err(Error::shape(op, format!("a value of shape {} for {p:?}, whose shard is {}", v.shape(), p.local_shape())));
            }
        }
        Ok(())
    }
}

/// An optimizer's state with Local SGD's outer momentum beside it: what
/// a checkpoint of a Local SGD run saves and restores (the momentum is the
/// same on every replica, so replica 0 writes it, sharded as the
/// parameters are). A checkpoint without it (of a synchronous run, or one
/// saved before the first meeting) restores no momentum.
pub struct WithOuterMomentum<'a> {
    optimizer: &'a mut dyn OptimizerState,
    local: Option<&'a mut LocalSgd>,
}

impl<'a> WithOuterMomentum<'a> {
    /// `optimizer`'s state, with `local`'s momentum when there is Local SGD.
    pub fn new(optimizer: &'a mut dyn OptimizerState, local: Option<&'a mut LocalSgd>) -> Self {
        WithOuterMomentum { optimizer, local }
    }

    fn outer_slots(&self) -> Vec<StateSlot> {
        let Some(local) = &self.local else { return Vec::new() };
        if local.config.momentum == 0.0 {
            return Vec::new();
        }
        local
            .params
            .iter()
            .map(|p| StateSlot { name: p.name().unwrap_or_default(), param: p.clone(), kind: TensorKind::OuterMomentum, elements: None })
            .collect()
    }
}

impl OptimizerState for WithOuterMomentum<'_> {
    fn info(&self) -> OptimizerInfo {
        self.optimizer.info()
    }

    fn zero_stage(&self) -> Option<u8> {
        self.optimizer.zero_stage()
    }

    fn pieces(&self) -> Result<Vec<StatePiece>> {
        let mut pieces = self.optimizer.pieces()?;
        if let Some(local) = &self.local {
            for (slot, v) in self.outer_slots().into_iter().zip(&local.velocity) {
                if let Some(v) = v {
                    pieces.push(StatePiece { slot, tensor: v.clone(), steps: local.meetings });
                }
            }
        }
        Ok(pieces)
    }

    /// The optimizer's slots, then (with momentum configured) the outer
    /// momentum's, which a checkpoint that holds none leaves out.
    fn slots(&self) -> Vec<StateSlot> {
        let mut slots = self.optimizer.slots();
        slots.extend(self.outer_slots());
        slots
    }

    fn restore(&mut self, mut values: Vec<(Tensor, Option<u64>)>, steps: u64) -> Result<()> {
        let own = self.optimizer.slots().len();
        let outer = self.outer_slots();
        if values.len() != own && values.len() != own + outer.len() {
            return Err(Error::state_mismatch(
                "LocalSgd::restore",
                format!("{} values for {own} optimizer slots and {} of outer momentum", values.len(), outer.len()),
            ));
        }
        let momentum = values.split_off(own);
        self.optimizer.restore(values, steps)?;
        if let Some(local) = self.local.as_deref_mut() {
            local.velocity = vec![None; local.params.len()];
            local.meetings = 0;
            for ((slot, (v, meetings)), held) in outer.iter().zip(momentum).zip(local.velocity.iter_mut()) {
                let shape = slot.param.local_shape();
                if v.elem_count() != shape.elem_count() {
                    return Err(Error::shape(
                        "LocalSgd::restore",
                        format!("an outer momentum of {} elements for `{}`, whose shard is {shape}", v.elem_count(), slot.name),
                    ));
                }
                *held = Some(v.reshape(shape)?.contiguous()?);
                local.meetings = local.meetings.max(meetings.unwrap_or(0));
            }
        }
        Ok(())
    }
}

/// The dtype the outer state is kept in: f64 for f64 values, else f32.
fn master(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

fn same_dtype(t: &Tensor, dtype: DType) -> Result<Tensor> {
    if t.dtype() == dtype {
        Ok(t.clone())
    } else {
        t.to_dtype(dtype)
    }
}

impl std::fmt::Debug for LocalSgd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LocalSgd(replicas = {}, {} parameters, {:?})", self.replicas.size(), self.params.len(), self.config)
    }
}
