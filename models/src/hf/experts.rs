//! Checkpoints of a model whose experts may be split over expert-parallel
//! ranks (Mixtral, MoE GPT-2): such a rank loads only its own experts and
//! cannot export the whole model.

use crate::error::{Error, Result};
use std::ops::Range;

/// Whether checkpoint tensor `tensor` belongs to an expert outside `local`
/// (the experts this rank holds), and so fills no parameter here. `experts`
/// is where the model keeps its experts in a tensor's name, dots included
/// (`.block_sparse_moe.experts.` for `...block_sparse_moe.experts.{e}.w1.weight`).
pub(crate) fn held_elsewhere(tensor: &str, experts: &str, local: Range<usize>) -> bool {
    expert_of(tensor, experts).is_some_and(|e| !local.contains(&e))
}

/// The expert index of an expert's tensor (`...{experts}{e}.…`).
fn expert_of(tensor: &str, experts: &str) -> Option<usize> {
    let (_, rest) = tensor.split_once(experts)?;
    rest.split('.').next()?.parse().ok()
}

/// Refuses to export from rank `rank` of an expert-parallel split of
/// `degree` ranks (`degree` 1: every expert is here, nothing to refuse).
pub(crate) fn check_every_expert_held((rank, degree): (usize, usize)) -> Result<()> {
    if degree > 1 {
        return Err(Error::Export(format!(
            "this rank holds only the experts of expert-parallel rank {rank} of {degree}; export from a model holding every expert (expert-parallel degree 1)"
        )));
    }
    Ok(())
}
