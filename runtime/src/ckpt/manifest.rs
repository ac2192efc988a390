//! The manifest of a checkpoint: what was saved, where, and its checksums.

use crate::module::Shard;
use serde::{Deserialize, Serialize};

/// The manifest format this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;

/// The sizes of the mesh a checkpoint was written from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MeshInfo {
    /// Tensor-parallel degree.
    pub tp: usize,
    /// Data-parallel degree.
    pub dp: usize,
    /// Pipeline-parallel degree.
    pub pp: usize,
    /// Expert-parallel degree.
    pub ep: usize,
}

/// How a stored tensor is laid out over the tensor-parallel group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ShardInfo {
    /// The whole tensor; every rank holds it.
    Replicated,
    /// The `rank`-th of `degree` equal slices of dimension `dim`.
    Split {
        /// The split dimension.
        dim: usize,
        /// Which slice.
        rank: usize,
        /// Number of slices.
        degree: usize,
    },
}

impl From<Shard> for ShardInfo {
    fn from(s: Shard) -> Self {
        match s {
            Shard::Replicated => ShardInfo::Replicated,
            Shard::Split { dim, rank, degree } => ShardInfo::Split { dim, rank, degree },
        }
    }
}

/// What a stored tensor is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TensorKind {
    /// A parameter's values.
    Param,
    /// AdamW's first moment of a parameter.
    AdamM,
    /// AdamW's second moment of a parameter.
    AdamV,
}

/// One stored tensor (a parameter's shard, or one of its optimizer moments).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorRecord {
    /// The tensor's key in its rank file: the parameter's dotted name,
    /// suffixed `.adam_m` / `.adam_v` for the moments.
    pub name: String,
    /// The parameter's dotted name (its first, for a tied weight).
    pub param: String,
    /// Every other name the parameter is reached by (a tied weight's users).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub aliases: Vec<String>,
    /// What the tensor is.
    pub kind: TensorKind,
    /// The parameter's global (unsharded) shape.
    pub global_shape: Vec<usize>,
    /// The stored shard's shape.
    pub local_shape: Vec<usize>,
    /// Element type (`f32`, `bf16`, ...).
    pub dtype: String,
    /// The shard this tensor is.
    pub shard: ShardInfo,
    /// The rank file holding it, relative to the checkpoint directory.
    pub file: String,
    /// FNV-1a (64 bit) of the tensor's little-endian bytes, in hex.
    pub checksum: String,
    /// For optimizer moments: the updates applied to the parameter so far.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps: Option<u64>,
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

/// `manifest.json`: everything needed to check and restore a checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`FORMAT_VERSION`] of the writer.
    pub format: u32,
    /// The training step the checkpoint was taken after.
    pub step: u64,
    /// The mesh it was written from.
    pub mesh: MeshInfo,
    /// Every stored tensor.
    pub tensors: Vec<TensorRecord>,
    /// The optimizer, if its state was saved.
    pub optimizer: Option<OptimizerInfo>,
    /// Free-form trainer state (data cursor, loss scaler, RNG state).
    pub extra: serde_json::Value,
}

impl Manifest {
    /// The record of tensor `name` in rank file `file`.
    pub fn record(&self, name: &str, file: &str) -> Option<&TensorRecord> {
        self.tensors.iter().find(|r| r.name == name && r.file == file)
    }

    /// The records of parameter values (one per shard), in written order.
    pub fn params(&self) -> impl Iterator<Item = &TensorRecord> {
        self.tensors.iter().filter(|r| r.kind == TensorKind::Param)
    }
}
