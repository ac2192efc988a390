//! Saving: every rank copies out its part, writes its rank file and a part
//! file listing what it wrote; rank 0 merges the part files into the
//! manifest and makes the checkpoint visible atomically. The copying is
//! done by the caller's thread; the writing, in the foreground or on a
//! background thread ([`SaveHandle`]).

use super::collect::{self, Part};
use super::faults::WriteFault;
use super::io::{self, checksum, ckpt_err, io_err};
use super::manifest::{Manifest, MeshInfo, ParamRecord, TensorRecord, FORMAT_VERSION};
use super::place::Coords;
use super::{check, collective, read_manifest, Checkpointer, Root, LATEST, MANIFEST};
use parking_lot::{Condvar, Mutex};
use serde::{Deserialize, Serialize};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tessera_core::file::sync_dir;
use tessera_core::{Error, Result};
use tessera_dist::Groups;
use tessera_nn::module::{Cx, Module};
use tessera_optim::OptimizerInfo;
use tessera_optim::OptimizerState;

/// What a rank reports to the one that writes the manifest.
#[derive(Default, Serialize, Deserialize)]
struct PartFile {
    #[serde(default)]
    params: Vec<ParamRecord>,
    #[serde(default)]
    tensors: Vec<TensorRecord>,
    /// Why the rank could not write its part.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

/// What rank 0 needs to finish a checkpoint.
struct Commit {
    step: u64,
    resume_point: bool,
    mesh: MeshInfo,
    zero_stage: Option<u8>,
    optimizer: Option<OptimizerInfo>,
    extra: serde_json::Value,
}

/// One rank's save after the copy: the bytes and where they go.
pub(crate) struct Job {
    root: Root,
    /// The rank's communicators: a background save that fails stops them,
    /// and rank 0's wait for the others' parts watches them.
    groups: Groups,
    step: u64,
    tmp: PathBuf,
    coords: Coords,
    file: String,
    part: Part,
    dir: PathBuf,
    /// Rank 0 finishes the checkpoint.
    commit: Option<Commit>,
}

impl Job {
    /// Writes this rank's files on the training thread of every rank at
    /// once: the ranks agree over their communicators that every part is
    /// written, rank 0 commits, and they agree on that too. A failure on
    /// any rank is every rank's error, with its cause, at once.
    pub fn run_collectively(self, cx: &Cx) -> Result<PathBuf> {
        let written = write_part(&self.tmp, self.coords, &self.file, self.part, self.root.faults.take(self.coords, self.step));
        let outcome = collective::agree(cx, &format!("writing the checkpoint of step {}", self.step), written).and_then(|()| match self.commit {
            Some(c) => self.root.commit(&self.tmp, c, &self.groups),
            None => Ok(self.dir.clone()),
        });
        let outcome = collective::agree(cx, &format!("committing the checkpoint of step {}", self.step), outcome);
        if outcome.is_err() && self.coords.is_root() {
            // Best effort: a leftover temporary directory is never read anyway.
            let _ = fs::remove_dir_all(&self.tmp);
        }
        outcome
    }

    /// Writes this rank's files off the training thread; rank 0 then waits
    /// for every other rank's part and commits. A failure stops every
    /// rank's communicators with its cause ([`Groups::abort`]): the ranks
    /// must not train on as if the checkpoint existed, nor wait for a part
    /// that will never come. The checkpoint's directory.
    pub fn run(self) -> Result<PathBuf> {
        let written = write_part(&self.tmp, self.coords, &self.file, self.part, self.root.faults.take(self.coords, self.step));
        let done = match self.commit {
            None => written.map(|()| self.dir),
            Some(c) => {
                let done = written.and_then(|()| self.root.commit(&self.tmp, c, &self.groups));
                if done.is_err() {
                    let _ = fs::remove_dir_all(&self.tmp);
                }
                done
            }
        };
        if let Err(e) = &done {
            // Another rank's failure already stopped the groups; the first
            // cause stays the one every rank reports.
            if !matches!(e, Error::PeerFailed { .. }) {
                self.groups.abort(&format!("writing the checkpoint of step {}: {e}", self.step));
            }
        }
        done
    }
}

/// Writes a rank's part: its rank file (if it writes any piece), then its
/// part file (the records, or the error that stopped it), the part file by
/// rename so that it appearing means the rank is done.
fn write_part(tmp: &Path, coords: Coords, file: &str, part: Part, fault: Option<WriteFault>) -> Result<()> {
    let who = format!("rank {} cannot write its part", coords.describe());
    // An injected full disk: neither file can be written.
    let fault = match fault {
        Some(WriteFault::Error(e)) => return Err(io_err(&tmp.join(file), &who, e)),
        Some(WriteFault::Kill) => true,
        None => false,
    };
    let written = (|| -> Result<Vec<TensorRecord>> {
        let mut records = Vec::with_capacity(part.pieces.len());
        let mut tensors = Vec::with_capacity(part.pieces.len());
        for p in &part.pieces {
            records.push(TensorRecord { checksum: checksum(&p.bytes), ..p.record.clone() });
            tensors.push((p.record.name.clone(), p.dtype, p.record.region.stored_shape(), p.bytes.as_slice()));
        }
        if !tensors.is_empty() {
            io::write_safetensors(&tmp.join(file), &tensors).map_err(|e| match e {
                Error::Checkpoint { path, detail } => Error::Checkpoint { path, detail: format!("{who}: {detail}") },
                other => other,
            })?;
        }
        Ok(records)
    })();
    if fault {
        crate::kill_this_process();
    }
    let report = match &written {
        Ok(records) => PartFile { params: part.params, tensors: records.clone(), error: None },
        Err(e) => PartFile { error: Some(e.to_string()), ..PartFile::default() },
    };
    let path = tmp.join(coords.part_file());
    let json = serde_json::to_vec(&report).map_err(|e| ckpt_err(&path, "cannot encode the records", e))?;
    // The rank's own failure is the cause to report, not that it could
    // not report it either.
    let reported = io::replace_file(&path, &json);
    written?;
    reported
}

/// Reads the part file at `path`, waiting for it until `deadline`, or
/// until the ranks' communicators stop (the rank that writes it failed).
fn await_part(path: &Path, deadline: Instant, groups: &Groups) -> Result<PartFile> {
    let mut pause = Duration::from_millis(1);
    loop {
        if let Some(e) = groups.failure() {
            return Err(e);
        }
        match fs::read(path) {
            Ok(bytes) => return serde_json::from_slice(&bytes).map_err(|e| ckpt_err(path, "malformed part file", e)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && Instant::now() < deadline => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(50));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(ckpt_err(path, "the rank that writes it did not finish in time", "it is stalled (a rank that fails stops the others with its cause); on a slow disk raise the timeout (`mesh.timeout_s`, `Checkpointer::with_timeout`)"))
            }
            Err(e) => return Err(io_err(path, "cannot read", e)),
        }
    }
}

impl Checkpointer {
    /// The collective start of a save: waits for this rank's previous
    /// background save, prepares the temporary directory, copies this
    /// rank's part, and agrees with every rank that all of that worked.
    pub(crate) fn begin<M: Module>(
        &self,
        step: u64,
        model: &M,
        opt: Option<&dyn OptimizerState>,
        cx: &Cx,
        extra: serde_json::Value,
        resume_point: bool,
    ) -> Result<Job> {
        let previous = self.wait();
        let g = cx.groups();
        let coords = Coords::of(cx);
        let is_root = coords.is_root();
        let layout = cx.pipeline_layout();
        let chunks = match &layout {
            Ok(Some(l)) => Ok(l.chunks()),
            Ok(None) if g.pp.size() > 1 => Err(Error::Checkpoint {
                path: self.root.path.display().to_string(),
                detail: format!(
                    "this rank is stage {} of a {}-stage pipeline, but the context does not say how the stages divide the model; declare it with `Cx::with_pipeline_chunks` (the schedule's chunks per stage) so that each stage saves the parameters it trains",
                    g.pp.rank(),
                    g.pp.size()
                ),
            }),
            Ok(None) => Ok(1),
            Err(e) => Err(Error::checkpoint(&self.root.path, e.to_string())),
        };
        // Every rank writes into rank 0's temporary directory.
        let pid = collective::broadcast(cx, std::process::id())?;
        let tmp = self.root.path.join(format!("step-{step}.tmp-{pid}"));
        let prepared = if is_root { self.root.prepare_tmp(&tmp) } else { Ok(()) };
        let zero_stage = opt.and_then(|o| o.zero_stage());
        let part = chunks.and_then(|chunks| {
            let mesh = MeshInfo { tp: g.tp.size(), dp: g.dp.size(), pp: g.pp.size(), ep: g.ep.size(), chunks };
            let file = coords.rank_file(&mesh, zero_stage.is_some());
            collect::collect(model, opt, cx, &mesh, &file, &tmp).map(|part| (mesh, file, part))
        });
        let ready = previous.and(prepared).and(part);
        let (mesh, file, part) = collective::agree(cx, &format!("preparing the checkpoint of step {step}"), ready)?;
        let commit = is_root.then(|| Commit { step, resume_point, mesh, zero_stage, optimizer: opt.map(|o| o.info()), extra });
        Ok(Job { root: self.root.clone(), groups: g.clone(), step, tmp, coords, file, part, dir: self.step_dir(step), commit })
    }
}

impl Root {
    fn prepare_tmp(&self, tmp: &Path) -> Result<()> {
        if tmp.exists() {
            fs::remove_dir_all(tmp).map_err(|e| io_err(tmp, "cannot remove a stale temporary directory", e))?;
        }
        fs::create_dir_all(tmp).map_err(|e| io_err(tmp, "cannot create the temporary checkpoint directory", e))
    }

    /// Rank 0, once every part file is there: the manifest, the rename, the
    /// `latest` pointer, and pruning.
    fn commit(&self, tmp: &Path, c: Commit, groups: &Groups) -> Result<PathBuf> {
        let deadline = Instant::now() + self.timeout;
        let mut params: Vec<ParamRecord> = Vec::new();
        let mut seen: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
        let mut tensors: Vec<TensorRecord> = Vec::new();
        let mut parts = Vec::new();
        for coords in Coords::all(&c.mesh) {
            let path = tmp.join(coords.part_file());
            let part = await_part(&path, deadline, groups)?;
            if let Some(e) = part.error {
                return Err(Error::Checkpoint { path: tmp.display().to_string(), detail: format!("rank {} could not write its part: {e}", coords.describe()) });
            }
            for p in part.params {
                match seen.get(&p.name) {
                    None => {
                        seen.insert(p.name.clone(), params.len());
                        params.push(p);
                    }
                    Some(&i) if params[i] == p => {}
                    Some(&i) => {
                        return Err(ckpt_err(
                            &path,
                            &format!("ranks describe parameter `{}` differently ({:?} and {p:?})", p.name, params[i]),
                            "every rank must build the same model",
                        ))
                    }
                }
            }
            tensors.extend(part.tensors);
            parts.push(path);
        }
        let manifest = Manifest {
            format: FORMAT_VERSION,
            step: c.step,
            mesh: c.mesh,
            zero_stage: c.zero_stage,
            params,
            tensors,
            optimizer: c.optimizer,
            extra: c.extra,
            resume_point: c.resume_point,
            checksum: None,
        };
        let path = tmp.join(MANIFEST);
        check::check_layout(&manifest, &path)?;
        for p in parts {
            fs::remove_file(&p).map_err(|e| io_err(&p, "cannot remove", e))?;
        }
        io::write_synced(&path, &manifest.to_json()?)?;
        sync_dir(tmp);
        let dir = self.step_dir(c.step);
        let old = self.path.join(format!("step-{}.old-{}", c.step, std::process::id()));
        let replacing = dir.exists();
        if replacing {
            fs::rename(&dir, &old).map_err(|e| io_err(&dir, "cannot move the previous checkpoint of this step aside", e))?;
        }
        fs::rename(tmp, &dir).map_err(|e| io_err(&dir, "cannot rename the temporary directory into place", e))?;
        sync_dir(&self.path);
        io::replace_file(&self.path.join(LATEST), format!("step-{}\n", c.step).as_bytes())?;
        if replacing {
            fs::remove_dir_all(&old).map_err(|e| io_err(&old, "cannot remove the replaced checkpoint", e))?;
        }
        self.prune(c.step)?;
        Ok(dir)
    }

    /// Deletes the oldest checkpoints beyond `keep` (resume points do not
    /// count) and every resume point older than the checkpoint just
    /// written (it supersedes them), never that one; a checkpoint that does
    /// not look whole (its manifest, layout or files; see
    /// `check::looks_whole`) is set aside instead, never deleted.
    fn prune(&self, written: u64) -> Result<()> {
        let mut regular = Vec::new();
        let mut doomed = Vec::new();
        for (step, dir) in self.steps()?.into_iter().filter(|(s, _)| *s != written) {
            match read_manifest(&dir) {
                Ok(m) if m.resume_point => {
                    if step < written {
                        doomed.push(dir);
                    }
                }
                _ => regular.push(dir),
            }
        }
        let written_counts = !read_manifest(&self.step_dir(written)).is_ok_and(|m| m.resume_point);
        let excess = (regular.len() + usize::from(written_counts)).saturating_sub(self.keep);
        doomed.extend(regular.into_iter().take(excess));
        for dir in doomed {
            self.delete_or_set_aside(&dir)?;
        }
        Ok(())
    }

    /// Deletes the checkpoint in `dir`, unless it does not look whole: that
    /// one is set aside (renamed, with its reason) and reported.
    pub(crate) fn delete_or_set_aside(&self, dir: &Path) -> Result<()> {
        match super::check::looks_whole(dir) {
            Ok(()) => fs::remove_dir_all(dir).map_err(|e| io_err(dir, "cannot delete an old checkpoint", e)),
            Err(reason) => {
                let to = super::damaged::set_aside_in(&self.path, dir, &reason.to_string())?;
                eprintln!("kept the damaged checkpoint {} as {} instead of deleting it: {reason}", dir.display(), to.display());
                Ok(())
            }
        }
    }
}

/// How a background save ended, once it has.
enum Outcome {
    Running,
    Done(Result<PathBuf>),
    /// Its outcome was already returned (its error, if any, kept as text).
    Seen {
        error: Option<String>,
    },
}

/// A background save shared between its thread, its handle and the
/// [`Checkpointer`] (which waits for it before the next save).
pub(crate) struct Background {
    dir: PathBuf,
    outcome: Mutex<Outcome>,
    done: Condvar,
}

impl Background {
    fn lock(&self) -> parking_lot::MutexGuard<'_, Outcome> {
        self.outcome.lock()
    }

    fn wait_finished(&self) -> parking_lot::MutexGuard<'_, Outcome> {
        let mut o = self.lock();
        while matches!(*o, Outcome::Running) {
            self.done.wait(&mut o);
        }
        o
    }

    /// Waits for the end, leaving the outcome to whoever reports it.
    pub fn wait_done(&self) {
        drop(self.wait_finished());
    }

    /// Waits; returns the save's error if nobody has seen it yet.
    pub fn take_error(&self) -> Result<()> {
        let mut o = self.wait_finished();
        if let Outcome::Done(Err(e)) = &*o {
            let error = Some(e.to_string());
            let Outcome::Done(r) = std::mem::replace(&mut *o, Outcome::Seen { error }) else { unreachable!("matched above") };
            return r.map(|_| ());
        }
        Ok(())
    }
}

/// A save being written on a background thread of this rank (see
/// [`Checkpointer::save_in_background`]).
#[must_use = "a background save reports its outcome only through `wait` (or the next save)"]
pub struct SaveHandle {
    job: Arc<Background>,
}

impl SaveHandle {
    /// Starts `job` on a thread of its own.
    pub(crate) fn spawn(job: Job) -> Result<(SaveHandle, Arc<Background>)> {
        let shared = Arc::new(Background { dir: job.dir.clone(), outcome: Mutex::new(Outcome::Running), done: Condvar::new() });
        let theirs = shared.clone();
        std::thread::Builder::new()
            .name("tessera-ckpt".into())
            .spawn(move || {
                let r = job.run();
                *theirs.lock() = Outcome::Done(r);
                theirs.done.notify_all();
            })
            .map_err(|e| io_err(&shared.dir, "cannot start the background writer thread", e))?;
        Ok((SaveHandle { job: shared.clone() }, shared))
    }

    /// Whether the writing has finished (successfully or not).
    pub fn is_finished(&self) -> bool {
        !matches!(*self.job.lock(), Outcome::Running)
    }

    /// Waits for the save; returns the checkpoint's directory. On rank 0
    /// success means the checkpoint is complete and visible; on the other
    /// ranks, that this rank's part is written.
    pub fn wait(self) -> Result<PathBuf> {
        let mut o = self.job.wait_finished();
        match std::mem::replace(&mut *o, Outcome::Seen { error: None }) {
            Outcome::Done(r) => {
                if let Err(e) = &r {
                    *o = Outcome::Seen { error: Some(e.to_string()) };
                }
                r
            }
            Outcome::Seen { error: None } => Ok(self.job.dir.clone()),
            Outcome::Seen { error: Some(detail) } => {
                *o = Outcome::Seen { error: Some(detail.clone()) };
                Err(Error::Checkpoint { path: self.job.dir.display().to_string(), detail: format!("{detail} (already reported by the next save)") })
            }
            Outcome::Running => unreachable!("waited for the end"),
        }
    }
}

impl std::fmt::Debug for SaveHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SaveHandle({}, finished: {})", self.job.dir.display(), self.is_finished())
    }
}
