//! Checkpoints: atomic, checksummed, written from any mesh and restorable
//! on any other.
//!
//! A checkpoint is a directory per step, `<root>/step-<N>/`, holding
//!
//! - `manifest.json` ([`Manifest`], format [`FORMAT_VERSION`]): the step;
//!   the mesh it was written from; every parameter of the model with its
//!   global shape, dtype, the dimension tensor parallelism splits, the
//!   pipeline parts that use it and, for an expert's weight, which expert
//!   ([`ParamRecord`]); every stored piece with its place in the global
//!   tensor ([`Region`]), its rank file and its checksum ([`TensorRecord`]);
//!   the optimizer's hyper-parameters; and a free-form `extra` value for
//!   the trainer (data cursor, loss scaler, RNG state);
//! - one safetensors file per writing rank, named by the coordinates that
//!   tell its pieces apart: `pp<p>[-dp<d>][-ep<e>]-tp<t>.safetensors`, with
//!   `dp` only when ZeRO shards the state over more than one replica and
//!   `ep` only when experts are split. A parameter is stored once (a tied
//!   weight under its first name), and when an optimizer is saved, its
//!   AdamW moments as `<name>.adam_m` and `<name>.adam_v`.
//!
//! # Who writes what
//!
//! Of the ranks holding identical copies of a piece, one writes it: the
//! lowest pipeline stage holding the parameter, the expert-parallel rank
//! holding an expert (rank 0 for everything else), each tensor-parallel
//! rank its slice (rank 0 a parameter it holds whole), and data-parallel
//! replica 0 — except under ZeRO, where every replica writes its own shard
//! of the flattened parameters and moments, recorded as a run of elements
//! of the tensor-parallel slice. Under pipeline parallelism the context
//! must declare its layout ([`Cx::with_pipeline_chunks`]), which is also
//! what gives each stage only its own parameters.
//!
//! Each rank writes its rank file and a part file listing its pieces; rank
//! 0 merges the part files into the manifest (no collective carries the
//! records, so a save works the same in the foreground and in the
//! background), checks that the pieces of every tensor cover it exactly
//! once, and makes the checkpoint visible.
//!
//! # Atomic, checksummed, pruned
//!
//! Everything is written into `step-<N>.tmp-<pid>`, flushed to disk,
//! renamed to `step-<N>`, and only then is the `latest` pointer file
//! replaced (itself through a temporary file and a rename). A crash at any
//! point leaves either the previous checkpoints untouched or the new one
//! complete; leftover `.tmp-*` directories are never read. After a
//! successful save only the newest `keep` checkpoints remain.
//!
//! [`Checkpointer::save_in_background`] copies the tensors and returns;
//! a thread of each rank writes and flushes its files, and rank 0's thread
//! renames once every rank's part is there. The next save on that rank,
//! and dropping the last [`Checkpointer`] handle, wait for it.
//!
//! # Loading and resharding
//!
//! A load works on any mesh: every local parameter shard and optimizer
//! slot knows the region of the global tensor it holds (its tensor-parallel
//! slice, and under ZeRO a run of that slice's elements), and is assembled
//! from exactly the stored pieces that overlap it, by global offsets,
//! whatever mesh, pipeline stages, expert split or ZeRO stage wrote them.
//! So a checkpoint saved at dp2×tp2×pp2 loads at tp4, or on one rank, or
//! into a ZeRO engine, and training continues where it stopped (up to the
//! summation-order differences a different mesh brings). [`reshard`]
//! rewrites a checkpoint for another mesh offline, with no model code.
//!
//! Every piece read is verified against its checksum, and every parameter
//! against the model's names and global shapes, before anything changes;
//! the ranks agree that all of them succeeded, so on an error no rank's
//! model or optimizer changes. [`Checkpointer::load_latest_valid`] falls
//! back from a damaged or incomplete checkpoint to the newest intact one
//! and reports each one it skipped and why. [`verify`] checks a checkpoint
//! by hashing the stored bytes as they lie in the files, without decoding
//! them. A manifest of another format version is refused with
//! [`Error::CheckpointFormat`].
//!
//! The repository's `docs/checkpoints.md` describes the format in full.

mod check;
mod collect;
mod collective;
mod damaged;
mod faults;
mod io;
mod leftovers;
mod manifest;
pub(crate) mod place;
mod region;
mod reshard;
mod restore;
mod save;

/// The JSON library of the manifest's free-form `extra` value, re-exported
/// so callers build that value without depending on it themselves.
pub use serde_json;

pub use check::verify;
pub use manifest::{Manifest, MeshInfo, ParamRecord, TensorRecord, FORMAT_VERSION};
pub use region::Region;
pub use reshard::reshard;
pub use save::SaveHandle;
pub use tessera_optim::{OptimizerInfo, OptimizerState, StatePiece, StateSlot, TensorKind};

pub use damaged::REASON_FILE;
use io::io_err;
use parking_lot::Mutex;
use save::Background;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tessera_core::{Error, Result};
use tessera_nn::module::{Cx, Module};

/// The name of the pointer file naming the newest complete checkpoint.
pub const LATEST: &str = "latest";
/// The name of the manifest inside a checkpoint directory.
pub const MANIFEST: &str = "manifest.json";

/// Reads the manifest of the checkpoint in `dir` (refusing other format versions).
pub fn read_manifest(dir: &Path) -> Result<Manifest> {
    let path = dir.join(MANIFEST);
    Manifest::from_json(&io::read(&path)?, &path)
}

/// The directory layout under a checkpoint root.
#[derive(Clone, Debug)]
pub(crate) struct Root {
    path: PathBuf,
    keep: usize,
    /// How long rank 0 waits for the other ranks' parts.
    timeout: Duration,
    /// Writes set to fail on purpose.
    faults: faults::WriteFaults,
}

impl Root {
    fn step_dir(&self, step: u64) -> PathBuf {
        self.path.join(format!("step-{step}"))
    }

    fn steps(&self) -> Result<Vec<(u64, PathBuf)>> {
        let entries = fs::read_dir(&self.path).map_err(|e| io_err(&self.path, "cannot list the checkpoint root", e))?;
        let mut out = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| io_err(&self.path, "cannot list the checkpoint root", e))?;
            if let Some(step) = entry.file_name().to_str().and_then(step_of) {
                if entry.path().is_dir() {
                    out.push((step, entry.path()));
                }
            }
        }
        out.sort();
        Ok(out)
    }
}

/// Writes and reads the checkpoints under one root directory.
///
/// ```no_run
/// # use tessera::prelude::*;
/// # use tessera::ckpt::Checkpointer;
/// # fn demo<M: Module>(model: &M, opt: &mut tessera::optim::AdamW, cx: &Cx) -> tessera::Result<()> {
/// let ckpt = Checkpointer::new("checkpoints", 3)?;
/// ckpt.save(100, model, Some(&*opt), cx, tessera::ckpt::serde_json::json!({ "cursor": 6400 }))?;
/// // ... later, in a fresh process, on any mesh, with the model and optimizer built again:
/// if let Some(restored) = ckpt.load_latest_valid(model, Some(opt), cx)? {
///     println!("resuming after step {}", restored.manifest.step);
/// }
/// # Ok(()) }
/// ```
///
/// Clones share this rank's background save: the next save through any of
/// them waits for it, and dropping the last one waits for it too.
#[derive(Clone)]
pub struct Checkpointer {
    root: Root,
    pending: Arc<Mutex<Option<Arc<Background>>>>,
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

/// The step of a complete checkpoint directory name `step-<N>`.
fn step_of(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

impl Checkpointer {
    /// Checkpoints under `root` (created if missing), keeping the newest `keep` (at least 1).
    pub fn new(root: impl Into<PathBuf>, keep: usize) -> Result<Self> {
        let root = root.into();
        if keep == 0 {
            return Err(Error::invalid("Checkpointer::new", "keep = 0 would delete every checkpoint right after writing it; keep at least 1"));
        }
        fs::create_dir_all(&root).map_err(|e| io_err(&root, "cannot create the checkpoint root", e))?;
        Ok(Checkpointer { root: Root { path: root, keep, timeout: Duration::from_secs(600), faults: faults::WriteFaults::default() }, pending: Arc::default() })
    }

    /// The checkpoints under an existing `root`, to read (nothing is created:
    /// a missing root is an error naming it).
    pub fn open(root: impl Into<PathBuf>, keep: usize) -> Result<Self> {
        let root = root.into();
        if !root.is_dir() {
            return Err(Error::Checkpoint {
                path: root.display().to_string(),
                detail: "no such checkpoint directory; check the path (a run keeps its checkpoints in `<run.out>/checkpoints`)".into(),
            });
        }
        Self::new(root, keep)
    }

    /// How long rank 0 waits for the other ranks to write their parts of a
    /// save (10 minutes unless set) before giving the save up.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.root.timeout = timeout;
        self
    }

    /// Makes the first write at or after `from_step` by the rank at
    /// `coords` fail as on a full disk (fault injection).
    pub(crate) fn inject_write_error(&self, coords: place::Coords, from_step: u64) {
        self.root.faults.arm_error(coords, from_step);
    }

    /// Kills the process during the first write at or after `from_step` by
    /// the rank at `coords` (fault injection).
    pub(crate) fn inject_kill_in_write(&self, coords: place::Coords, from_step: u64) {
        self.root.faults.arm_kill(coords, from_step);
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root.path
    }

    /// How many checkpoints are kept.
    pub fn keep(&self) -> usize {
        self.root.keep
    }

    /// The directory of the checkpoint of step `step`.
    pub fn step_dir(&self, step: u64) -> PathBuf {
        self.root.step_dir(step)
    }

    /// Every complete checkpoint directory (not the `.tmp-*` ones), by ascending step.
    pub fn steps(&self) -> Result<Vec<(u64, PathBuf)>> {
        self.root.steps()
    }

    /// The directory the `latest` pointer names, if there is a pointer.
    pub fn latest(&self) -> Result<Option<PathBuf>> {
        let path = self.root.path.join(LATEST);
        match fs::read_to_string(&path) {
            Ok(s) => {
                let name = s.trim();
                if step_of(name).is_none() {
                    return Err(Error::Checkpoint {
                        path: path.display().to_string(),
                        detail: format!("names `{name}`, not a checkpoint directory `step-<N>`; delete the pointer to fall back to the newest directory"),
                    });
                }
                Ok(Some(self.root.path.join(name)))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_err(&path, "cannot read the pointer", e)),
        }
    }

    /// Saves `model` (and `opt`'s state, and `extra`) as the checkpoint of
    /// step `step`, returning its directory.
    ///
    /// Every rank of the mesh calls it. Each writes the pieces it owns (see
    /// the [module documentation](self)); rank 0 writes the manifest once
    /// all are written, makes the checkpoint visible, moves the `latest`
    /// pointer and deletes checkpoints beyond the newest `keep`. A
    /// checkpoint of the same step is replaced. Pass `opt` as `Some(&adamw)`
    /// or, under ZeRO, `Some(&engine)` (the engine then supplies the
    /// parameters too). Every rank returns an error if any rank failed,
    /// the first failing rank's cause in it.
    pub fn save<M: Module>(&self, step: u64, model: &M, opt: Option<&dyn OptimizerState>, cx: &Cx, extra: serde_json::Value) -> Result<PathBuf> {
        let job = self.begin(step, model, opt, cx, extra, false)?;
        job.run_collectively(cx)
    }

    /// As [`save`](Self::save), but the checkpoint is a *resume point*: one
    /// a job that stops early writes so that the next job continues from
    /// there. It is never a rollback target
    /// ([`load_latest_valid_regular`](Self::load_latest_valid_regular)),
    /// does not count against `keep`, and is pruned once a newer
    /// checkpoint is written: so a run stopped and resumed anywhere rolls
    /// back to the same checkpoints, and keeps the same ones, as a run that
    /// never stopped.
    pub fn save_resume_point<M: Module>(&self, step: u64, model: &M, opt: Option<&dyn OptimizerState>, cx: &Cx, extra: serde_json::Value) -> Result<PathBuf> {
        let job = self.begin(step, model, opt, cx, extra, true)?;
        job.run_collectively(cx)
    }

    /// As [`save`](Self::save), but returns as soon as this rank's tensors
    /// are copied: a background thread writes and flushes them, and on rank
    /// 0 renames the checkpoint into place once every rank has written. The
    /// model and optimizer may go on training meanwhile.
    ///
    /// The next save (in the foreground or not) waits for this one first
    /// and fails, on every rank, if it failed unseen; so does dropping the
    /// last handle of this `Checkpointer`. Rank 0's [`SaveHandle`] says
    /// whether the checkpoint as a whole was made; the others' say whether
    /// their own part was written.
    pub fn save_in_background<M: Module>(
        &self,
        step: u64,
        model: &M,
        opt: Option<&dyn OptimizerState>,
        cx: &Cx,
        extra: serde_json::Value,
    ) -> Result<SaveHandle> {
        let job = self.begin(step, model, opt, cx, extra, false)?;
        let (handle, shared) = SaveHandle::spawn(job)?;
        *self.pending.lock() = Some(shared);
        Ok(handle)
    }

    /// Waits for this rank's background save, if one is running; returns
    /// its error if nobody has seen it yet.
    pub fn wait(&self) -> Result<()> {
        let pending = self.pending.lock().take();
        match pending {
            Some(job) => job.take_error(),
            None => Ok(()),
        }
    }

    /// Reads the manifest of the checkpoint in `dir`.
    pub fn manifest(&self, dir: &Path) -> Result<Manifest> {
        read_manifest(dir)
    }

    /// Verifies every tensor of the checkpoint in `dir` against its checksum
    /// (see [`verify`]).
    pub fn verify(&self, dir: &Path) -> Result<Manifest> {
        verify(dir)
    }

    /// Finds the newest intact checkpoint: the one `latest` names, else the
    /// newest directory; each damaged or incomplete one is skipped and reported.
    pub fn scan(&self) -> Result<Scan> {
        self.scan_for(true)
    }

    /// [`scan`](Self::scan), passing over resume points unless `resume_points`.
    fn scan_for(&self, resume_points: bool) -> Result<Scan> {
        let mut candidates: Vec<PathBuf> = Vec::new();
        let mut scan = Scan::default();
        match self.latest() {
            Ok(Some(dir)) => candidates.push(dir),
            Ok(None) => {}
            Err(e) => scan.skipped.push(Skipped { dir: self.root.path.join(LATEST), reason: e }),
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
            match verify(&dir) {
                Ok(m) if m.resume_point && !resume_points => {}
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
    /// when there is none. Reports the newer checkpoints it skipped. Every
    /// rank of the mesh calls it.
    pub fn load_latest_valid<M: Module>(&self, model: &M, opt: Option<&mut dyn OptimizerState>, cx: &Cx) -> Result<Option<Restored>> {
        self.load_newest(true, model, opt, cx)
    }

    /// As [`load_latest_valid`](Self::load_latest_valid), passing over
    /// resume points: the checkpoint a rollback returns to.
    pub fn load_latest_valid_regular<M: Module>(&self, model: &M, opt: Option<&mut dyn OptimizerState>, cx: &Cx) -> Result<Option<Restored>> {
        self.load_newest(false, model, opt, cx)
    }

    /// Whether there is an intact checkpoint that is not a resume point.
    pub fn has_regular(&self) -> Result<bool> {
        Ok(self.scan_for(false)?.valid.is_some())
    }

    /// Deletes every resume point newer than `step` (set aside if damaged):
    /// after a rollback to `step` they hold a future the run abandoned.
    /// Rank 0 calls it. Returns their directories.
    pub fn drop_resume_points_after(&self, step: u64) -> Result<Vec<PathBuf>> {
        let mut dropped = Vec::new();
        for (s, dir) in self.steps()? {
            if s > step && read_manifest(&dir).is_ok_and(|m| m.resume_point) {
                self.root.delete_or_set_aside(&dir)?;
                dropped.push(dir);
            }
        }
        if !dropped.is_empty() && self.root.step_dir(step).is_dir() {
            // `latest` named the newest of them.
            io::replace_file(&self.root.path.join(LATEST), format!("step-{step}\n").as_bytes())?;
        }
        Ok(dropped)
    }

    fn load_newest<M: Module>(&self, resume_points: bool, model: &M, opt: Option<&mut dyn OptimizerState>, cx: &Cx) -> Result<Option<Restored>> {
        // This rank's own save in flight must land first to be found (its
        // outcome stays for its handle to report).
        if let Some(job) = self.pending.lock().as_ref() {
            job.wait_done();
        }
        let scan = self.scan_for(resume_points)?;
        let Some(dir) = scan.valid else { return Ok(None) };
        let manifest = self.load(&dir, model, opt, cx)?;
        Ok(Some(Restored { dir, manifest, skipped: scan.skipped }))
    }

    /// Loads the checkpoint in `dir` into this rank's share of `model` (and
    /// `opt`'s state), whatever mesh wrote it; returns its manifest.
    ///
    /// Every rank of the mesh calls it. Each assembles its parameter shards
    /// (and optimizer slots) from the stored pieces that overlap them, every
    /// piece verified against its checksum, every parameter against the
    /// model's names and global shapes. Nothing changes on any rank unless
    /// every rank read everything it needs. Pass `opt` as `Some(&mut adamw)`
    /// or, under ZeRO, `Some(&mut engine)`: the engine holds the
    /// parameters' master copy, so it restores the parameters too (a model
    /// under ZeRO loaded without its engine would lose the values to it).
    pub fn load<M: Module>(&self, dir: &Path, model: &M, opt: Option<&mut dyn OptimizerState>, cx: &Cx) -> Result<Manifest> {
        let prepared = read_manifest(dir).and_then(|m| restore::prepare(dir, &m, model, opt.as_deref(), cx).map(|p| (m, p)));
        // Nothing changes on any rank unless every rank read its share.
        let (manifest, prepared) = collective::agree(cx, &format!("loading `{}` (nothing was changed)", dir.display()), prepared)?;
        restore::install(prepared, opt)?;
        Ok(manifest)
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        // The last handle: the end of the run waits for the write in flight.
        // Its outcome was for its `SaveHandle` to report.
        if Arc::strong_count(&self.pending) == 1 {
            let _ = self.wait();
        }
    }
}

impl std::fmt::Debug for Checkpointer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpointer").field("root", &self.root.path).field("keep", &self.root.keep).finish()
    }
}

/// Loads the newest intact checkpoint under `root` (see
/// [`Checkpointer::load_latest_valid`]).
pub fn load_latest_valid<M: Module>(root: impl Into<PathBuf>, model: &M, opt: Option<&mut dyn OptimizerState>, cx: &Cx) -> Result<Option<Restored>> {
    Checkpointer::open(root, usize::MAX)?.load_latest_valid(model, opt, cx)
}
