//! Global gradient-norm clipping that counts each logical parameter once.

use tessera_core::ops;
use tessera_core::tensor::{DType, Tensor};
use tessera_core::{Error, Result};
use tessera_nn::module::{self, Cx, Module, Param, ParamId, Shard};

/// The L2 norm of the whole model's gradient, as one rank would compute it.
///
/// Every rank must call it at the same point (it reduces over the tensor-,
/// expert- and pipeline-parallel groups). Each logical parameter is counted
/// once: a tensor-parallel shard contributes its part (summed over the TP
/// group); a parameter replicated over the TP group counts once, not once
/// per rank; an expert held by one rank of the expert-parallel group is
/// summed over that group, every other parameter is replicated over it;
/// stages hold different parameters (summed over the pipeline group), and a
/// weight tied across stages (the embedding and the head) counts on the
/// first stage only. Data-parallel replicas hold the same averaged gradient
/// and are not summed. Parameters without a gradient contribute nothing.
///
/// Gradients sharded by ZeRO are measured by the engine over its shards
/// ([`Zero::grad_squares`](tessera_parallel::zero::Zero::grad_squares)) with
/// the same [`NormClasses`]. A caller that measures the norm every step can
/// build the classes once and call [`NormClasses::grad_norm`].
pub fn global_grad_norm<M: Module>(model: &M, cx: &Cx) -> Result<f64> {
    NormClasses::of(model, cx)?.grad_norm(model, cx)
}

/// Where each parameter's squared gradient is summed for the global norm:
/// over the tensor-parallel group when the parameter is split over it, over
/// the expert-parallel group when it is an expert, over the pipeline stages
/// always; and whether this rank counts it at all (a weight tied across
/// stages counts on the first stage only).
///
/// They depend only on the model's parameters and how they are laid out,
/// which are fixed once it is materialised: a trainer builds them once.
#[derive(Debug)]
pub struct NormClasses {
    class: std::collections::HashMap<ParamId, Option<usize>>,
}

impl NormClasses {
    /// The number of classes: split experts, split, experts, replicated.
    pub const COUNT: usize = 4;

    /// The classes of `model`'s parameters on the rank of `cx`.
    pub fn of<M: Module>(model: &M, cx: &Cx) -> Result<Self> {
        let pp = &cx.groups().pp;
        let mut class = std::collections::HashMap::new();
        let mut seen = std::collections::HashSet::new();
        module::visit_params(model, |e| {
            // A parameter visited again is tied (shared by several layers).
            let tied = !seen.insert(e.param.id());
            let split = matches!(e.param.shard(), Shard::Split { .. });
            let c = match (split, e.expert.is_some()) {
                (true, true) => 0,
                (true, false) => 1,
                (false, true) => 2,
                (false, false) => 3,
            };
            let counted = !(tied && pp.size() > 1 && pp.rank() != 0);
            if !counted || !class.contains_key(&e.param.id()) {
                class.insert(e.param.id(), counted.then_some(c));
            }
            Ok(())
        })?;
        Ok(NormClasses { class })
    }

    /// The class of `p` (an index below [`COUNT`](Self::COUNT)), or `None`
    /// when this rank does not count it.
    pub fn class(&self, p: &Param) -> Option<usize> {
        self.class.get(&p.id()).copied().flatten()
    }

    /// The global norm of `model`'s gradients (see [`global_grad_norm`]),
    /// `model` being the one these classes are [`of`](Self::of) on the rank
    /// of `cx`. Every rank calls it at the same point.
    pub fn grad_norm<M: Module>(&self, model: &M, cx: &Cx) -> Result<f64> {
        let mut squares = [0.0f64; Self::COUNT];
        for n in module::distinct_params(model)? {
            let Some(g) = n.param.grad() else { continue };
            if let Some(c) = self.class(&n.param) {
                squares[c] += ops::sum_squares(&g)?.to_scalar()?;
            }
        }
        self.norm(squares, cx)
    }

    /// The global norm from this rank's squared gradients per class (each
    /// summed over the data-parallel group first when the gradients are
    /// sharded over it). Every rank calls it at the same point.
    pub fn norm(&self, squares: [f64; Self::COUNT], cx: &Cx) -> Result<f64> {
        let dev = cx.device();
        let split = cx.tp().all_reduce_sum(&Tensor::from_vec(squares[..2].to_vec(), [2], dev)?)?.to_vec::<f64>()?;
        let experts = cx.groups().ep.all_reduce_sum(&Tensor::from_vec(vec![split[0] + squares[2]], [1], dev)?)?.to_scalar()?;
        let stage = cx.groups().pp.all_reduce_sum(&Tensor::from_vec(vec![experts + split[1] + squares[3]], [1], dev)?)?.to_scalar()?;
        Ok(stage.sqrt())
    }
}

/// Scales every gradient so the global norm is at most `max_norm`; returns
/// the norm before clipping (see [`global_grad_norm`] for how it counts).
pub fn clip_grad_norm<M: Module>(model: &M, cx: &Cx, max_norm: f64) -> Result<f64> {
    check_max_norm(max_norm)?;
    let norm = global_grad_norm(model, cx)?;
    if !norm.is_finite() {
        return Err(Error::non_finite(
            "clip_grad_norm",
            format!("the gradient norm is {norm}; skip this step (and lower the loss scale under fp16) rather than applying it"),
        ));
    }
    clip_to_norm(model, norm, max_norm)?;
    Ok(norm)
}

/// Scales every gradient by `max_norm / norm` when that is below one, for a
/// caller that has already measured the global norm with
/// [`global_grad_norm`] (a trainer that also monitors it): the norm's
/// reductions over the groups then run once per step, not twice.
pub fn clip_to_norm<M: Module>(model: &M, norm: f64, max_norm: f64) -> Result<()> {
    check_max_norm(max_norm)?;
    if !norm.is_finite() {
        return Err(Error::non_finite("clip_to_norm", format!("the gradient norm is {norm}; skip this step rather than clipping it")));
    }
    let factor = clip_factor(norm, max_norm);
    if factor < 1.0 {
        for n in module::distinct_params(model)? {
            if let Some(g) = n.param.grad() {
                let scaled = ops::scale(&g, factor)?;
                let scaled = if scaled.dtype() == g.dtype() { scaled } else { scaled.to_dtype(DType::F32)? };
                n.param.set_grad(scaled)?;
            }
        }
    }
    Ok(())
}

/// What clipping multiplies the gradients by when their global norm is
/// `norm`: `max_norm / norm` (with a little slack against division by
/// zero) when that is below one, else one. For an engine that applies it in
/// its update (ZeRO) rather than to the gradients.
pub fn clip_factor(norm: f64, max_norm: f64) -> f64 {
    (max_norm / (norm + 1e-6)).min(1.0)
}

fn check_max_norm(max_norm: f64) -> Result<()> {
    if !(max_norm.is_finite() && max_norm > 0.0) {
        return Err(Error::invalid("clip_grad_norm", format!("max_norm must be a positive number (e.g. 1.0), got {max_norm}")));
    }
    Ok(())
}
