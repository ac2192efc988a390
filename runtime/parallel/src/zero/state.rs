//! The state an engine changes as it runs: the parameters it holds, the
//! moments, the gradient buckets in flight and stage 3's gathers.

use super::layout::Rows;
use super::ZeroStats;
use std::ops::Range;
use tessera_core::tensor::Tensor;
use tessera_dist::Pending;

/// The parameters' values a rank holds.
pub(super) enum Params {
    /// Stages 1 and 2: the whole flat vector; every parameter's value is a
    /// view of it.
    Flat(Tensor),
    /// Stage 3: this rank's shard of the flat vector (the master copy).
    Shard(Tensor),
    /// With offload (stage 3 throughout, stages 1 and 2 after the first
    /// update): no copy on the device; the shard is the host master copy,
    /// and each value is gathered from it at its first use.
    Offloaded,
}

impl Params {
    /// This rank's shard of the parameters, `range` of the flat vector: a
    /// view, which an update changes in place.
    pub(super) fn shard(&self, range: Range<usize>) -> tessera_core::Result<Tensor> {
        match self {
            Params::Flat(flat) => flat.narrow(0, range.start, range.len()),
            Params::Shard(shard) => Ok(shard.clone()),
            Params::Offloaded => Err(tessera_core::Error::state_mismatch("Zero", "an offloaded shard lives in the host master copy")),
        }
    }
}

/// What an engine changes as it runs, behind its lock.
pub(super) struct State {
    /// The parameters' values this rank holds.
    pub(super) params: Params,
    /// This rank's shard of the f32 master copy, when the parameters are
    /// held in half precision (`None`: the parameters are their own master).
    pub(super) master: Option<Tensor>,
    pub(super) m: Tensor,
    pub(super) v: Tensor,
    /// Stages 2 and 3: the parameters of the bucket being packed.
    pub(super) open: Vec<usize>,
    /// Stages 2 and 3: whether each parameter's gradient was announced this step.
    pub(super) ready: Vec<bool>,
    /// Whether each parameter's gradient was packed into a bucket this step.
    pub(super) packed: Vec<bool>,
    pub(super) inflight: Vec<Bucket>,
    /// Stages 2 and 3: this rank's averaged gradient shard, once finished.
    pub(super) grad_shard: Option<Tensor>,
    /// Stage 1: whether the gradients were averaged since the last step.
    pub(super) synced: bool,
    /// Stage 3: how many runs hold each parameter's gathered value.
    pub(super) held: Vec<usize>,
    /// Stage 3: the gather order recorded during the first step.
    pub(super) order: Vec<usize>,
    pub(super) recording: bool,
    /// Position in `order` of the next gather expected.
    pub(super) cursor: usize,
    /// Whether this step has followed the recorded order so far.
    pub(super) on_track: bool,
    pub(super) prefetch: Option<(usize, Pending)>,
    /// With offload: the host update under way.
    pub(super) update: Option<super::HostUpdate>,
    /// Stages 1 and 2 with offload: whether each parameter's value awaits
    /// its gather after the last update.
    pub(super) stale: Vec<bool>,
    pub(super) stats: ZeroStats,
    /// The gradient communication of the step under way.
    pub(super) sync: crate::data::SyncStats,
    /// That of the last `finish`.
    pub(super) last_sync: crate::data::SyncStats,
}

/// A gradient bucket in flight (stages 2 and 3).
pub(super) struct Bucket {
    pub(super) rows: Rows,
    /// Where this rank's row starts in the result: 0 for a reduce-scatter
    /// (the result is the row), the earlier rows' length for an all-reduce.
    pub(super) my_start: usize,
    pub(super) pending: Pending,
    /// When its reduction started.
    pub(super) launched: std::time::Instant,
}

/// A sub-module whose own parameters stage 3 gathers around its runs.
pub(super) struct Unit {
    pub(super) path: String,
    pub(super) entries: Vec<usize>,
}
