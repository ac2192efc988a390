//! This node's part of a job: its segment, which holds the failure that
//! stops every rank of the node, and what every group of the node needs to
//! know (the ranks here and their processes, the job's file names).

use super::arena::{PeerArena, Published, ShmArena};
use super::segment::{job_prefix, Segment};
use super::sys;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;
use tessera_core::{Error, Result};

/// The node segment's layout: a magic number, the number of local ranks and
/// how many have mapped it, and the failure record.
const MAGIC: u64 = 0x5445_5353_4e4f_4445; // "TESSNODE"
const OFF_MAGIC: usize = 0;
const OFF_ATTACHED: usize = 8;
const OFF_JOB: usize = 16;
/// 0: no failure; 1: being written; 2: written (rank and reason readable).
const OFF_FAIL_STATE: usize = 64;
const OFF_FAIL_RANK: usize = 72;
const OFF_FAIL_LEN: usize = 80;
const OFF_FAIL_TEXT: usize = 128;
const FAIL_TEXT: usize = 4096;
pub(super) const NODE_BYTES: usize = OFF_FAIL_TEXT + FAIL_TEXT;

/// Where failures go besides this node's segment, and where others come
/// from: the connections to the ranks on other nodes, when the job has
/// them.
pub(crate) struct Linked {
    /// The failure the other transport knows of, if any.
    pub failure: Box<dyn Fn() -> Option<Error> + Send + Sync>,
    /// Tells the other transport that a rank failed.
    pub fail: Box<dyn Fn(usize, String) + Send + Sync>,
}

/// A rank's view of its node in a job.
pub(crate) struct Node {
    seg: Segment,
    /// The directory the job's segments live in.
    pub dir: PathBuf,
    /// The start of the name of every file of this job.
    pub prefix: String,
    /// This process's world rank, and the number of ranks in the job.
    pub me: usize,
    pub world: usize,
    /// The world ranks on this node, in increasing order.
    pub local: Vec<usize>,
    /// Each world rank's process id (0 for ranks on other nodes).
    pub pids: Vec<u32>,
    pub job: u64,
    pub timeout: Duration,
    /// This process's arena, if it has one.
    pub arena: Option<Arc<ShmArena>>,
    /// Each world rank's arena as published (descriptor, size); `None` for
    /// ranks without one and ranks on other nodes.
    pub arenas: Vec<Option<Published>>,
    /// The peers' arenas mapped so far (`None`: this process cannot map it).
    mapped: Mutex<HashMap<usize, Option<Arc<PeerArena>>>>,
    linked: OnceLock<Linked>,
    /// The futex words of this process's groups, rung when a failure is
    /// recorded so that their waiters notice at once.
    bells: Mutex<Vec<Weak<dyn Bell>>>,
}

/// Something that wakes the waiters of one group.
pub(super) trait Bell: Send + Sync {
    fn ring(&self);
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node").field("me", &self.me).field("local", &self.local).field("segment", &self.seg).finish_non_exhaustive()
    }
}

/// The pieces a node is made of, found through the rendezvous store.
pub(super) struct Found {
    pub dir: PathBuf,
    pub ns: u32,
    pub me: usize,
    pub local: Vec<usize>,
    pub pids: Vec<u32>,
    pub job: u64,
    pub timeout: Duration,
    pub arena: Option<Arc<ShmArena>>,
    pub arenas: Vec<Option<Published>>,
}

impl Node {
    /// Maps (creating it if no local rank has yet) the job's segment of
    /// this node; the last local rank to map it removes its name.
    pub(super) fn attach(f: Found) -> Result<Node> {
        let leader = f.pids[f.local[0]];
        let prefix = job_prefix(f.ns, leader, f.job);
        let name = format!("{prefix}node");
        let job = f.job;
        let (seg, _) = Segment::create_or_open(&f.dir, &name, NODE_BYTES, |s| {
            s.u64(OFF_JOB).store(job, Ordering::Relaxed);
            s.u64(OFF_MAGIC).store(MAGIC, Ordering::Release);
        })
        .map_err(|e| shm_error(&f.dir.join(&name), "create or map this node's segment", e))?;
        if seg.u64(OFF_MAGIC).load(Ordering::Acquire) != MAGIC || seg.u64(OFF_JOB).load(Ordering::Relaxed) != job {
            return Err(Error::topology("ShmWorld::join", format!("{} is not this job's node segment (another program wrote it)", seg.path().display())));
        }
        if seg.u32(OFF_ATTACHED).fetch_add(1, Ordering::AcqRel) as usize + 1 == f.local.len() {
            seg.unlink();
        }
        Ok(Node {
            seg,
            dir: f.dir,
            prefix,
            me: f.me,
            world: f.pids.len(),
            local: f.local,
            pids: f.pids,
            job,
            timeout: f.timeout,
            arena: f.arena,
            arenas: f.arenas,
            mapped: Mutex::default(),
            linked: OnceLock::new(),
            bells: Mutex::default(),
        })
    }

    /// Connects the node's failures with another transport's (once).
    pub(crate) fn link(&self, linked: Linked) {
        let _ = self.linked.set(linked);
    }

    /// Registers a group's bell, rung when a failure is recorded.
    pub(super) fn add_bell(&self, bell: Weak<dyn Bell>) {
        let mut bells = self.bells.lock();
        bells.retain(|b| b.strong_count() > 0);
        bells.push(bell);
    }

    /// The failure that stopped the job, if one has: recorded on this node,
    /// or known to the linked transport.
    pub(crate) fn failure(&self) -> Option<Error> {
        if self.seg.u32(OFF_FAIL_STATE).load(Ordering::Acquire) == 2 {
            let rank = self.seg.u64(OFF_FAIL_RANK).load(Ordering::Relaxed) as usize;
            let len = (self.seg.u64(OFF_FAIL_LEN).load(Ordering::Relaxed) as usize).min(FAIL_TEXT);
            // SAFETY: the text was written once, before the state became 2
            // (read above with acquire), and is never written again.
            let text = unsafe { self.seg.bytes(OFF_FAIL_TEXT, len) };
            return Some(Error::PeerFailed { rank, reason: String::from_utf8_lossy(text).into_owned() });
        }
        self.linked.get().and_then(|l| (l.failure)())
    }

    /// Declares world rank `rank` failed for `reason`: every rank's pending
    /// and later calls return [`Error::PeerFailed`] naming it. The first
    /// failure recorded wins.
    pub(crate) fn fail(&self, rank: usize, reason: String) {
        self.record(rank, &reason);
        if let Some(l) = self.linked.get() {
            (l.fail)(rank, reason);
        }
    }

    /// Before this rank leaves the node's groups: a failure it knows of
    /// only through the linked transport is recorded on the node, so that a
    /// peer that sees it leave is told why rather than that it left (the
    /// peer looks for a failure before it reports a departure).
    pub(crate) fn before_leaving(&self) {
        if let Some(Error::PeerFailed { rank, reason }) = self.failure() {
            self.record(rank, &reason);
        }
    }

    /// Records world rank `rank`'s failure on the node (the first recorded
    /// wins) and wakes every waiter.
    fn record(&self, rank: usize, reason: &str) {
        let state: &AtomicU32 = self.seg.u32(OFF_FAIL_STATE);
        if state.compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            let text = &reason.as_bytes()[..reason.len().min(FAIL_TEXT)];
            // SAFETY: winning the exchange from 0 to 1 makes this the only
            // writer of the record, and readers read it only once the
            // state is 2.
            unsafe { self.seg.bytes_mut(OFF_FAIL_TEXT, text.len()) }.copy_from_slice(text);
            self.seg.u64(OFF_FAIL_RANK).store(rank as u64, Ordering::Relaxed);
            self.seg.u64(OFF_FAIL_LEN).store(text.len() as u64, Ordering::Relaxed);
            state.store(2, Ordering::Release);
            let bells: Vec<_> = self.bells.lock().iter().filter_map(Weak::upgrade).collect();
            for b in bells {
                b.ring();
            }
        }
    }

    /// World rank `rank`'s arena, mapped into this process (once), if it
    /// published one and this process may map it.
    pub(super) fn peer_arena(&self, rank: usize) -> Option<Arc<PeerArena>> {
        let mut mapped = self.mapped.lock();
        mapped
            .entry(rank)
            .or_insert_with(|| {
                let (fd, len) = self.arenas.get(rank).copied().flatten()?;
                PeerArena::open(self.pids[rank], fd, len).map(Arc::new)
            })
            .clone()
    }

    /// Whether world rank `rank`'s process still runs.
    pub(super) fn alive(&self, rank: usize) -> bool {
        sys::alive(self.pids[rank])
    }
}

/// A failure of the shared-memory directory, with what to do about it.
pub(super) fn shm_error(path: &std::path::Path, doing: &str, e: std::io::Error) -> Error {
    let hint = if e.raw_os_error() == Some(libc::ENOSPC) {
        " (the shared-memory directory is full: enlarge it, e.g. `docker run --shm-size`, or set TESSERA_TRANSPORT=tcp)"
    } else {
        " (set TESSERA_SHM_DIR to a writable directory on a memory filesystem, or TESSERA_TRANSPORT=tcp)"
    };
    Error::io(path, std::io::Error::new(e.kind(), format!("cannot {doing}: {e}{hint}")))
}
