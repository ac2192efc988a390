//! Damaged checkpoints are set aside, never deleted.
//!
//! A checkpoint that fails verification cannot be loaded, but it may be the
//! only copy of hours of training that a person could still rescue (one bad
//! rank file out of many). The trainer therefore never lets pruning or a
//! replacing save delete it: it renames `step-<N>` to
//! `damaged-step-<N>-<unix seconds>`, a name no scan or prune looks at, and
//! writes why into `REASON.txt` inside it.

use super::io::io_err;
use super::Checkpointer;
use std::fs;
use std::path::{Path, PathBuf};
use tessera_core::Result;

/// The file a set-aside checkpoint carries, saying why.
pub const REASON_FILE: &str = "REASON.txt";

/// Renames `dir` under `root` to `damaged-<name>-<unix seconds>` and
/// records `reason` in it; returns the new directory.
pub(crate) fn set_aside_in(root: &Path, dir: &Path, reason: &str) -> Result<PathBuf> {
    let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "checkpoint".into());
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let mut to = root.join(format!("damaged-{name}-{secs}"));
    let mut n = 1;
    while to.exists() {
        to = root.join(format!("damaged-{name}-{secs}-{n}"));
        n += 1;
    }
    fs::rename(dir, &to).map_err(|e| io_err(dir, "cannot set the damaged checkpoint aside", e))?;
    let note = to.join(REASON_FILE);
    fs::write(&note, format!("{reason}\n")).map_err(|e| io_err(&note, "cannot record why the checkpoint was set aside", e))?;
    Ok(to)
}

impl Checkpointer {
    /// Renames the damaged checkpoint `dir` out of the way, to
    /// `damaged-step-<N>-<unix seconds>` (a name no scan or prune looks at),
    /// and records `reason` in its `REASON.txt`; returns where it went.
    pub fn set_aside(&self, dir: &Path, reason: &str) -> Result<PathBuf> {
        set_aside_in(self.root(), dir, reason)
    }

    /// The checkpoints set aside so far, oldest name first.
    pub fn set_aside_dirs(&self) -> Result<Vec<PathBuf>> {
        let root = self.root();
        let entries = fs::read_dir(root).map_err(|e| io_err(root, "cannot list the checkpoint root", e))?;
        let mut out: Vec<PathBuf> = entries
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_str().is_some_and(|n| n.starts_with("damaged-")) && e.path().is_dir())
            .map(|e| e.path())
            .collect();
        out.sort();
        Ok(out)
    }
}
