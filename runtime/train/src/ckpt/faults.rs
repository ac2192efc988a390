//! Checkpoint writes that fail on purpose: the `io_error` and `kill … at
//! "save"` faults of a run's `[faults]` section (see
//! [`FaultConfig`](crate::FaultConfig)).

use super::place::Coords;
use parking_lot::Mutex;
use std::sync::Arc;

/// What an injected fault does to a rank's write.
#[derive(Debug)]
pub(crate) enum WriteFault {
    /// The write fails as on a full disk.
    Error(std::io::Error),
    /// The process is killed once the rank's tensors are written, before
    /// the rank reports its part: the checkpoint can never complete.
    Kill,
}

/// The faults armed for the writes of a checkpoint root; each strikes once,
/// at the first save at or after its step by the rank at its coordinates.
#[derive(Clone, Debug, Default)]
pub(crate) struct WriteFaults(Arc<Mutex<Armed>>);

#[derive(Debug, Default)]
struct Armed {
    error: Option<(Coords, u64)>,
    kill: Option<(Coords, u64)>,
}

impl WriteFaults {
    pub fn arm_error(&self, at: Coords, from_step: u64) {
        self.lock().error = Some((at, from_step));
    }

    pub fn arm_kill(&self, at: Coords, from_step: u64) {
        self.lock().kill = Some((at, from_step));
    }

    /// The fault that strikes this write of the rank at `coords`, if any
    /// (disarmed as it strikes).
    pub fn take(&self, coords: Coords, step: u64) -> Option<WriteFault> {
        let mut armed = self.lock();
        let strikes = |f: &Option<(Coords, u64)>| f.is_some_and(|(c, s)| c == coords && step >= s);
        if strikes(&armed.kill) {
            armed.kill = None;
            return Some(WriteFault::Kill);
        }
        if strikes(&armed.error) {
            armed.error = None;
            return Some(WriteFault::Error(std::io::Error::new(
                std::io::ErrorKind::StorageFull,
                "No space left on device (os error 28, injected by faults.io_error)",
            )));
        }
        None
    }

    fn lock(&self) -> parking_lot::MutexGuard<'_, Armed> {
        self.0.lock()
    }
}
