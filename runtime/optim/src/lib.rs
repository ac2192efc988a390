//! Optimizers over a model's parameters.
//!
//! Its place: above the module system (`tessera-nn`), whose parameters it
//! updates, and below the parallel engines (ZeRO shards this same update) and
//! the trainer. It also defines [`OptimizerState`], the state a checkpoint
//! saves, so each optimizer implements it beside its own type. Users reach it
//! as `tessera::optim`.
//!
//! [`AdamW`] keeps the two Adam moments of every parameter next to it, on
//! the parameter's device and in its master dtype (f32; f64 when the model is
//! materialised in f64), and applies the fused [`ops::adamw_update`] to each
//! parameter in place. A parameter held in half precision (bf16 or f16, see
//! `Cx::with_half_params`) gets an f32 master copy too: the update is made
//! to the master copy, which is then rounded into the parameter. The ZeRO engine
//! (`tessera::parallel::zero`) applies the very same update to
//! a rank's shard of the flattened parameters, so both give bit-identical
//! results element by element.

use tessera_core::ops::{self, AdamWStep};
use tessera_core::tensor::{DType, Tensor};
use tessera_core::{Error, Result};
use tessera_nn::module::{self, Module, Param};

mod state;
pub use state::{adamw_info, OptimizerInfo, OptimizerState, SharedOptimizerState, StatePiece, StateSlot, TensorKind};

/// The hyper-parameters of AdamW other than the learning rate, which each
/// [`AdamW::step`] takes so a schedule can set it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConfig {
    /// Decay rate of the first moment.
    pub beta1: f64,
    /// Decay rate of the second moment.
    pub beta2: f64,
    /// Added to the square root of the second moment in the denominator.
    pub eps: f64,
    /// Decoupled weight-decay coefficient (multiplied by the learning rate).
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    /// β = (0.9, 0.999), ε = 1e-8, weight decay 0.01 (PyTorch's defaults).
    fn default() -> Self {
        AdamWConfig { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 }
    }
}

impl AdamWConfig {
    /// Checks the ranges the update needs: 0 ≤ β < 1, ε > 0, finite weight decay ≥ 0.
    pub fn validate(&self) -> Result<()> {
        let ok = (0.0..1.0).contains(&self.beta1)
            && (0.0..1.0).contains(&self.beta2)
            && self.eps > 0.0
            && self.eps.is_finite()
            && self.weight_decay >= 0.0
            && self.weight_decay.is_finite();
        if ok {
            Ok(())
        } else {
            Err(Error::invalid(
                "AdamWConfig",
                format!("hyper-parameters out of range: {self:?}; use 0 <= beta1, beta2 < 1, a finite eps > 0 and a finite weight decay >= 0"),
            ))
        }
    }

    /// The fused update's arguments for update number `step` (from 1) at learning rate `lr`.
    pub fn at(&self, step: u64, lr: f64) -> Result<AdamWStep> {
        if !(lr.is_finite() && lr >= 0.0) {
            return Err(Error::invalid("AdamW::step", format!("learning rate {lr}; pass a finite learning rate >= 0")));
        }
        Ok(AdamWStep { lr, beta1: self.beta1, beta2: self.beta2, eps: self.eps, weight_decay: self.weight_decay, step, grad_scale: 1.0 })
    }
}

/// One parameter with its moments.
struct Slot {
    name: String,
    param: Param,
    /// The f32 master copy of a parameter held in half precision.
    master: Option<Tensor>,
    m: Tensor,
    v: Tensor,
    /// Updates applied to this parameter so far (bias correction counts them).
    steps: u64,
}

/// One parameter's AdamW state, as [`AdamW::moments`] reports it.
#[derive(Clone, Copy, Debug)]
pub struct AdamWState<'a> {
    /// The parameter's dotted name (its first, for a tied parameter).
    pub name: &'a str,
    /// The parameter.
    pub param: &'a Param,
    /// The first moment, of the parameter's local shard shape.
    pub m: &'a Tensor,
    /// The second moment.
    pub v: &'a Tensor,
    /// The f32 master copy of a parameter held in half precision.
    pub master: Option<&'a Tensor>,
    /// Updates applied to the parameter so far (bias correction counts them).
    pub steps: u64,
}

/// AdamW (Adam with decoupled weight decay) over every parameter of a model.
///
/// Built after the model is materialised: it visits the parameters once (a
/// tied parameter, reached under several names, is updated once; one that
/// another pipeline stage holds is left to that stage) and
/// allocates zeroed moments `m` and `v` of each parameter's local shard
/// shape, dtype and device, so the device's memory accounting sees the
/// optimizer state (8 bytes per f32 parameter element).
///
/// ```
/// use tessera::nn::Linear;
/// use tessera::optim::{AdamW, AdamWConfig};
/// use tessera::prelude::*;
///
/// let cx = Cx::new(Device::cpu());
/// let layer = tessera::module::build(Linear::new(4, 2, true).unwrap(), &cx).unwrap();
/// let mut opt = AdamW::new(&layer, AdamWConfig::default()).unwrap();
/// assert_eq!(opt.state_bytes(), 2 * 4 * (4 * 2 + 2));
/// // ... forward and backward deliver the gradients, then:
/// opt.step(1e-3).unwrap();
/// opt.zero_grad();
/// ```
pub struct AdamW {
    config: AdamWConfig,
    slots: Vec<Slot>,
    /// Each parameter's slot.
    slot_of: std::collections::HashMap<tessera_nn::module::ParamId, usize>,
}

impl AdamW {
    /// An optimizer for every distinct parameter of `model` (materialised first).
    pub fn new<M: Module>(model: &M, config: AdamWConfig) -> Result<Self> {
        config.validate()?;
        let mut slots: Vec<Slot> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        module::visit_params(model, |e| {
            // Another pipeline stage holds (and updates) a remote parameter.
            if e.param.is_remote() || !seen.insert(e.param.id()) {
                return Ok(());
            }
            let value = e.param.value().map_err(|_| {
                Error::param_unavailable(
                    "AdamW::new",
                    format!("parameter `{}` has no value; build (materialise) the model before creating its optimizer", e.name),
                )
            })?;
            // A half-precision parameter's master copy starts as its value.
            let master = match value.dtype() {
                DType::BF16 | DType::F16 => Some(value.to_dtype(DType::F32)?),
                _ => None,
            };
            let dtype = master_dtype(e.name, master.as_ref().unwrap_or(&value))?;
            let m = Tensor::zeros(value.shape().clone(), dtype, value.device())?;
            let v = Tensor::zeros(value.shape().clone(), dtype, value.device())?;
            slots.push(Slot { name: e.name.to_string(), param: e.param.clone(), master, m, v, steps: 0 });
            Ok(())
        })?;
        let slot_of = slots.iter().enumerate().map(|(i, s)| (s.param.id(), i)).collect();
        Ok(AdamW { config, slots, slot_of })
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &AdamWConfig {
        &self.config
    }

    /// Number of distinct parameters updated.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether the model has no parameter.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Bytes of optimizer state (both moments of every parameter, and the
    /// master copies of those held in half precision).
    pub fn state_bytes(&self) -> usize {
        let bytes = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        self.slots.iter().map(|s| bytes(&s.m) + bytes(&s.v) + s.master.as_ref().map_or(0, bytes)).sum()
    }

    /// Updates every parameter that has a gradient, in place, at learning
    /// rate `lr`. A parameter without a gradient (not used this step) is
    /// left alone, moments included, and its step count does not advance.
    ///
    /// The gradients stay where they are; call [`zero_grad`](Self::zero_grad)
    /// before the next step's backward.
    ///
    /// All parameters are updated by one [`ops::adamw_update_many`]: on a
    /// GPU, one fused launch for the whole model.
    pub fn step(&mut self, lr: f64) -> Result<()> {
        self.step_scaled(lr, 1.0)
    }

    /// [`step`](Self::step) with every gradient multiplied by `grad_scale`
    /// inside the update (the clipping factor over the loss scale), so
    /// gradients held in half precision are never rewritten.
    pub fn step_scaled(&mut self, lr: f64, grad_scale: f64) -> Result<()> {
        self.config.at(1, lr)?;
        if !(grad_scale.is_finite() && grad_scale > 0.0) {
            return Err(Error::invalid("AdamW::step_scaled", format!("gradient scale {grad_scale}; pass a finite scale > 0")));
        }
        // (slot, parameter, gradient) of every parameter used this step.
        let mut used = Vec::with_capacity(self.slots.len());
        for (i, s) in self.slots.iter().enumerate() {
            let Some(g) = s.param.grad() else { continue };
            let p = s.param.value().map_err(|_| {
                Error::param_unavailable(
                    "AdamW::step",
                    format!("parameter `{}` has no value (freed by a sharding engine?); a sharded model is updated by its ZeRO engine, not by `AdamW`", s.name),
                )
            })?;
            // The update goes to the master copy where there is one.
            let target = self.slots[i].master.clone().unwrap_or(p);
            used.push((i, target, g));
        }
        let targets = used
            .iter()
            .map(|(i, p, g)| {
                let s = &self.slots[*i];
                let mut step = self.config.at(s.steps + 1, lr)?;
                step.grad_scale = grad_scale;
                Ok(ops::AdamWTarget { step, param: p, grad: g, m: &s.m, v: &s.v })
            })
            .collect::<Result<Vec<_>>>()?;
        ops::adamw_update_many(&targets)?;
        for (i, _, _) in &used {
            let s = &mut self.slots[*i];
            s.steps += 1;
            if let Some(master) = &s.master {
                s.param.set_value(master.to_dtype(s.param.value()?.dtype())?)?;
            }
        }
        Ok(())
    }

    /// The state of every distinct parameter, in visiting order (what a
    /// checkpoint saves): its name, handle, moments and update count.
    pub fn moments(&self) -> Vec<AdamWState<'_>> {
        self.slots.iter().map(|s| AdamWState { name: &s.name, param: &s.param, m: &s.m, v: &s.v, master: s.master.as_ref(), steps: s.steps }).collect()
    }

    /// Replaces the moments and update count of `param` (restoring a
    /// checkpoint). The moments must have the shape and dtype of the ones
    /// they replace; `param` must be one this optimizer updates.
    pub fn load_state(&mut self, param: &Param, m: Tensor, v: Tensor, steps: u64) -> Result<()> {
        let Some(s) = self.slot_of.get(&param.id()).map(|&i| &mut self.slots[i]) else {
            return Err(Error::state_mismatch(
                "AdamW::load_state",
                format!("{param:?} is not updated by this optimizer; build the optimizer from the model the state belongs to"),
            ));
        };
        for (what, t) in [("first moment", &m), ("second moment", &v)] {
            if t.shape() != s.m.shape() || t.dtype() != s.m.dtype() {
                return Err(Error::shape(
                    "AdamW::load_state",
                    format!(
                        "the {what} of `{}` is {} {}, the optimizer holds {} {}; restore state saved from the same model and mesh",
                        s.name,
                        t.dtype(),
                        t.shape(),
                        s.m.dtype(),
                        s.m.shape()
                    ),
                ));
            }
        }
        s.m = m;
        s.v = v;
        s.steps = steps;
        Ok(())
    }

    /// The full-precision value the updates go to: the master copy of a
    /// parameter held in half precision, else the parameter's value.
    pub fn master_or_value(&self, param: &Param) -> Result<Tensor> {
        match self.slot_of.get(&param.id()).and_then(|&i| self.slots[i].master.clone()) {
            Some(master) => Ok(master),
            None => param.value(),
        }
    }

    /// Sets `param` to `value` (full precision): its master copy where it
    /// has one (rounded into the parameter), else the parameter itself.
    pub fn set_master_or_value(&mut self, param: &Param, value: Tensor) -> Result<()> {
        match self.slot_of.get(&param.id()).map(|&i| self.slots[i].master.is_some()) {
            Some(true) => self.load_master(param, value),
            _ => {
                let dtype = param.value()?.dtype();
                param.set_value(if value.dtype() == dtype { value } else { value.to_dtype(dtype)? })
            }
        }
    }

    /// Replaces the master copy of `param`, a parameter held in half
    /// precision (restoring a checkpoint), and rounds it into the parameter.
    pub fn load_master(&mut self, param: &Param, master: Tensor) -> Result<()> {
        let Some(s) = self.slot_of.get(&param.id()).map(|&i| &mut self.slots[i]) else {
            return Err(Error::state_mismatch("AdamW::load_master", format!("{param:?} is not updated by this optimizer; build the optimizer from the model")));
        };
        let Some(current) = &s.master else {
            return Err(Error::state_mismatch("AdamW::load_master", format!("`{}` is its own master copy (held in full precision)", s.name)));
        };
        if master.shape() != current.shape() {
            return Err(Error::shape(
                "AdamW::load_master",
                format!("a master copy of shape {} for `{}`, whose shard is {}", master.shape(), s.name, current.shape()),
            ));
        }
        let master = if master.dtype() == current.dtype() { master } else { master.to_dtype(current.dtype())? };
        s.param.set_value(master.to_dtype(s.param.value()?.dtype())?)?;
        s.master = Some(master);
        Ok(())
    }

    /// Drops every parameter's gradient (and the uses still waiting for theirs).
    pub fn zero_grad(&self) {
        for s in &self.slots {
            s.param.take_grad();
        }
    }
}

/// The master dtype of a parameter's value: f32 or f64, else an error.
pub fn master_dtype(name: &str, value: &Tensor) -> Result<DType> {
    match value.dtype() {
        d @ (DType::F32 | DType::F64) => Ok(d),
        other => Err(Error::DType {
            op: "AdamW",
            expected: format!("f32 (or f64) master weights for `{name}`"),
            got: other,
            hint: "; materialise the model in f32 (its parameters are the master weights the optimizer updates)",
        }),
    }
}

impl std::fmt::Debug for AdamW {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AdamW({} parameters, {:?})", self.slots.len(), self.config)
    }
}
