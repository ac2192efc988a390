//! Checkpoints: atomic, checksummed, restorable bit for bit.
//!
//! A checkpoint is a directory per step, `<root>/step-<N>/`, holding
//!
//! - `manifest.json` ([`Manifest`]): the format version, the step, the mesh,
//!   and for every stored tensor its name, global shape, dtype, shard, the
//!   rank file holding it and a checksum; the optimizer's hyper-parameters;
//!   and a free-form `extra` value for the trainer (data cursor, loss scaler,
//!   RNG state);
//! - `rank-<r>.safetensors`, one per tensor-parallel rank, with that rank's
//!   shards: each parameter once (a tied weight once, under its first name)
//!   and, when an optimizer is saved, its AdamW moments as `<name>.adam_m`
//!   and `<name>.adam_v`. Replicated parameters are in `rank-0` only;
//!   data-parallel replicas write nothing (they hold the same values).
//!
//! A save is atomic: everything is written into `step-<N>.tmp-<pid>`,
//! flushed to disk, renamed to `step-<N>`, and only then is the `latest`
//! pointer file replaced (itself through a temporary file and a rename). A
//! crash at any point leaves either the previous checkpoints untouched or
//! the new one complete; leftover `.tmp-*` directories are never read.
//! After a successful save only the newest `keep` checkpoints remain.
//!
//! A load verifies the checksum of every tensor it reads and changes
//! nothing in the model or optimizer unless everything read is intact and
//! fits. [`Checkpointer::load_latest_valid`] falls back from a damaged or
//! incomplete checkpoint to the newest intact one and reports each one it
//! skipped and why.
//!
//! Restoring onto a different mesh (resharding) is not done here yet; the
//! manifest records global shapes and shard layouts so that it can be.

mod io;
mod manifest;

/// The JSON library of the manifest's free-form `extra` value, re-exported
/// so callers build that value without depending on it themselves.
pub use serde_json;

pub use manifest::{Manifest, MeshInfo, OptimizerInfo, ShardInfo, TensorKind, TensorRecord, FORMAT_VERSION};

use crate::error::{Error, Result};
use crate::module::{self, Cx, Module, Param, Shard};
use crate::optim::AdamW;
use crate::tensor::Tensor;
use io::{checksum, io_err};
use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

/// The name of the pointer file naming the newest complete checkpoint.
pub const LATEST: &str = "latest";
/// The name of the manifest inside a checkpoint directory.
pub const MANIFEST: &str = "manifest.json";

/// Writes and reads the checkpoints under one root directory.
///
/// ```no_run
/// # use tessera::prelude::*;
/// # use tessera::ckpt::Checkpointer;
/// # fn demo<M: Module>(model: &M, opt: &mut tessera::optim::AdamW, cx: &Cx) -> tessera::Result<()> {
/// let ckpt = Checkpointer::new("checkpoints", 3)?;
/// ckpt.save(100, model, Some(&*opt), cx, tessera::ckpt::serde_json::json!({ "cursor": 6400 }))?;
/// // ... later, in a fresh process, with the model and optimizer built again:
/// if let Some(restored) = ckpt.load_latest_valid(model, Some(opt), cx)? {
///     println!("resuming after step {}", restored.manifest.step);
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Checkpointer {
    root: PathBuf,
    keep: usize,
}

/// A checkpoint passed over while looking for the newest intact one.
#[derive(Debug)]
pub struct Skipped {
    /// Its directory.
    pub dir: PathBuf,
    /// Why it cannot be loaded.
    pub reason: Error,
}

/// The outcome of [`Checkpointer::scan`]: the newest intact checkpoint, and
/// the newer ones that were skipped.
#[derive(Debug, Default)]
pub struct Scan {
    /// The newest checkpoint whose every checksum verifies.
    pub valid: Option<PathBuf>,
    /// Newer checkpoints that are damaged or incomplete, newest first.
    pub skipped: Vec<Skipped>,
}

/// What [`Checkpointer::load_latest_valid`] restored.
#[derive(Debug)]
pub struct Restored {
    /// The checkpoint directory loaded.
    pub dir: PathBuf,
    /// Its manifest (the step, and the trainer's `extra` state).
    pub manifest: Manifest,
    /// Newer checkpoints that were skipped, and why.
    pub skipped: Vec<Skipped>,
}

/// Every distinct parameter of a model: its first name, handle and other names.
fn distinct_params<M: Module>(model: &M) -> Result<Vec<(String, Param, Vec<String>)>> {
    Ok(module::distinct_params(model)?
        .into_iter()
        .map(|mut n| {
            let first = n.names.remove(0);
            (first, n.param, n.names)
        })
        .collect())
}

fn rank_file(tp_rank: usize) -> String {
    format!("rank-{tp_rank}.safetensors")
}

/// Returns once every rank of the mesh has called it.
fn barrier_all(cx: &Cx) -> Result<()> {
    let g = cx.groups();
    g.tp.barrier()?;
    g.dp.barrier()
}

/// Rank 0's `flag`, on every rank of the mesh.
fn broadcast_flag(cx: &Cx, flag: u32) -> Result<u32> {
    let g = cx.groups();
    let t = Tensor::from_vec(vec![flag], [1], cx.device())?;
    let t = g.tp.broadcast(&t, 0)?;
    let t = g.dp.broadcast(&t, 0)?;
    Ok(t.to_vec::<u32>()?[0])
}

/// The step of a complete checkpoint directory name `step-<N>`.
fn step_of(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// One tensor to write: its record and bytes.
struct Pending {
    record: TensorRecord,
    tensor: Tensor,
    bytes: Vec<u8>,
}

impl Checkpointer {
    /// Checkpoints under `root` (created if missing), keeping the newest `keep` (at least 1).
    pub fn new(root: impl Into<PathBuf>, keep: usize) -> Result<Self> {
        let root = root.into();
        if keep == 0 {
            return Err(Error::invalid("Checkpointer::new", "keep = 0 would delete every checkpoint right after writing it; keep at least 1"));
        }
        fs::create_dir_all(&root).map_err(|e| io_err(&root, "cannot create the checkpoint root", e))?;
        Ok(Checkpointer { root, keep })
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// How many checkpoints are kept.
    pub fn keep(&self) -> usize {
        self.keep
    }

    /// The directory of the checkpoint of step `step`.
    pub fn step_dir(&self, step: u64) -> PathBuf {
        self.root.join(format!("step-{step}"))
    }

    /// Every complete checkpoint directory (not the `.tmp-*` ones), by ascending step.
    pub fn steps(&self) -> Result<Vec<(u64, PathBuf)>> {
        let entries = fs::read_dir(&self.root).map_err(|e| io_err(&self.root, "cannot list the checkpoint root", e))?;
        let mut out = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| io_err(&self.root, "cannot list the checkpoint root", e))?;
            if let Some(step) = entry.file_name().to_str().and_then(step_of) {
                if entry.path().is_dir() {
                    out.push((step, entry.path()));
                }
            }
        }
        out.sort();
        Ok(out)
    }

    /// The directory the `latest` pointer names, if there is a pointer.
    pub fn latest(&self) -> Result<Option<PathBuf>> {
        let path = self.root.join(LATEST);
        match fs::read_to_string(&path) {
            Ok(s) => {
                let name = s.trim();
                if step_of(name).is_none() {
                    return Err(Error::Checkpoint { path: path.display().to_string(), detail: format!("names `{name}`, not a checkpoint directory `step-<N>`; delete the pointer to fall back to the newest directory") });
                }
                Ok(Some(self.root.join(name)))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_err(&path, "cannot read the pointer", e)),
        }
    }

    /// Saves `model` (and `opt`'s state, and `extra`) as the checkpoint of
    /// step `step`, returning its directory.
    ///
    /// Every rank of the mesh calls it: each tensor-parallel rank of the
    /// first data-parallel replica writes its rank file; rank 0 writes the
    /// manifest once all are written, makes the checkpoint visible, moves
    /// the `latest` pointer and deletes checkpoints beyond the newest
    /// `keep`. A checkpoint of the same step is replaced.
    pub fn save<M: Module>(&self, step: u64, model: &M, opt: Option<&AdamW>, cx: &Cx, extra: serde_json::Value) -> Result<PathBuf> {
        let g = cx.groups();
        let mesh = MeshInfo { tp: g.tp.size(), dp: g.dp.size(), pp: g.pp.size(), ep: g.ep.size() };
        if mesh.pp > 1 || mesh.ep > 1 {
            return Err(Error::Checkpoint {
                path: self.root.display().to_string(),
                detail: format!("cannot checkpoint a mesh with pipeline degree {} and expert degree {}: only tensor and data parallelism are supported so far", mesh.pp, mesh.ep),
            });
        }
        let tp_rank = g.tp.rank();
        let writer = g.dp.rank() == 0;
        let is_root = writer && tp_rank == 0;
        // Every rank writes into rank 0's temporary directory.
        let pid = g.tp.broadcast(&Tensor::from_vec(vec![std::process::id()], [1], cx.device())?, 0)?.to_vec::<u32>()?[0];
        let tmp = self.root.join(format!("step-{step}.tmp-{pid}"));
        let prepared = if is_root { self.prepare_tmp(&tmp) } else { Ok(()) };
        barrier_all(cx)?;
        let written = match (&prepared, writer) {
            (Ok(()), true) => self.write_rank(&tmp, tp_rank, model, opt),
            _ => Ok(()),
        };
        barrier_all(cx)?;
        let finished = if is_root {
            prepared.and_then(|()| written.as_ref().map(|_| ()).map_err(|e| Error::Checkpoint { path: tmp.display().to_string(), detail: e.to_string() })).and_then(|()| self.finish(&tmp, step, mesh, opt, extra))
        } else {
            Ok(())
        };
        let ok = broadcast_flag(cx, u32::from(finished.is_ok()))?;
        written?;
        finished?;
        if ok == 0 {
            return Err(Error::Checkpoint { path: self.step_dir(step).display().to_string(), detail: "rank 0 could not complete the checkpoint; its own error says why".into() });
        }
        Ok(self.step_dir(step))
    }

    fn prepare_tmp(&self, tmp: &Path) -> Result<()> {
        if tmp.exists() {
            fs::remove_dir_all(tmp).map_err(|e| io_err(tmp, "cannot remove a stale temporary directory", e))?;
        }
        fs::create_dir_all(tmp).map_err(|e| io_err(tmp, "cannot create the temporary checkpoint directory", e))
    }

    /// Writes this rank's file and the records of its tensors (a sidecar the root merges).
    fn write_rank<M: Module>(&self, tmp: &Path, tp_rank: usize, model: &M, opt: Option<&AdamW>) -> Result<()> {
        let file = rank_file(tp_rank);
        let states = opt.map(|o| o.moments()).unwrap_or_default();
        let mut pending: Vec<Pending> = Vec::new();
        for (name, param, aliases) in distinct_params(model)? {
            let shard = param.shard();
            if shard == Shard::Replicated && tp_rank != 0 {
                continue;
            }
            let base = TensorRecord {
                name: name.clone(),
                param: name.clone(),
                aliases,
                kind: TensorKind::Param,
                global_shape: param.global_shape().dims().to_vec(),
                local_shape: Vec::new(),
                dtype: String::new(),
                shard: shard.into(),
                file: file.clone(),
                checksum: String::new(),
                steps: None,
            };
            let mut push = |record: TensorRecord, tensor: Tensor| -> Result<()> {
                let bytes = io::tensor_bytes(&tensor)?;
                let record = TensorRecord { local_shape: tensor.dims().to_vec(), dtype: tensor.dtype().name().to_string(), checksum: checksum(&bytes), ..record };
                pending.push(Pending { record, tensor, bytes });
                Ok(())
            };
            let value = param.value().map_err(|_| Error::Checkpoint {
                path: tmp.display().to_string(),
                detail: format!("parameter `{name}` has no value on this rank (freed by a sharding engine?); save a materialised model"),
            })?;
            push(base.clone(), value)?;
            if let Some(s) = states.iter().find(|s| s.param.same(&param)) {
                push(TensorRecord { name: format!("{name}.adam_m"), kind: TensorKind::AdamM, steps: Some(s.steps), ..base.clone() }, s.m.clone())?;
                push(TensorRecord { name: format!("{name}.adam_v"), kind: TensorKind::AdamV, steps: Some(s.steps), ..base }, s.v.clone())?;
            }
        }
        let views = pending
            .iter()
            .map(|p| {
                let view = safetensors::tensor::TensorView::new(io::st_dtype(p.tensor.dtype()), p.record.local_shape.clone(), &p.bytes)
                    .map_err(|e| Error::Checkpoint { path: file.clone(), detail: format!("tensor `{}`: {e}", p.record.name) })?;
                Ok((p.record.name.clone(), view))
            })
            .collect::<Result<Vec<_>>>()?;
        let path = tmp.join(&file);
        let bytes = safetensors::tensor::serialize(views, None).map_err(|e| io_err(&path, "cannot serialise the tensors", e))?;
        io::write_synced(&path, &bytes)?;
        let records: Vec<&TensorRecord> = pending.iter().map(|p| &p.record).collect();
        let sidecar = tmp.join(format!("rank-{tp_rank}.records.json"));
        let json = serde_json::to_vec(&records).map_err(|e| io_err(&sidecar, "cannot encode the tensor records", e))?;
        io::write_synced(&sidecar, &json)
    }

    /// Rank 0, once every rank file is written: the manifest, the rename,
    /// the `latest` pointer, and pruning.
    fn finish(&self, tmp: &Path, step: u64, mesh: MeshInfo, opt: Option<&AdamW>, extra: serde_json::Value) -> Result<()> {
        let mut tensors = Vec::new();
        for r in 0..mesh.tp {
            let sidecar = tmp.join(format!("rank-{r}.records.json"));
            let bytes = io::read(&sidecar).map_err(|_| Error::Checkpoint {
                path: tmp.join(rank_file(r)).display().to_string(),
                detail: format!("tensor-parallel rank {r} did not write its file; its own error says why"),
            })?;
            let records: Vec<TensorRecord> = serde_json::from_slice(&bytes).map_err(|e| io_err(&sidecar, "malformed tensor records", e))?;
            tensors.extend(records);
            fs::remove_file(&sidecar).map_err(|e| io_err(&sidecar, "cannot remove", e))?;
        }
        let optimizer = opt.map(|o| {
            let c = o.config();
            OptimizerInfo { kind: "adamw".into(), beta1: c.beta1, beta2: c.beta2, eps: c.eps, weight_decay: c.weight_decay }
        });
        let manifest = Manifest { format: FORMAT_VERSION, step, mesh, tensors, optimizer, extra };
        let path = tmp.join(MANIFEST);
        let json = serde_json::to_vec_pretty(&manifest).map_err(|e| io_err(&path, "cannot encode the manifest", e))?;
        io::write_synced(&path, &json)?;
        io::sync_dir(tmp)?;
        let dir = self.step_dir(step);
        let old = self.root.join(format!("step-{step}.old-{}", std::process::id()));
        let replacing = dir.exists();
        if replacing {
            fs::rename(&dir, &old).map_err(|e| io_err(&dir, "cannot move the previous checkpoint of this step aside", e))?;
        }
        fs::rename(tmp, &dir).map_err(|e| io_err(&dir, "cannot rename the temporary directory into place", e))?;
        io::sync_dir(&self.root)?;
        io::replace_file(&self.root.join(LATEST), format!("step-{step}\n").as_bytes())?;
        if replacing {
            fs::remove_dir_all(&old).map_err(|e| io_err(&old, "cannot remove the replaced checkpoint", e))?;
        }
        self.prune(step)
    }

    /// Deletes the oldest checkpoints beyond `keep`, never the one just written.
    fn prune(&self, written: u64) -> Result<()> {
        let others: Vec<(u64, PathBuf)> = self.steps()?.into_iter().filter(|(s, _)| *s != written).collect();
        let excess = (others.len() + 1).saturating_sub(self.keep);
        for (_, dir) in others.into_iter().take(excess) {
            fs::remove_dir_all(&dir).map_err(|e| io_err(&dir, "cannot delete an old checkpoint", e))?;
        }
        Ok(())
    }

    /// Reads the manifest of the checkpoint in `dir`.
    pub fn manifest(&self, dir: &Path) -> Result<Manifest> {
        let path = dir.join(MANIFEST);
        let bytes = io::read(&path)?;
        let m: Manifest = serde_json::from_slice(&bytes).map_err(|e| io_err(&path, "malformed manifest", e))?;
        if m.format != FORMAT_VERSION {
            return Err(Error::Checkpoint { path: path.display().to_string(), detail: format!("format version {}, this build reads version {FORMAT_VERSION}; load it with a matching build", m.format) });
        }
        Ok(m)
    }

    /// Verifies every tensor of the checkpoint in `dir` against its checksum.
    pub fn verify(&self, dir: &Path) -> Result<Manifest> {
        let manifest = self.manifest(dir)?;
        let mut files = Files::new(dir);
        let host = crate::Device::cpu();
        for r in &manifest.tensors {
            files.read(r, &host)?;
        }
        Ok(manifest)
    }

    /// Finds the newest intact checkpoint: the one `latest` names, else the
    /// newest directory; each damaged or incomplete one is skipped and reported.
    pub fn scan(&self) -> Result<Scan> {
        let mut candidates: Vec<PathBuf> = Vec::new();
        let mut scan = Scan::default();
        match self.latest() {
            Ok(Some(dir)) => candidates.push(dir),
            Ok(None) => {}
            Err(e) => scan.skipped.push(Skipped { dir: self.root.join(LATEST), reason: e }),
        }
        for (_, dir) in self.steps()?.into_iter().rev() {
            if !candidates.contains(&dir) {
                candidates.push(dir);
            }
        }
        for dir in candidates {
            if !dir.is_dir() {
                let reason = Error::Checkpoint { path: dir.display().to_string(), detail: "the `latest` pointer names it, but it does not exist".into() };
                scan.skipped.push(Skipped { dir, reason });
                continue;
            }
            match self.verify(&dir) {
                Ok(_) => {
                    scan.valid = Some(dir);
                    break;
                }
                Err(reason) => scan.skipped.push(Skipped { dir, reason }),
            }
        }
        Ok(scan)
    }

    /// The newest intact checkpoint's directory, if any (see [`scan`](Self::scan)).
    pub fn latest_valid(&self) -> Result<Option<PathBuf>> {
        Ok(self.scan()?.valid)
    }

    /// Loads the newest intact checkpoint into `model` (and `opt`); `None`
    /// when there is none. Reports the newer checkpoints it skipped.
    pub fn load_latest_valid<M: Module>(&self, model: &M, opt: Option<&mut AdamW>, cx: &Cx) -> Result<Option<Restored>> {
        let scan = self.scan()?;
        let Some(dir) = scan.valid else { return Ok(None) };
        let manifest = self.load(&dir, model, opt, cx)?;
        Ok(Some(Restored { dir, manifest, skipped: scan.skipped }))
    }

    /// Loads the checkpoint in `dir` into this rank's shards of `model`
    /// (and `opt`'s moments and step counts), returning its manifest.
    ///
    /// Every tensor read is verified against its checksum, every parameter
    /// against the model's names and global shapes, before anything is
    /// changed: on an error the model and optimizer are as they were.
    pub fn load<M: Module>(&self, dir: &Path, model: &M, opt: Option<&mut AdamW>, cx: &Cx) -> Result<Manifest> {
        let manifest = self.manifest(dir)?;
        let here = dir.display().to_string();
        let mismatch = |detail: String| Error::CheckpointMismatch { path: here.clone(), detail };
        let tp = cx.tp().size();
        if manifest.mesh.tp != tp {
            return Err(mismatch(format!(
                "it was written with tensor-parallel degree {}, this run has {tp}; restore it on the same tensor-parallel degree (resharding is not supported yet)",
                manifest.mesh.tp
            )));
        }
        let params = distinct_params(model)?;
        // Parameters the checkpoint holds that the model lacks: a different model.
        for r in manifest.params() {
            let known = params.iter().any(|(n, _, a)| *n == r.param || a.contains(&r.param));
            if !known {
                return Err(mismatch(format!("it holds parameter `{}` (global shape {:?}), which the model lacks; load it into the model it was saved from", r.param, r.global_shape)));
            }
        }
        let device = cx.device().clone();
        let mut files = Files::new(dir);
        let find = |name: &str, aliases: &[String], kind: TensorKind, shard: ShardInfo| {
            manifest.tensors.iter().find(|r| r.kind == kind && r.shard == shard && (r.param == name || aliases.contains(&r.param)))
        };
        let mut values: Vec<(Param, Tensor)> = Vec::new();
        for (name, param, aliases) in &params {
            let model_shape = param.global_shape().dims().to_vec();
            let any = manifest.params().find(|r| r.param == *name || aliases.contains(&r.param));
            let Some(any) = any else {
                return Err(mismatch(format!("the model's parameter `{name}` (global shape {model_shape:?}) is not in it; load a checkpoint of this model")));
            };
            if any.global_shape != model_shape {
                return Err(mismatch(format!("parameter `{name}` has global shape {:?} in the checkpoint but {model_shape:?} in the model; load it into the model it was saved from", any.global_shape)));
            }
            let shard = ShardInfo::from(param.shard());
            let Some(r) = find(name, aliases, TensorKind::Param, shard) else {
                return Err(mismatch(format!("parameter `{name}` is stored as {:?}, this rank holds {shard:?}; restore it on the mesh it was saved from", any.shard)));
            };
            let t = files.read(r, &device)?;
            let current = param.value().map(|v| v.dtype()).unwrap_or(t.dtype());
            let t = if t.dtype() == current { t } else { t.to_dtype(current)? };
            values.push((param.clone(), t));
        }
        let mut moments: Vec<(Param, Tensor, Tensor, u64)> = Vec::new();
        if let Some(opt) = &opt {
            if manifest.optimizer.is_none() {
                return Err(mismatch("it holds no optimizer state; load it without an optimizer, or save one with its optimizer".into()));
            }
            for s in opt.moments() {
                let aliases = params.iter().find(|(_, p, _)| p.same(s.param)).map(|(_, _, a)| a.clone()).unwrap_or_default();
                let shard = ShardInfo::from(s.param.shard());
                let (Some(m), Some(v)) = (find(s.name, &aliases, TensorKind::AdamM, shard), find(s.name, &aliases, TensorKind::AdamV, shard)) else {
                    return Err(mismatch(format!("it holds no AdamW moments for parameter `{}`; it was saved from a different optimizer or model", s.name)));
                };
                let steps = m.steps.unwrap_or(0);
                moments.push((s.param.clone(), files.read(m, &device)?, files.read(v, &device)?, steps));
            }
        }
        for (p, t) in values {
            p.set_value(t)?;
        }
        if let Some(opt) = opt {
            for (p, m, v, steps) in moments {
                opt.load_state(&p, m, v, steps)?;
            }
        }
        Ok(manifest)
    }
}

/// The rank files of one checkpoint, each read once.
struct Files {
    dir: PathBuf,
    cache: HashMap<String, Vec<u8>>,
}

impl Files {
    fn new(dir: &Path) -> Self {
        Files { dir: dir.to_path_buf(), cache: HashMap::new() }
    }

    /// The tensor `r` describes, verified against its record.
    fn read(&mut self, r: &TensorRecord, device: &crate::Device) -> Result<Tensor> {
        let path = self.dir.join(&r.file);
        if !self.cache.contains_key(&r.file) {
            let bytes = io::read(&path)?;
            self.cache.insert(r.file.clone(), bytes);
        }
        let bytes = &self.cache[&r.file];
        let file = path.display().to_string();
        let corrupt = |detail: String| Error::CheckpointCorrupt { file: file.clone(), tensor: r.name.clone(), detail };
        let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| corrupt(format!("the file's header is unreadable: {e}")))?;
        let view = st.tensor(&r.name).map_err(|e| corrupt(format!("not found in the file: {e}")))?;
        let dtype = io::dtype_named(&r.dtype).ok_or_else(|| corrupt(format!("the manifest names an unknown dtype `{}`", r.dtype)))?;
        if view.shape() != r.local_shape.as_slice() || view.dtype() != io::st_dtype(dtype) {
            return Err(corrupt(format!("stored as {:?} {:?}, the manifest says {} {:?}", view.dtype(), view.shape(), r.dtype, r.local_shape)));
        }
        let sum = checksum(view.data());
        if sum != r.checksum {
            return Err(corrupt(format!("checksum {sum}, the manifest recorded {}", r.checksum)));
        }
        io::tensor_from_bytes(view.data(), dtype, &r.local_shape, device)
    }
}

/// Loads the newest intact checkpoint under `root` (see
/// [`Checkpointer::load_latest_valid`]).
pub fn load_latest_valid<M: Module>(root: impl Into<PathBuf>, model: &M, opt: Option<&mut AdamW>, cx: &Cx) -> Result<Option<Restored>> {
    Checkpointer::new(root, usize::MAX)?.load_latest_valid(model, opt, cx)
}
