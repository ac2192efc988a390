//! Cross-entropy fused with log-softmax.

use super::{float_kernel, rows, run, run1, with_u32};
use crate::backend::cuda::args::{Arg, Grid};
use crate::backend::cuda::CudaCall;
use crate::backend::kernel::Out;
use crate::error::{Error, Result};
use crate::tensor::{DType, Shape, Tensor};
use tessera_kernels::cpu::cross_entropy as k;
use tessera_kernels::cpu::mixed::{self, Cut};

float_kernel!(CeFwd<'a> { targets: &'a [u32], vocab: usize, ignore: Option<u32> } |s, i, o| {
    let (losses, lse) = o.split_at_mut(1);
    k::cross_entropy_forward(i[0], s.vocab, s.targets, s.ignore, losses[0], lse[0]);
}; cuda |s, c| rows_cuda(c, s.targets, s.vocab, 0, s.ignore, true);
    half |s, dtype, dtypes| true => |i, o| {
        let rows = s.targets.len();
        mixed::blocked(rows, &[(i[0], Cut::Units(s.vocab))], o.into_iter().map(|d| (d, 1)).collect(), |r0, x, y| {
            let (losses, lse) = y.split_at_mut(1);
            let t = &s.targets[r0..r0 + losses[0].len()];
            k::cross_entropy_forward(x[0], s.vocab, t, s.ignore, losses[0], lse[0]);
        })
    });
float_kernel!(CeBack<'a> { targets: &'a [u32], vocab: usize, ignore: Option<u32> } |s, i, o| {
    k::cross_entropy_backward(i[0], i[1], s.vocab, s.targets, s.ignore, i[2], o[0])
}; cuda |s, c| backward_cuda(c, s.targets, s.vocab, 0, s.ignore);
    half |s, dtype, dtypes| true => |i, o| {
        let rows = s.targets.len();
        let ins = [(i[0], Cut::Units(s.vocab)), (i[1], Cut::Units(1)), (i[2], Cut::Units(1))];
        mixed::blocked(rows, &ins, vec![(o.remove(0), s.vocab)], |r0, x, y| {
            let t = &s.targets[r0..r0 + x[1].len()];
            k::cross_entropy_backward(x[0], x[1], s.vocab, t, s.ignore, x[2], y[0])
        })
    });
float_kernel!(Mean { count: usize } |s, i, o| {
    o[0][0] = tessera_kernels::cpu::reduce::sum(i[0]) / T::lit(s.count.max(1) as f64)
}; cuda |s, c| {
    let n = c.input_len(0);
    c.at_least(Arg::Output(0), 1)?;
    // SAFETY: the kernel reads input 0's `n` elements and writes one (checked).
    unsafe { c.launch("loss", "mean", Grid::Rows { rows: 1, cols: n }, &[Arg::Input(0), Arg::Output(0), Arg::U64(n), Arg::U64(s.count)]) }
});

/// The ignore index as the kernels take it: above `u32::MAX` means none.
fn ignore_arg(ignore: Option<u32>) -> Arg {
    Arg::U64(ignore.map_or(usize::MAX, |t| t as usize))
}

/// Per-row statistics on a GPU (`cross_entropy_rows` of `loss.cu`): with
/// `full`, outputs (losses, lse) of a whole vocabulary; without, a shard's
/// (lse, target logit).
fn rows_cuda(c: &mut CudaCall, targets: &[u32], vocab: usize, start: u32, ignore: Option<u32>, full: bool) -> Result<()> {
    let rows = targets.len();
    let t = Arg::Scratch(c.upload_u32(targets)?);
    let args = [
        Arg::Input(0),
        t,
        Arg::Output(0),
        Arg::Output(1),
        Arg::U64(rows),
        Arg::U64(vocab),
        Arg::U64(start as usize),
        ignore_arg(ignore),
        Arg::U32(full as u32),
    ];
    for (a, n) in [(Arg::Input(0), rows * vocab), (Arg::Output(0), rows), (Arg::Output(1), rows)] {
        c.at_least(a, n)?;
    }
    // SAFETY: the kernel reads `rows` rows of `vocab` logits and `rows` targets (uploaded),
    // and writes `rows` values of each output (checked); a target outside this shard's
    // `start..start + vocab` is never used as an index.
    unsafe { c.launch("loss", "cross_entropy_rows", Grid::Rows { rows, cols: vocab }, &args) }
}

/// The gradient of the logits on a GPU: inputs logits, the f32 `lse` and the
/// f32 per-row upstream gradient.
fn backward_cuda(c: &mut CudaCall, targets: &[u32], vocab: usize, start: u32, ignore: Option<u32>) -> Result<()> {
    let rows = targets.len();
    let t = Arg::Scratch(c.upload_u32(targets)?);
    let args = [Arg::Input(0), Arg::Stats(1), Arg::Stats(2), t, Arg::Output(0), Arg::U64(rows), Arg::U64(vocab), Arg::U64(start as usize), ignore_arg(ignore)];
    for (a, n) in [(Arg::Input(0), rows * vocab), (Arg::Stats(1), rows), (Arg::Stats(2), rows), (Arg::Output(0), rows * vocab)] {
        c.at_least(a, n)?;
    }
    // SAFETY: the kernel reads `rows` rows of `vocab` logits, `rows` statistics of each kind
    // and `rows` targets (uploaded), and writes `rows * vocab` gradients (all checked); a
    // target outside this shard's `start..start + vocab` is never used as an index.
    unsafe { c.launch("loss", "cross_entropy_backward", Grid::Rows { rows, cols: vocab }, &args) }
}

/// What [`cross_entropy`] keeps for its backward.
#[derive(Clone, Debug)]
pub struct CrossEntropySaved {
    /// Per-row log-sum-exp of the logits, in the compute dtype.
    pub lse: Tensor,
    /// Rows that count (targets not equal to the ignore index).
    pub count: usize,
}

fn check(op: &'static str, logits: &Tensor, targets: &[u32], target_shape: &Shape, ignore: Option<u32>) -> Result<(usize, usize)> {
    let vocab = logits.shape().last_dim(op)?;
    let n = rows(logits);
    if target_shape.elem_count() != n || logits.dims()[..logits.rank() - 1] != *target_shape.dims() {
        return Err(Error::shape(op, format!("logits {} need one target per row, targets have shape {}", logits.shape(), target_shape)));
    }
    let bad = targets.iter().position(|&t| Some(t) != ignore && t as usize >= vocab);
    if let Some(position) = bad {
        return Err(Error::IndexOutOfRange {
            op,
            index: targets[position] as u64,
            position,
            bound: vocab as u64,
            hint: "; targets must be token ids below the vocabulary size (or the ignore index)",
        });
    }
    Ok((vocab, targets.iter().filter(|&&t| Some(t) != ignore).count()))
}

/// Mean cross-entropy of `logits` (`[..., vocab]`) against `u32` `targets`
/// (`[...]`), averaged over the rows whose target is not `ignore_index`.
/// Returns the scalar loss (compute dtype) and what the backward needs; a
/// batch where every row is ignored has loss 0.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor, ignore_index: Option<u32>) -> Result<(Tensor, CrossEntropySaved)> {
    const OP: &str = "cross_entropy";
    with_u32(OP, "targets", targets, |t| {
        let (vocab, count) = check(OP, logits, t, targets.shape(), ignore_index)?;
        let n = Shape::new(vec![rows(logits)]);
        let kernel = CeFwd { targets: t, vocab, ignore: ignore_index };
        let mut r = run(OP, &kernel, &[logits], &[(n.clone(), Out::Compute), (n, Out::Compute)])?;
        let lse = r.pop().expect("two outputs");
        let loss = run1(OP, &Mean { count }, &[&r[0]], Shape::from(()), Out::Compute)?;
        Ok((loss, CrossEntropySaved { lse, count }))
    })
}

/// Backward of [`cross_entropy`]: the gradient of the logits for the scalar
/// upstream gradient `dloss` (1.0 when the loss is the objective).
pub fn cross_entropy_backward(logits: &Tensor, targets: &Tensor, ignore_index: Option<u32>, saved: &CrossEntropySaved, dloss: f64) -> Result<Tensor> {
    const OP: &str = "cross_entropy_backward";
    with_u32(OP, "targets", targets, |t| {
        let (vocab, count) = check(OP, logits, t, targets.shape(), ignore_index)?;
        if count != saved.count {
            return Err(Error::state_mismatch(OP, "the saved state belongs to another batch of targets"));
        }
        let per_row = dloss / count.max(1) as f64;
        // Made in the compute dtype directly: a GPU has no f64 conversions.
        let per_row = if logits.dtype() == DType::F64 {
            Tensor::full(per_row, [rows(logits)], DType::F64, logits.device())?
        } else {
            Tensor::from_vec(vec![per_row as f32; rows(logits)], [rows(logits)], logits.device())?
        };
        let kernel = CeBack { targets: t, vocab, ignore: ignore_index };
        run1(OP, &kernel, &[logits, &saved.lse, &per_row], logits.shape().clone(), Out::Primary)
    })
}

float_kernel!(ShardStats<'a> { targets: &'a [u32], vocab: usize, start: u32, ignore: Option<u32> } |s, i, o| {
    let (lse, tl) = o.split_at_mut(1);
    k::vocab_shard_stats(i[0], s.vocab, s.start, s.targets, s.ignore, lse[0], tl[0])
}; cuda |s, c| rows_cuda(c, s.targets, s.vocab, s.start, s.ignore, false);
    half |s, dtype, dtypes| true => |i, o| {
        let rows = s.targets.len();
        mixed::blocked(rows, &[(i[0], Cut::Units(s.vocab))], o.into_iter().map(|d| (d, 1)).collect(), |r0, x, y| {
            let (lse, tl) = y.split_at_mut(1);
            let t = &s.targets[r0..r0 + lse[0].len()];
            k::vocab_shard_stats(x[0], s.vocab, s.start, t, s.ignore, lse[0], tl[0])
        })
    });
float_kernel!(ShardBack<'a> { targets: &'a [u32], vocab: usize, start: u32, ignore: Option<u32> } |s, i, o| {
    k::vocab_shard_backward(i[0], i[1], s.vocab, s.start, s.targets, s.ignore, i[2], o[0])
}; cuda |s, c| backward_cuda(c, s.targets, s.vocab, s.start, s.ignore);
    half |s, dtype, dtypes| true => |i, o| {
        let rows = s.targets.len();
        let ins = [(i[0], Cut::Units(s.vocab)), (i[1], Cut::Units(1)), (i[2], Cut::Units(1))];
        mixed::blocked(rows, &ins, vec![(o.remove(0), s.vocab)], |r0, x, y| {
            let t = &s.targets[r0..r0 + x[1].len()];
            k::vocab_shard_backward(x[0], x[1], s.vocab, s.start, t, s.ignore, x[2], y[0])
        })
    });

fn check_shard(
    op: &'static str,
    logits: &Tensor,
    targets: &[u32],
    target_shape: &Shape,
    vocab_start: usize,
    vocab_size: usize,
    ignore: Option<u32>,
) -> Result<usize> {
    let local = logits.shape().last_dim(op)?;
    if vocab_start + local > vocab_size {
        return Err(Error::shape(op, format!("a shard of {local} vocabulary entries starting at {vocab_start} does not fit a vocabulary of {vocab_size}")));
    }
    if target_shape.elem_count() != rows(logits) {
        return Err(Error::shape(op, format!("logits {} need one target per row, targets have shape {}", logits.shape(), target_shape)));
    }
    if let Some(position) = targets.iter().position(|&t| Some(t) != ignore && t as usize >= vocab_size) {
        return Err(Error::IndexOutOfRange {
            op,
            index: targets[position] as u64,
            position,
            bound: vocab_size as u64,
            hint: "; targets must be token ids below the vocabulary size (or the ignore index)",
        });
    }
    Ok(local)
}

/// Per-row statistics of one vocabulary shard of the logits (`[.., vocab_local]`,
/// entries `vocab_start..` of a `vocab_size` vocabulary): this shard's
/// log-sum-exp and the target's logit where the target is in this shard (0
/// elsewhere). Both are `[rows]` in the compute dtype; summing the target
/// logits over the shards and log-sum-exp-combining their `lse` gives the
/// full cross-entropy without gathering the logits.
pub fn vocab_shard_stats(logits: &Tensor, targets: &Tensor, vocab_start: usize, vocab_size: usize, ignore_index: Option<u32>) -> Result<(Tensor, Tensor)> {
    const OP: &str = "vocab_shard_stats";
    with_u32(OP, "targets", targets, |t| {
        let vocab = check_shard(OP, logits, t, targets.shape(), vocab_start, vocab_size, ignore_index)?;
        let n = Shape::new(vec![rows(logits)]);
        let kernel = ShardStats { targets: t, vocab, start: vocab_start as u32, ignore: ignore_index };
        let mut r = run(OP, &kernel, &[logits], &[(n.clone(), Out::Compute), (n, Out::Compute)])?;
        let tl = r.pop().expect("two outputs");
        Ok((r.pop().expect("two outputs"), tl))
    })
}

/// Backward of a vocabulary shard given the full rows' log-sum-exp `lse` and
/// the per-row upstream gradient `dloss` (`[rows]`, zero for ignored rows).
pub fn vocab_shard_backward(
    logits: &Tensor,
    targets: &Tensor,
    vocab_start: usize,
    vocab_size: usize,
    ignore_index: Option<u32>,
    lse: &Tensor,
    dloss: &Tensor,
) -> Result<Tensor> {
    const OP: &str = "vocab_shard_backward";
    with_u32(OP, "targets", targets, |t| {
        let vocab = check_shard(OP, logits, t, targets.shape(), vocab_start, vocab_size, ignore_index)?;
        let kernel = ShardBack { targets: t, vocab, start: vocab_start as u32, ignore: ignore_index };
        run1(OP, &kernel, &[logits, lse, dloss], logits.shape().clone(), Out::Primary)
    })
}
