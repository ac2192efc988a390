//! Cross-entropy over vocabulary-parallel logits.

use crate::module::{Act, SplitHidden};
use tessera_core::ops;
use tessera_core::tensor::{DType, Tensor};
use tessera_core::{Error, Result};
use tessera_dist::Communicator;

/// What [`vocab_parallel_cross_entropy`] keeps for its backward.
#[derive(Clone, Debug)]
pub struct VocabParallelCeSaved {
    /// The full rows' log-sum-exp (over every shard), `[rows]`.
    lse: Tensor,
    /// 1 for rows that count, 0 for ignored rows, `[rows]`.
    mask: Tensor,
    /// Rows that count.
    count: usize,
    vocab_start: usize,
}

/// Mean cross-entropy of logits split over the tensor-parallel group along
/// the vocabulary (rank `r` holds entries `r·V/tp .. (r+1)·V/tp` of each row,
/// as a `#[shard(vocab)]` output head produces them), computed without
/// gathering the logits: each rank reduces its slice to a log-sum-exp and the
/// target's logit, and only those `[rows]` vectors cross the group.
///
/// `tp` is the tensor-parallel group (`cx.tp()`). `targets` hold global token ids, one per row; rows whose target is
/// `ignore_index` count neither in the loss nor in the mean. Returns the
/// scalar loss (the same on every rank) and the state for the backward.
pub fn vocab_parallel_cross_entropy(
    tp: &dyn Communicator,
    logits: &Act<SplitHidden>,
    targets: &Tensor,
    vocab_size: usize,
    ignore_index: Option<u32>,
) -> Result<(Tensor, VocabParallelCeSaved)> {
    const OP: &str = "vocab_parallel_cross_entropy";
    let logits = logits.tensor();
    let (rank, degree) = (tp.rank(), tp.size());
    let local = logits.shape().last_dim(OP)?;
    if local * degree != vocab_size {
        return Err(Error::shape(
            OP,
            format!("{local} logits per rank × tensor-parallel degree {degree} != vocabulary {vocab_size}; the head must split the vocabulary evenly"),
        ));
    }
    let vocab_start = rank * local;
    let (lse_local, target_local) = ops::vocab_shard_stats(logits, targets, vocab_start, vocab_size, ignore_index)?;
    let rows = lse_local.elem_count();
    // One collective for both: every rank's log-sum-exp and target logit
    // (`[2·tp, rows]`, rank r's at rows 2r and 2r + 1).
    let stats = Tensor::concat(&[&lse_local.reshape([1, rows])?, &target_local.reshape([1, rows])?], 0)?;
    let gathered = tp.all_gather(&stats, 0)?;
    let of_each = |k: usize| (0..degree).map(|r| gathered.narrow(0, 2 * r + k, 1)).collect::<Result<Vec<_>>>();
    // The target's logit: its shard's, the others hold zero (summed in rank order).
    let mut target_logit = gathered.narrow(0, 1, 1)?;
    for t in &of_each(1)?[1..] {
        target_logit = ops::add(&target_logit, t)?;
    }
    let target_logit = target_logit.reshape([rows])?;
    // Combine the shards' log-sum-exps: lse = x₀ − log_softmax(x)₀ over each row of [rows, tp].
    let shards = Tensor::concat(&of_each(0)?.iter().collect::<Vec<_>>(), 0)?.t()?.contiguous()?;
    let first = shards.narrow(1, 0, 1)?;
    let lse = ops::sub(&first, &ops::log_softmax(&shards)?.narrow(1, 0, 1)?)?.reshape([rows])?;

    let ids = targets.to_dtype(DType::U32)?.to_vec::<u32>()?;
    let keep: Vec<f64> = ids.iter().map(|&t| if Some(t) == ignore_index { 0.0 } else { 1.0 }).collect();
    let count = keep.iter().filter(|&&k| k > 0.0).count();
    let mask = Tensor::from_vec(keep, [rows], logits.device())?.to_dtype(lse.dtype())?;
    let per_row = ops::mul(&ops::sub(&lse, &target_logit)?, &mask)?;
    let loss = ops::scale(&ops::sum(&per_row)?, 1.0 / count.max(1) as f64)?;
    Ok((loss, VocabParallelCeSaved { lse, mask, count, vocab_start }))
}

/// Backward of [`vocab_parallel_cross_entropy`]: this rank's slice of the
/// logits' gradient for the scalar upstream gradient `dloss`. No communication.
pub fn vocab_parallel_cross_entropy_backward(
    logits: &Act<SplitHidden>,
    targets: &Tensor,
    vocab_size: usize,
    ignore_index: Option<u32>,
    saved: &VocabParallelCeSaved,
    dloss: f64,
) -> Result<Act<SplitHidden>> {
    let per_row = ops::scale(&saved.mask, dloss / saved.count.max(1) as f64)?;
    let d = ops::vocab_shard_backward(logits.tensor(), targets, saved.vocab_start, vocab_size, ignore_index, &saved.lse, &per_row)?;
    Ok(Act::new(d))
}
