//! The communicator interface every backend implements, and the trivial
//! communicator of a group of one rank.

use crate::error::Result;
use crate::tensor::Tensor;
use std::fmt;

/// Collective communication within one group of ranks (one mesh axis).
///
/// All ranks of the group must call the same collectives in the same order;
/// the code generated for a model guarantees that by construction, since
/// every rank runs the same forward and backward.
pub trait Communicator: fmt::Debug + Send + Sync {
    /// This rank's index in the group.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn size(&self) -> usize;
    /// The elementwise sum of `t` over the group, on every rank.
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor>;
    /// The ranks' tensors concatenated along `dim`, in rank order, on every rank.
    fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor>;
    /// The sum over the group, split along `dim`; rank `r` keeps part `r`.
    fn reduce_scatter_sum(&self, t: &Tensor, dim: usize) -> Result<Tensor>;
    /// Rank `root`'s tensor, on every rank.
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor>;
    /// Sends `parts[r]` to rank `r` and returns what every rank sent to this one, in rank order.
    fn all_to_all(&self, parts: Vec<Tensor>) -> Result<Vec<Tensor>>;
    /// Returns once every rank of the group has called it.
    fn barrier(&self) -> Result<()>;
}

/// The communicator of a group with a single rank: every collective is the identity.
#[derive(Clone, Copy, Debug, Default)]
pub struct SingleRank;

impl Communicator for SingleRank {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        Ok(t.clone())
    }
    fn all_gather(&self, t: &Tensor, _dim: usize) -> Result<Tensor> {
        Ok(t.clone())
    }
    fn reduce_scatter_sum(&self, t: &Tensor, _dim: usize) -> Result<Tensor> {
        Ok(t.clone())
    }
    fn broadcast(&self, t: &Tensor, _root: usize) -> Result<Tensor> {
        Ok(t.clone())
    }
    fn all_to_all(&self, parts: Vec<Tensor>) -> Result<Vec<Tensor>> {
        Ok(parts)
    }
    fn barrier(&self) -> Result<()> {
        Ok(())
    }
}
