//! Global gradient-norm clipping that counts each logical parameter once.

use tessera_core::ops;
use tessera_core::tensor::{DType, Tensor};
use tessera_core::{Error, Result};
use tessera_nn::module::{self, Cx, Module, Shard};

/// The L2 norm of the whole model's gradient, as one rank would compute it.
///
/// Every rank must call it at the same point (it reduces over the tensor-
/// and pipeline-parallel groups). Each logical parameter is counted once:
/// a tensor-parallel shard contributes its part (summed over the TP group);
/// a parameter replicated over the TP group counts once, not once per rank;
/// stages hold different parameters (summed over the pipeline group), and a
/// weight tied across stages (the embedding and the head) counts on the
/// first stage only. Data-parallel replicas hold the same averaged gradient
/// and are not summed. Parameters without a gradient contribute nothing.
///
/// Not covered: gradients sharded by ZeRO stages 2 and 3, and expert
/// parameters split over an expert-parallel group.
pub fn global_grad_norm<M: Module>(model: &M, cx: &Cx) -> Result<f64> {
    let pp = &cx.groups().pp;
    let (mut split, mut replicated) = (0.0f64, 0.0f64);
    for n in module::distinct_params(model)? {
        let p = &n.param;
        let Some(g) = p.grad() else { continue };
        if n.is_tied() && pp.size() > 1 && pp.rank() != 0 {
            continue;
        }
        let sq = ops::sum_squares(&g)?.to_scalar()?;
        match p.shard() {
            Shard::Split { .. } => split += sq,
            Shard::Full => replicated += sq,
        }
    }
    let dev = cx.device();
    let scalar = |v: f64| Tensor::from_vec(vec![v], [1], dev);
    let split = cx.tp().all_reduce_sum(&scalar(split)?)?.to_scalar()?;
    let stage = pp.all_reduce_sum(&scalar(split + replicated)?)?.to_scalar()?;
    Ok(stage.sqrt())
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
