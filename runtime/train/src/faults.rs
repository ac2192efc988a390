//! Built-in fault injection: the `[faults]` section of a run's
//! configuration makes it fail on purpose, so that a team can rehearse what
//! its runs do when a rank dies or hangs, a loss goes NaN, a disk fills up
//! or one machine is slow (as torchft and NVIDIA's resiliency tools let
//! one do), and so that the failure handling is tested end to end.
//!
//! ```toml
//! [faults]
//! kill = { rank = 1, step = 5 }                             # rank 1 dies as step 5 begins
//! kill = { rank = 0, step = 8, at = "save", process = true } # the process is SIGKILLed mid-checkpoint
//! hang = { rank = 1, step = 5 }                             # rank 1 stops responding at step 5
//! nan = { step = 7 }                                        # the loss of step 7 is NaN
//! io_error = { rank = 1, step = 10 }                        # rank 1's next checkpoint write from step 10 fails: disk full
//! slow = { rank = 1, ms = 50 }                              # rank 1 takes 50 ms longer every step
//! ```
//!
//! (One `kill` at a time; the two lines show its two forms.) Every fault
//! names the step it strikes at, counted like the metrics lines (the first
//! step is 1); `rank` is a rank of the mesh (in `pp, dp, cp, ep, tp` order, tp
//! fastest). Each can be set from the command line:
//! `--set 'faults.kill={rank=1,step=5}'`.
//!
//! What each one does:
//!
//! * **kill**: the rank's thread ends at once, without telling anyone,
//!   as a process killed with `kill -9` would; its peers find it gone when
//!   they next need it. With `process = true` the whole process is sent
//!   `SIGKILL` instead (no clean-up of any kind: what a node loss does).
//!   `at = "save"` strikes while the step's checkpoint is being written
//!   (after the rank's tensors are on disk, before the checkpoint is
//!   complete); it needs `process = true`.
//! * **hang**: the rank stops before the step's work and waits, forever,
//!   until its peers give up on it (after `mesh.timeout_s`).
//! * **nan**: the loss of the step (and so its gradients) is NaN on every
//!   rank: the stability monitor's and the loss scaler's business.
//! * **io_error**: the rank's write of the first checkpoint at or after the
//!   step fails as on a full disk (`No space left on device`), the rank's
//!   report of its failure included.
//! * **slow**: the rank sleeps `ms` milliseconds before every step's work.

use serde::{Deserialize, Serialize};
use tessera_core::{Error, Result};

/// `[faults]`: failures to inject into a run (none by default).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FaultConfig {
    /// A rank (or the whole process) that dies.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kill: Option<KillFault>,
    /// A rank that stops responding.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hang: Option<RankAtStep>,
    /// A step whose loss is NaN.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nan: Option<AtStep>,
    /// A checkpoint write that fails as on a full disk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub io_error: Option<RankAtStep>,
    /// A rank slower than the others.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slow: Option<SlowRank>,
}

/// Where a kill strikes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KillPoint {
    /// As the step begins.
    #[default]
    Step,
    /// While the step's checkpoint (or the next one) is written.
    Save,
}

/// `faults.kill`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KillFault {
    /// The rank that dies.
    #[serde(default)]
    pub rank: usize,
    /// The step it dies at.
    pub step: u64,
    /// When in the step.
    #[serde(default)]
    pub at: KillPoint,
    /// Kill the whole process (`SIGKILL`) rather than the rank's thread.
    #[serde(default)]
    pub process: bool,
}

/// A rank and a step (`faults.hang`, `faults.io_error`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RankAtStep {
    /// The rank (0 when left out).
    #[serde(default)]
    pub rank: usize,
    /// The step.
    pub step: u64,
}

/// A step (`faults.nan`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AtStep {
    /// The step.
    pub step: u64,
}

/// `faults.slow`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlowRank {
    /// The slow rank.
    #[serde(default)]
    pub rank: usize,
    /// Extra milliseconds per step.
    pub ms: u64,
}

impl FaultConfig {
    /// Whether any fault is set.
    pub fn any(&self) -> bool {
        !self.is_empty()
    }

    /// Whether no fault is set.
    pub fn is_empty(&self) -> bool {
        *self == FaultConfig::default()
    }

    /// Checks every fault against a mesh of `world` ranks.
    pub fn validate(&self, world: usize) -> Result<()> {
        let rank = |key: &str, r: usize| {
            if r < world {
                Ok(())
            } else {
                Err(Error::config(key, format!("rank {r} does not exist: the mesh has {world} rank(s), 0 to {}", world - 1)))
            }
        };
        let step = |key: &str, s: u64| if s == 0 { Err(Error::config(key, "steps count from 1, like the metrics lines")) } else { Ok(()) };
        if let Some(k) = &self.kill {
            rank("faults.kill.rank", k.rank)?;
            step("faults.kill.step", k.step)?;
            if k.at == KillPoint::Save && !k.process {
                return Err(Error::config("faults.kill.at", "a kill during a save is a kill of the process; add `process = true`"));
            }
        }
        if let Some(h) = &self.hang {
            rank("faults.hang.rank", h.rank)?;
            step("faults.hang.step", h.step)?;
        }
        if let Some(n) = &self.nan {
            step("faults.nan.step", n.step)?;
        }
        if let Some(io) = &self.io_error {
            rank("faults.io_error.rank", io.rank)?;
            step("faults.io_error.step", io.step)?;
        }
        if let Some(s) = &self.slow {
            rank("faults.slow.rank", s.rank)?;
            if s.ms > 600_000 {
                return Err(Error::config("faults.slow.ms", "at most 600000 (ten minutes a step)"));
            }
        }
        Ok(())
    }

    /// One line naming every fault set, for the start of the run.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(k) = &self.kill {
            let what = if k.process { "the process is killed" } else { "rank dies" };
            let when = if k.at == KillPoint::Save { "while the checkpoint is written" } else { "as the step begins" };
            parts.push(format!("kill: {what} (rank {}) at step {} {when}", k.rank, k.step));
        }
        if let Some(h) = &self.hang {
            parts.push(format!("hang: rank {} at step {}", h.rank, h.step));
        }
        if let Some(n) = &self.nan {
            parts.push(format!("nan: the loss of step {}", n.step));
        }
        if let Some(io) = &self.io_error {
            parts.push(format!("io_error: rank {}'s first checkpoint write from step {}", io.rank, io.step));
        }
        if let Some(s) = &self.slow {
            parts.push(format!("slow: rank {} by {} ms a step", s.rank, s.ms));
        }
        parts.join("; ")
    }
}

/// Ends this process at once with `SIGKILL`: no destructor runs, no buffer
/// is flushed, no file is closed, as when the machine goes away.
pub(crate) fn kill_this_process() -> ! {
    #[cfg(unix)]
    {
        // SAFETY: `kill` and `getpid` have no memory-safety preconditions;
        // sending SIGKILL to our own process ends it here.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
    }
    // SIGKILL cannot be caught; this is only reached where there is none.
    std::process::abort()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_read_from_toml_and_are_checked() {
        let f: FaultConfig = toml::from_str("kill = { rank = 1, step = 5 }\nnan = { step = 7 }\nslow = { rank = 1, ms = 20 }\n").unwrap();
        assert_eq!(f.kill, Some(KillFault { rank: 1, step: 5, at: KillPoint::Step, process: false }));
        assert!(f.any() && f.validate(2).is_ok());
        assert!(f.describe().contains("rank dies (rank 1) at step 5"), "{}", f.describe());
        let e = f.validate(1).unwrap_err().to_string();
        assert!(e.contains("faults.kill.rank") && e.contains("1 rank(s)"), "{e}");
        let save: FaultConfig = toml::from_str("kill = { step = 3, at = \"save\" }\n").unwrap();
        assert!(save.validate(1).unwrap_err().to_string().contains("process = true"));
        let zero: FaultConfig = toml::from_str("nan = { step = 0 }\n").unwrap();
        assert!(zero.validate(1).unwrap_err().to_string().contains("count from 1"));
        assert!(toml::from_str::<FaultConfig>("kil = { step = 3 }\n").is_err());
        assert!(!FaultConfig::default().any());
    }
}
