//! One run directory, one job: an advisory lock on `<run.out>/.lock`.
//!
//! Two jobs writing the same run directory interleave their metrics, race
//! on checkpoints and corrupt both. The trainer holds an exclusive lock on
//! the directory's `.lock` file for the whole run (the operating system's
//! advisory file lock, `flock` on Unix, through the standard library), and
//! writes who holds it into the file. A second job fails at once, naming the
//! holder. The lock dies with its process, so a killed job leaves no stale
//! lock: the next job takes it, and says whose lock it was.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use tessera_core::{Error, Result};

/// The lock file's name inside a run directory.
pub const LOCK_FILE: &str = ".lock";

/// The exclusive lock on a run directory, held until dropped.
#[derive(Debug)]
pub struct RunLock {
    file: File,
    path: PathBuf,
    /// What the lock file said when it was taken: the holder of a previous
    /// job that ended without releasing it (killed), if any.
    previous: Option<String>,
}

impl RunLock {
    /// Takes the lock of run directory `dir` (which must exist), or fails at
    /// once if another job holds it.
    pub fn acquire(dir: &Path) -> Result<RunLock> {
        let path = dir.join(LOCK_FILE);
        let mut file = OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path).map_err(|e| Error::io(&path, e))?;
        let mut holder = String::new();
        // What the file says is only a description; the lock is the truth.
        let _ = file.read_to_string(&mut holder);
        let holder = holder.trim().to_string();
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let who = if holder.is_empty() { "another job".to_string() } else { holder };
                return Err(Error::RunDirInUse { dir: dir.display().to_string(), holder: who });
            }
            Err(TryLockError::Error(e)) => return Err(Error::io(&path, e)),
        }
        let me = format!("pid {} on {} since {}", std::process::id(), host(), now());
        file.set_len(0)
            .and_then(|_| file.seek(SeekFrom::Start(0)))
            .and_then(|_| writeln!(file, "{me}"))
            .and_then(|_| file.flush())
            .map_err(|e| Error::io(&path, e))?;
        Ok(RunLock { file, path, previous: (!holder.is_empty()).then_some(holder) })
    }

    /// The holder a previous job wrote and never cleared (it was killed):
    /// its lock died with it.
    pub fn stale_holder(&self) -> Option<&str> {
        self.previous.as_deref()
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for RunLock {
    /// Clears the holder (the lock itself goes with the file handle): a
    /// job that ends normally leaves no description behind.
    fn drop(&mut self) {
        let _ = self.file.set_len(0);
    }
}

/// This machine's name, for messages.
fn host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "this host".into())
}

/// The time now, as `2026-12-01 16:55:02 UTC`.
fn now() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    utc(secs)
}

/// Seconds since the Unix epoch as a UTC date and time (the civil calendar
/// from a day count, after Howard Hinnant's `civil_from_days`).
fn utc(secs: u64) -> String {
    let (days, rest) = ((secs / 86_400) as i64, secs % 86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC", rest / 3600, rest / 60 % 60, rest % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_are_the_civil_calendar() {
        assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc(951_782_400), "2000-02-29 00:00:00 UTC");
        assert_eq!(utc(1_796_142_902), "2026-12-01 16:35:02 UTC");
    }

    #[test]
    fn a_second_holder_is_refused_and_the_lock_is_free_after_drop() {
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path();
        let first = RunLock::acquire(dir).unwrap();
        let e = RunLock::acquire(dir).unwrap_err().to_string();
        assert!(e.contains("in use by pid") && e.contains(&std::process::id().to_string()) && e.contains("run.out"), "{e}");
        drop(first);
        let again = RunLock::acquire(dir).unwrap();
        assert_eq!(again.stale_holder(), None, "a job that ended cleanly leaves no holder behind");
        drop(again);
        // A killed job leaves its description but not its lock.
        std::fs::write(dir.join(LOCK_FILE), "pid 4999999 on elsewhere since 1970-01-01 00:00:00 UTC\n").unwrap();
        let after_kill = RunLock::acquire(dir).unwrap();
        assert_eq!(after_kill.stale_holder(), Some("pid 4999999 on elsewhere since 1970-01-01 00:00:00 UTC"));
        drop(after_kill);
    }
}
