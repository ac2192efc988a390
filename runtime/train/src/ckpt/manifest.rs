//! The manifest of a checkpoint: what was saved, where each piece lies in
//! its global tensor, in which file, and its checksum.

use super::region::Region;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::Path;
use tessera_core::{Error, Result};
use tessera_nn::module::{ExpertSlot, StagePart};
use tessera_optim::{OptimizerInfo, TensorKind};

/// The manifest format this build writes (it also reads format 2).
///
/// Format 1 stored each tensor-parallel rank's shards by their rank and
/// could only be restored on the same mesh; format 2 addresses every stored
/// piece by its place in the global tensor; format 3 adds the manifest's
/// own checksum, so that an edit to the step, the data cursor or the
/// optimizer's step counts is detected like a damaged tensor.
pub const FORMAT_VERSION: u32 = 3;

/// The oldest format this build reads.
const OLDEST_READ: u32 = 2;

/// The mesh a checkpoint was written from.
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
    /// Model chunks per pipeline stage (1 unless the schedule interleaves).
    pub chunks: usize,
}

impl MeshInfo {
    /// One rank.
    pub fn single() -> Self {
        MeshInfo { tp: 1, dp: 1, pp: 1, ep: 1, chunks: 1 }
    }

    /// Number of ranks: `tp · dp · pp · ep`.
    pub fn world(&self) -> usize {
        self.tp * self.dp * self.pp * self.ep
    }
}

impl std::fmt::Display for MeshInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "pp{} dp{} ep{} tp{}", self.pp, self.dp, self.ep, self.tp)?;
        if self.chunks > 1 {
            write!(f, " ({} chunks per stage)", self.chunks)?;
        }
        Ok(())
    }
}

/// One logical parameter of the model: how it is laid out on any mesh.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamRecord {
    /// The parameter's dotted name (its first, for a tied weight).
    pub name: String,
    /// Every other name the parameter is reached by (a tied weight's users).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub aliases: Vec<String>,
    /// The global (unsharded) shape.
    pub global_shape: Vec<usize>,
    /// Element type of the parameter (`f32`, ...).
    pub dtype: String,
    /// The dimension tensor parallelism splits into equal slices; `None`
    /// when every tensor-parallel rank holds the whole parameter.
    pub split_dim: Option<usize>,
    /// The parts of the pipelined model that use it, one per name
    /// (`first` for the embedding, `last` for a head tied to it).
    pub stages: Vec<StagePart>,
    /// For an expert's weight: which expert (expert parallelism places it on
    /// one rank; everything else is replicated over the expert group).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert: Option<ExpertSlot>,
}

impl ParamRecord {
    /// Whether `name` is this parameter's name or one of its aliases.
    pub fn is_named(&self, name: &str) -> bool {
        self.name == name || self.aliases.iter().any(|a| a == name)
    }
}

/// One stored piece: part of a parameter (or of one of its optimizer
/// moments), where it lies in the global tensor and where it is stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorRecord {
    /// The tensor's key in its rank file (see [`TensorKind::key`]).
    pub name: String,
    /// The parameter's dotted name (its [`ParamRecord::name`]).
    pub param: String,
    /// What the tensor is.
    pub kind: TensorKind,
    /// The elements of the global tensor it holds.
    pub region: Region,
    /// Element type (`f32`, `bf16`, ...).
    pub dtype: String,
    /// The rank file holding it, relative to the checkpoint directory.
    pub file: String,
    /// FNV-1a (64 bit) of the tensor's little-endian bytes, in hex.
    pub checksum: String,
    /// For optimizer moments: the updates applied to the parameter so far.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps: Option<u64>,
}

impl TensorRecord {
    /// Bytes of tensor data the piece holds.
    pub fn byte_len(&self) -> usize {
        self.region.elem_count() * super::io::dtype_named(&self.dtype).map_or(0, |d| d.size_in_bytes())
    }
}

/// `manifest.json`: everything needed to check and restore a checkpoint on
/// any mesh.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`FORMAT_VERSION`] of the writer.
    pub format: u32,
    /// The training step the checkpoint was taken after.
    pub step: u64,
    /// The mesh it was written from.
    pub mesh: MeshInfo,
    /// The ZeRO stage (1, 2 or 3) whose shards the optimizer state (and
    /// under stage 3 the parameters) were written as; `None` without ZeRO.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zero_stage: Option<u8>,
    /// Every parameter of the model, in the model's order.
    pub params: Vec<ParamRecord>,
    /// Every stored piece.
    pub tensors: Vec<TensorRecord>,
    /// The optimizer, if its state was saved.
    pub optimizer: Option<OptimizerInfo>,
    /// Free-form trainer state (data cursor, loss scaler, RNG state).
    pub extra: serde_json::Value,
    /// Written only so that a stopped job can resume here
    /// ([`Checkpointer::save_resume_point`](super::Checkpointer::save_resume_point)):
    /// not a rollback target, and pruned by the next checkpoint.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub resume_point: bool,
    /// The checksum of everything above (the manifest as compact JSON with
    /// this field left out); `None` only in format 2 manifests.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checksum: Option<String>,
}

impl Manifest {
    /// Parses `manifest.json` (read from `path`), refusing any other format
    /// version with an error that says which.
    pub fn from_json(bytes: &[u8], path: &Path) -> Result<Manifest> {
        #[derive(Deserialize)]
        struct Version {
            format: Option<u32>,
        }
        let shown = path.display().to_string();
        let malformed = |e: serde_json::Error| Error::Checkpoint { path: shown.clone(), detail: format!("malformed manifest: {e}") };
        let version: Version = serde_json::from_slice(bytes).map_err(malformed)?;
        let manifest: Manifest = match version.format {
            Some(f) if (OLDEST_READ..=FORMAT_VERSION).contains(&f) => serde_json::from_slice(bytes).map_err(malformed)?,
            found => return Err(Error::CheckpointFormat { path: shown, found, supported: FORMAT_VERSION }),
        };
        if manifest.format >= 3 {
            let expected = manifest.content_checksum()?;
            match &manifest.checksum {
                Some(recorded) if *recorded == expected => {}
                Some(recorded) => {
                    return Err(Error::Checkpoint {
                        path: shown,
                        detail: format!("the manifest was changed after it was written (its contents hash to {expected}, it records {recorded}): a different step, data cursor or optimizer state would resume another run; restore the file, or fall back to the previous checkpoint"),
                    })
                }
                None => return Err(Error::Checkpoint { path: shown, detail: "the manifest's checksum is missing, so an edit to it cannot be ruled out; restore the file, or fall back to the previous checkpoint".into() }),
            }
        }
        Ok(manifest)
    }

    /// The manifest as written to `manifest.json`: pretty JSON carrying the
    /// checksum of its contents.
    pub fn to_json(&self) -> Result<Vec<u8>> {
        let sealed = Manifest { checksum: Some(self.content_checksum()?), ..self.clone() };
        serde_json::to_vec_pretty(&sealed).map_err(|e| Error::unsupported("manifest", format!("cannot encode the manifest: {e}")))
    }

    /// The checksum of the manifest's contents (compact JSON, checksum left out).
    fn content_checksum(&self) -> Result<String> {
        let bare = Manifest { checksum: None, ..self.clone() };
        let bytes = serde_json::to_vec(&bare).map_err(|e| Error::unsupported("manifest", format!("cannot encode the manifest: {e}")))?;
        Ok(super::io::checksum(&bytes))
    }

    /// The parameter reached by `name` (its own name or an alias).
    pub fn param(&self, name: &str) -> Option<&ParamRecord> {
        self.params.iter().find(|p| p.is_named(name))
    }

    /// The stored pieces of parameter `param`'s tensor of `kind`.
    pub fn pieces<'a>(&'a self, param: &'a str, kind: TensorKind) -> impl Iterator<Item = &'a TensorRecord> + 'a {
        self.tensors.iter().filter(move |r| r.param == param && r.kind == kind)
    }

    /// The kinds of tensor every parameter has: its values; with an
    /// optimizer, its moments; in a Local SGD run's checkpoint, its outer
    /// momentum.
    pub fn kinds(&self) -> Vec<TensorKind> {
        let mut kinds = if self.optimizer.is_some() { TensorKind::ALL.to_vec() } else { vec![TensorKind::Param] };
        if self.tensors.iter().any(|r| r.kind == TensorKind::OuterMomentum) {
            kinds.push(TensorKind::OuterMomentum);
        }
        kinds
    }

    /// The record of tensor `name` in rank file `file`.
    pub fn record(&self, name: &str, file: &str) -> Option<&TensorRecord> {
        self.tensors.iter().find(|r| r.name == name && r.file == file)
    }

    /// Every rank file, once, in the order the manifest lists them.
    pub fn files(&self) -> Vec<&str> {
        let mut files: Vec<&str> = Vec::new();
        for r in &self.tensors {
            if !files.contains(&r.file.as_str()) {
                files.push(&r.file);
            }
        }
        files
    }

    /// Bytes of tensor data stored (headers not counted).
    pub fn tensor_bytes(&self) -> usize {
        self.tensors.iter().map(TensorRecord::byte_len).sum()
    }
}

/// A manifest's records looked up by name: each parameter by every name it
/// is reached by, the pieces by parameter and kind (a large model has
/// thousands of parameters and many pieces of each).
pub(crate) struct Index<'a> {
    params: HashMap<&'a str, &'a ParamRecord>,
    /// Per parameter, its pieces of each kind (in [`TensorKind::EVERY`] order).
    pieces: HashMap<&'a str, [Vec<&'a TensorRecord>; 4]>,
}

impl<'a> Index<'a> {
    pub fn new(m: &'a Manifest) -> Self {
        let mut params = HashMap::new();
        for p in &m.params {
            for name in std::iter::once(&p.name).chain(&p.aliases) {
                params.entry(name.as_str()).or_insert(p);
            }
        }
        let mut pieces: HashMap<&str, [Vec<&TensorRecord>; 4]> = HashMap::new();
        for r in &m.tensors {
            pieces.entry(r.param.as_str()).or_default()[r.kind as usize].push(r);
        }
        Index { params, pieces }
    }

    /// The parameter reached by `name`.
    pub fn param(&self, name: &str) -> Option<&'a ParamRecord> {
        self.params.get(name).copied()
    }

    /// The stored pieces of parameter `param`'s tensor of `kind`.
    pub fn pieces(&self, param: &str, kind: TensorKind) -> &[&'a TensorRecord] {
        self.pieces.get(param).map_or(&[], |p| p[kind as usize].as_slice())
    }
}
