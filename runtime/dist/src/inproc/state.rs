//! The state the ranks of an in-process world share: the failure that stops
//! them all, and per group a board where each collective step meets, plus
//! the mailboxes of point-to-point messages.
//!
//! Every wait is a `Condvar` wait with a deadline, and every waiter re-checks
//! the world's failure and its peers' departure each time it wakes, so a
//! failed or missing rank turns into an error instead of a hang.

use super::landing::Landing;
use crate::call::Call;
use parking_lot::{Condvar, Mutex};
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use tessera_core::tensor::Tensor;
use tessera_core::Device;
use tessera_core::{Error, Result};

/// Why the world stopped: the first failure reported wins, since later ones
/// are usually its consequences.
#[derive(Debug)]
pub(super) struct Failure {
    /// World rank that failed (or gave up waiting).
    pub rank: usize,
    pub reason: String,
}

impl Failure {
    pub fn error(&self) -> Error {
        Error::PeerFailed { rank: self.rank, reason: self.reason.clone() }
    }
}

/// Groups are shared by every rank that names the same tag and rank list.
pub(super) type GroupKey = (String, Vec<usize>);

/// What every rank of one in-process world shares.
#[derive(Debug)]
pub(super) struct World {
    pub size: usize,
    pub timeout: Duration,
    failure: OnceLock<Failure>,
    groups: Mutex<HashMap<GroupKey, Arc<GroupState>>>,
}

impl World {
    pub fn new(size: usize, timeout: Duration) -> Self {
        World { size, timeout, failure: OnceLock::new(), groups: Mutex::default() }
    }

    /// The failure that stopped the world, if any.
    pub fn failure(&self) -> Option<&Failure> {
        self.failure.get()
    }

    /// Stops the world: every pending and later wait of every group returns
    /// [`Error::PeerFailed`] naming `rank`. Only the first call has effect.
    pub fn fail(&self, rank: usize, reason: String) {
        if self.failure.set(Failure { rank, reason }).is_err() {
            return;
        }
        let groups: Vec<_> = self.groups.lock().values().cloned().collect();
        for g in groups {
            // Taking the group's lock before notifying guarantees that no
            // waiter is between its failure check and its wait, so none
            // misses the wake-up.
            let _g = g.inner.lock();
            g.cv.notify_all();
        }
    }

    /// The group of `ranks` under `tag`, created on first request.
    pub fn group(&self, tag: &str, ranks: &[usize]) -> Arc<GroupState> {
        let key = (tag.to_string(), ranks.to_vec());
        self.groups.lock().entry(key).or_insert_with(|| Arc::new(GroupState::new(ranks.to_vec()))).clone()
    }
}

/// One rank's contribution to a collective step.
pub(super) struct Post {
    /// The call, at a collective's first step; `None` at its later steps
    /// (the call was matched at the first).
    pub call: Option<Call>,
    /// Why this rank's own arguments are invalid: posted anyway so the peers
    /// fail at once with a clear message instead of timing out.
    pub invalid: Option<String>,
    pub data: Payload,
}

/// The tensors a step shares: read by the peers, never written, except an
/// all-reduce's result buffers, which the peers fill.
pub(super) enum Payload {
    None,
    One(Tensor),
    Many(Vec<Tensor>),
    /// An all-reduce's input, and the result buffer every rank writes its
    /// summed chunk into.
    Reduce(Tensor, Arc<Landing>),
}

impl Post {
    pub fn phase(data: Payload) -> Self {
        Post { call: None, invalid: None, data }
    }
}

impl fmt::Display for Post {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some(call) = &self.call else { return f.write_str("a later step of a collective") };
        write!(f, "{call}")?;
        if let Payload::Many(parts) = &self.data {
            write!(f, " of {} parts", parts.len())?;
        }
        Ok(())
    }
}

/// The posts of one step, kept until every member has taken them.
struct Slot {
    posts: Vec<Option<Arc<Post>>>,
    posted: usize,
    taken: usize,
}

/// The shared state of one group.
pub(super) struct GroupState {
    /// World ranks of the members, in group-rank order.
    pub ranks: Vec<usize>,
    inner: Mutex<Inner>,
    cv: Condvar,
}

#[derive(Default)]
struct Inner {
    /// Pending steps by step number; each member numbers its steps itself,
    /// and all members take the same steps in the same order.
    board: HashMap<u64, Slot>,
    /// Members with a live communicator, and the device each receives on.
    attached: Vec<Option<Device>>,
    /// Why a member left (its communicator was dropped).
    departed: Vec<Option<String>>,
    /// Point-to-point messages by (sender, receiver) member, in send order.
    mail: HashMap<(usize, usize), VecDeque<Tensor>>,
}

impl fmt::Debug for GroupState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GroupState").field("ranks", &self.ranks).finish_non_exhaustive()
    }
}

impl GroupState {
    fn new(ranks: Vec<usize>) -> Self {
        let n = ranks.len();
        let inner = Inner { attached: vec![None; n], departed: vec![None; n], ..Inner::default() };
        GroupState { ranks, inner: Mutex::new(inner), cv: Condvar::new() }
    }

    pub fn size(&self) -> usize {
        self.ranks.len()
    }

    /// Registers member `me` with the device its received messages go to.
    pub fn attach(&self, me: usize, device: &Device) -> Result<()> {
        let mut g = self.inner.lock();
        if g.attached[me].is_some() || g.departed[me].is_some() {
            return Err(Error::state_mismatch(
                "communicator",
                format!("rank {} already has a communicator for group {:?}; create one per rank and share it (it is `Sync`)", self.ranks[me], self.ranks),
            ));
        }
        g.attached[me] = Some(device.clone());
        Ok(())
    }

    /// Member `me` leaves: the peers' waits that still need it fail.
    pub fn depart(&self, me: usize, reason: String) {
        let mut g = self.inner.lock();
        g.attached[me] = None;
        g.departed[me] = Some(reason);
        self.cv.notify_all();
    }

    /// Posts member `me`'s contribution to step `step` and waits until every
    /// member has posted; returns all posts in member order.
    pub fn exchange(&self, world: &World, op: &'static str, me: usize, step: u64, post: Post) -> Result<Vec<Arc<Post>>> {
        let n = self.size();
        let mut g = self.inner.lock();
        if let Some(f) = world.failure() {
            return Err(f.error());
        }
        let slot = g.board.entry(step).or_insert_with(|| Slot { posts: vec![None; n], posted: 0, taken: 0 });
        slot.posts[me] = Some(Arc::new(post));
        slot.posted += 1;
        if slot.posted == n {
            self.cv.notify_all();
        }
        let start = Instant::now();
        loop {
            let slot = g.board.get_mut(&step).expect("a step stays on the board until this member takes it");
            if slot.posted == n {
                let posts = slot.posts.iter().map(|p| p.clone().expect("every member posted")).collect();
                slot.taken += 1;
                if slot.taken == n {
                    g.board.remove(&step);
                }
                return Ok(posts);
            }
            if let Some(f) = world.failure() {
                return Err(f.error());
            }
            let missing: Vec<usize> = (0..n).filter(|&i| slot.posts[i].is_none()).collect();
            if let Some(&i) = missing.iter().find(|&&i| g.departed[i].is_some()) {
                let reason = g.departed[i].clone().unwrap_or_default();
                return Err(Error::PeerFailed { rank: self.ranks[i], reason });
            }
            let waited = start.elapsed();
            if waited >= world.timeout {
                drop(g);
                let missing: Vec<usize> = missing.iter().map(|&i| self.ranks[i]).collect();
                let detail = format!("rank {} of group {:?} waited for rank(s) {missing:?}, which never reached this collective", self.ranks[me], self.ranks);
                world.fail(self.ranks[me], format!("it gave up waiting in {op} after {waited:?}: {detail}"));
                return Err(Error::Timeout { op, waited, detail });
            }
            self.cv.wait_for(&mut g, world.timeout - waited);
        }
    }

    /// The device member `peer` receives on, if it has a communicator.
    pub fn device_of(&self, peer: usize) -> Option<Device> {
        self.inner.lock().attached[peer].clone()
    }

    /// Queues `msg` from member `from` to member `to`.
    pub fn post_message(&self, world: &World, from: usize, to: usize, msg: Tensor) -> Result<()> {
        let mut g = self.inner.lock();
        if let Some(f) = world.failure() {
            return Err(f.error());
        }
        if let Some(reason) = &g.departed[to] {
            return Err(Error::PeerFailed { rank: self.ranks[to], reason: reason.clone() });
        }
        g.mail.entry((from, to)).or_default().push_back(msg);
        self.cv.notify_all();
        Ok(())
    }

    /// Takes the next message from member `from` to member `to`, waiting for it.
    pub fn take_message(&self, world: &World, from: usize, to: usize) -> Result<Tensor> {
        let mut g = self.inner.lock();
        let start = Instant::now();
        loop {
            if let Some(msg) = g.mail.get_mut(&(from, to)).and_then(VecDeque::pop_front) {
                return Ok(msg);
            }
            if let Some(f) = world.failure() {
                return Err(f.error());
            }
            if let Some(reason) = &g.departed[from] {
                return Err(Error::PeerFailed { rank: self.ranks[from], reason: reason.clone() });
            }
            let waited = start.elapsed();
            if waited >= world.timeout {
                drop(g);
                let detail =
                    format!("rank {} of group {:?} waited for a message from rank {} that was never sent", self.ranks[to], self.ranks, self.ranks[from]);
                world.fail(self.ranks[to], format!("it gave up waiting in recv after {waited:?}: {detail}"));
                return Err(Error::Timeout { op: "recv", waited, detail });
            }
            self.cv.wait_for(&mut g, world.timeout - waited);
        }
    }
}
