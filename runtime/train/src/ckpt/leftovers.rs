//! Unfinished checkpoint directories left by jobs that are gone.
//!
//! A save writes into `step-<N>.tmp-<pid>` and renames it into place when
//! complete; a job killed in between leaves the temporary directory behind.
//! It is never read, but it holds a checkpoint's worth of disk, so a new job
//! removes those whose process no longer runs (and says so).

use super::io::io_err;
use super::Checkpointer;
use std::fs;
use std::path::PathBuf;
use tessera_core::Result;

/// The process id of a `step-<N>.tmp-<pid>` name.
fn writer_of(name: &str) -> Option<u32> {
    let (step, pid) = name.strip_prefix("step-")?.split_once(".tmp-")?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    (digits(step) && digits(pid)).then(|| pid.parse().ok()).flatten()
}

/// Whether process `pid` still runs (this one does; on Linux any other
/// whose `/proc` entry exists; elsewhere, without a way to tell, any).
fn running(pid: u32) -> bool {
    if pid == std::process::id() {
        return true;
    }
    if cfg!(target_os = "linux") {
        return std::path::Path::new("/proc").join(pid.to_string()).exists();
    }
    true
}

impl Checkpointer {
    /// Removes every `step-<N>.tmp-<pid>` directory under the root whose
    /// writer no longer runs; returns the directories removed.
    pub fn clean_leftovers(&self) -> Result<Vec<PathBuf>> {
        let root = self.root();
        let entries = fs::read_dir(root).map_err(|e| io_err(root, "cannot list the checkpoint root", e))?;
        let mut removed = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| io_err(root, "cannot list the checkpoint root", e))?;
            let Some(pid) = entry.file_name().to_str().and_then(writer_of) else { continue };
            let path = entry.path();
            if !path.is_dir() || running(pid) {
                continue;
            }
            fs::remove_dir_all(&path).map_err(|e| io_err(&path, "cannot remove an unfinished checkpoint of a job that is gone", e))?;
            removed.push(path);
        }
        removed.sort();
        Ok(removed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_temporary_checkpoint_names_have_a_writer() {
        assert_eq!(writer_of("step-12.tmp-345"), Some(345));
        for name in ["step-12", "step-.tmp-3", "step-1.tmp-", "step-1.tmp-x", "latest", "step-1.tmp-3.json"] {
            assert_eq!(writer_of(name), None, "{name}");
        }
    }

    #[test]
    fn leftovers_of_gone_jobs_are_removed_and_the_rest_kept() {
        let scratch = tempfile::tempdir().unwrap();
        let root = scratch.path().join("checkpoints");
        let ckpt = Checkpointer::new(&root, 2).unwrap();
        // A pid above the kernel's limit (4194304) never runs.
        let gone = root.join("step-3.tmp-4999999");
        let ours = root.join(format!("step-4.tmp-{}", std::process::id()));
        let complete = root.join("step-2");
        for d in [&gone, &ours, &complete] {
            fs::create_dir_all(d).unwrap();
            fs::write(d.join("rank.bin"), b"x").unwrap();
        }
        assert_eq!(ckpt.clean_leftovers().unwrap(), vec![gone.clone()]);
        assert!(!gone.exists() && ours.exists() && complete.exists());
    }
}
