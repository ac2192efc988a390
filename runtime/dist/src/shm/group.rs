//! One group's segment: where its members meet for each step of a
//! collective, and their point-to-point rings.
//!
//! # Layout
//!
//! ```text
//! header    magic, version, members, job, group, sizes; attach count; the bell
//! members   per member: process id, state (attached, left), steps posted, step tags
//! calls     per member, two halves: the collective called and its arguments
//! staging   per member, two halves of `half` bytes: data the peers read
//! rings     per ordered pair of members: a ring of `ring` bytes of messages
//! ```
//!
//! # Steps
//!
//! Every collective is a sequence of steps, numbered per member from the
//! group's creation. For step `s` a member writes what its peers need into
//! its half `s mod 2` (call and staging), then *posts* the step: it stores
//! `s + 1` in its counter (release) and rings the bell. It then waits until
//! every peer's counter reaches `s + 1` (acquire) and reads their halves
//! `s mod 2`. A member writes half `s mod 2` again only at step `s + 2`,
//! after it has seen every peer post step `s + 1`, which each does only
//! once it has read what it needed of step `s`: two halves are enough for
//! no write ever to meet a read, with one wait per step.
//!
//! # Waiting
//!
//! A waiter checks its condition, spins for a moment when the machine has a
//! core for every member, yields, and then sleeps on the bell (a futex in
//! the segment, shared by every process that maps it) in short slices.
//! Between slices it looks for the job's failure, for the peers it waits
//! for having left the group, and every few slices for their processes
//! having died; past the timeout it declares the missing peer failed.

use super::arena::PeerArena;
use super::node::{shm_error, Bell, Node};
use super::segment::{align_up, Segment};
use super::sys;
use crate::call::MAX_DIMS;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use tessera_core::{Error, Result};

const MAGIC: u64 = 0x5445_5353_4752_5550; // "TESSGRUP"
const VERSION: u32 = 1;
const PAGE: usize = 4096;

// Header offsets.
const OFF_MAGIC: usize = 0;
const OFF_VERSION: usize = 8;
const OFF_N: usize = 12;
const OFF_JOB: usize = 16;
const OFF_GROUP: usize = 24;
const OFF_HALF: usize = 32;
const OFF_RING: usize = 40;
const OFF_ATTACHED: usize = 48;
const OFF_BELL: usize = 52;
const OFF_WAITERS: usize = 56;
const HEADER: usize = 256;

// Per-member record offsets.
const MEMBER: usize = 64;
const M_PID: usize = 0;
const M_STATE: usize = 4;
const M_POSTED: usize = 8;
const M_TAG: usize = 16;

/// A member's state.
const ATTACHED: u32 = 1;
const LEFT: u32 = 2;

/// A ring's control block: the sender's count of bytes written, the
/// receiver's count of bytes consumed (each on its own cache line), the
/// ring's bell and its sleepers.
pub(super) const RING_HEAD: usize = 0;
pub(super) const RING_TAIL: usize = 64;
pub(super) const RING_BELL: usize = 128;
pub(super) const RING_WAITERS: usize = 132;
pub(super) const RING_CONTROL: usize = 256;

/// Bytes of a call's fixed part: codes and the caller's tensor.
pub(super) const CALL_FIXED: usize = 64 + 8 + 8 * MAX_DIMS;
/// Bytes of the reason a call is invalid, at most.
pub(super) const CALL_TEXT: usize = 1024;
/// Bytes per part of an all-to-all (dtype, rank, dimensions).
pub(super) const CALL_PART: usize = 8 + 8 * MAX_DIMS;

/// Where each area of a group of `n` members lies.
#[derive(Clone, Copy, Debug)]
pub(super) struct Layout {
    pub n: usize,
    /// Bytes of one staging half.
    pub half: usize,
    /// Bytes of one ring's data.
    pub ring: usize,
    /// Bytes of one call record.
    pub call: usize,
    calls: usize,
    staging: usize,
    rings: usize,
    pub total: usize,
}

impl Layout {
    /// The layout of a group of `n` members: staging halves of 8 MiB over
    /// the group, at most 4 MiB each (16 MiB of staging for 2 to 8 members;
    /// down to 256 KiB a half for large groups; 64 KiB for a group of one,
    /// which stages nothing), and rings sharing about 1 MiB per member
    /// between its peers. Fewer, larger rounds mean fewer steps, each a
    /// wait for the slowest member; a round must still fit the caches
    /// between the member that stages it and the ones that read it.
    pub(super) fn new(n: usize) -> Layout {
        let half = if n == 1 { 64 << 10 } else { align_up((8 << 20) / n, 64 << 10).clamp(256 << 10, 4 << 20) };
        let ring = if n == 1 { 0 } else { align_up((1 << 20) / (n - 1), 64 << 10).clamp(64 << 10, 512 << 10) };
        let call = align_up(CALL_FIXED + CALL_TEXT + n * CALL_PART, 64);
        let calls = align_up(HEADER + n * MEMBER, PAGE);
        let staging = align_up(calls + 2 * n * call, PAGE);
        let rings = staging + 2 * n * half;
        let total = rings + n * (n - 1) * (RING_CONTROL + ring);
        Layout { n, half, ring, call, calls, staging, rings, total }
    }

    fn member(&self, m: usize) -> usize {
        HEADER + m * MEMBER
    }

    /// Member `m`'s call record for steps of parity `h`.
    pub(super) fn call_at(&self, m: usize, h: usize) -> usize {
        self.calls + (2 * m + h) * self.call
    }

    /// Member `m`'s staging half for steps of parity `h`.
    pub(super) fn staging_at(&self, m: usize, h: usize) -> usize {
        self.staging + (2 * m + h) * self.half
    }

    /// The control block of the ring from member `from` to member `to`; its
    /// data follows.
    pub(super) fn ring_at(&self, from: usize, to: usize) -> usize {
        debug_assert!(from != to);
        let pair = from * (self.n - 1) + if to > from { to - 1 } else { to };
        self.rings + pair * (RING_CONTROL + self.ring)
    }
}

/// One member's view of its group's segment.
pub(super) struct Group {
    pub seg: Segment,
    /// The group's identity (its tag and members, hashed).
    pub id: u64,
    pub lay: Layout,
    pub node: Arc<Node>,
    /// The members' world ranks, in group-rank order.
    pub ranks: Vec<usize>,
    /// This member's index.
    pub me: usize,
    /// Spin before sleeping: the machine has a core for every member.
    spin: bool,
    /// Every member's arena, mapped (this member's own as `None`), once
    /// known; `None` if a member has none or one cannot be mapped.
    arenas: OnceLock<Option<Vec<Option<Arc<PeerArena>>>>>,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group").field("ranks", &self.ranks).field("me", &self.me).field("segment", &self.seg).finish()
    }
}

impl Bell for Group {
    fn ring(&self) {
        ring(self.seg.u32(OFF_BELL), self.seg.u32(OFF_WAITERS));
    }
}

/// Wakes the sleepers of `bell` after a change they may wait for.
pub(super) fn ring(bell: &AtomicU32, waiters: &AtomicU32) {
    bell.fetch_add(1, Ordering::SeqCst);
    if waiters.load(Ordering::SeqCst) > 0 {
        sys::wake(bell);
    }
}

/// How long a sleeper sleeps before it looks for failures.
const SLICE: Duration = Duration::from_millis(10);
/// How often a waiter checks that the processes it waits for still run.
const LIVENESS: Duration = Duration::from_millis(50);
/// How long a waiter spins before it sleeps, when it may: a few
/// microseconds catch a peer that is about to post, while spinning longer
/// only keeps the core from a peer that needs it (with 30 µs, a step on a
/// busy two-core machine took 33 µs instead of 3).
const SPIN: Duration = Duration::from_micros(5);

/// Who a wait waits for, as errors name them.
pub(super) enum Awaited {
    /// The peers that have not posted the step.
    Step(u64),
    /// The sender of a ring (a message), or its receiver (room in it).
    Peer(usize),
}

impl Group {
    /// The peers' arenas by member (this member's own as `None`), if this
    /// member has an arena and can map every peer's: then the group may
    /// work in place (see `arena`).
    pub(super) fn arenas(&self) -> Option<&[Option<Arc<PeerArena>>]> {
        self.arenas
            .get_or_init(|| {
                self.node.arena.as_ref()?;
                self.ranks.iter().enumerate().map(|(m, &r)| if m == self.me { Some(None) } else { self.node.peer_arena(r).map(Some) }).collect()
            })
            .as_deref()
    }

    /// Maps (creating it if no member has yet) the segment of group `id`
    /// whose members are the world ranks `ranks`, as member `me`; the last
    /// member to map it removes its name.
    pub(super) fn attach(node: Arc<Node>, id: u64, ranks: Vec<usize>, me: usize) -> Result<Arc<Group>> {
        let n = ranks.len();
        let lay = Layout::new(n);
        let name = format!("{}g{id:016x}", node.prefix);
        let job = node.job;
        let (seg, _) = Segment::create_or_open(&node.dir, &name, lay.total, |s| {
            s.u32(OFF_VERSION).store(VERSION, Ordering::Relaxed);
            s.u32(OFF_N).store(n as u32, Ordering::Relaxed);
            s.u64(OFF_JOB).store(job, Ordering::Relaxed);
            s.u64(OFF_GROUP).store(id, Ordering::Relaxed);
            s.u64(OFF_HALF).store(lay.half as u64, Ordering::Relaxed);
            s.u64(OFF_RING).store(lay.ring as u64, Ordering::Relaxed);
            s.u64(OFF_MAGIC).store(MAGIC, Ordering::Release);
        })
        .map_err(|e| shm_error(&node.dir.join(&name), &format!("create or map the segment of group {ranks:?} ({} bytes)", lay.total), e))?;
        let ok = seg.u64(OFF_MAGIC).load(Ordering::Acquire) == MAGIC
            && seg.u32(OFF_VERSION).load(Ordering::Relaxed) == VERSION
            && seg.u32(OFF_N).load(Ordering::Relaxed) as usize == n
            && seg.u64(OFF_JOB).load(Ordering::Relaxed) == job
            && seg.u64(OFF_GROUP).load(Ordering::Relaxed) == id
            && seg.u64(OFF_HALF).load(Ordering::Relaxed) == lay.half as u64
            && seg.u64(OFF_RING).load(Ordering::Relaxed) == lay.ring as u64;
        if !ok {
            return Err(Error::topology(
                "ShmWorld::group",
                format!("{} does not hold group {ranks:?} of this job: a rank of another version, or another program, made it", seg.path().display()),
            ));
        }
        let m = lay.member(me);
        seg.u32(m + M_PID).store(std::process::id(), Ordering::Relaxed);
        if seg.u32(m + M_STATE).swap(ATTACHED, Ordering::AcqRel) != 0 {
            return Err(Error::state_mismatch("ShmWorld::group", format!("rank {} already has a communicator for group {ranks:?}", ranks[me])));
        }
        if seg.u32(OFF_ATTACHED).fetch_add(1, Ordering::AcqRel) as usize + 1 == n {
            seg.unlink();
        }
        let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
        let g = Arc::new(Group { seg, id, lay, node: node.clone(), ranks, me, spin: cores >= n && n > 1, arenas: OnceLock::new() });
        let weak: std::sync::Weak<dyn Bell> = Arc::downgrade(&(g.clone() as Arc<dyn Bell>));
        node.add_bell(weak);
        Ok(g)
    }

    pub(super) fn n(&self) -> usize {
        self.lay.n
    }

    fn posted(&self, m: usize) -> &AtomicU64 {
        self.seg.u64(self.lay.member(m) + M_POSTED)
    }

    fn tag(&self, m: usize, h: usize) -> &AtomicU64 {
        self.seg.u64(self.lay.member(m) + M_TAG + 8 * h)
    }

    fn state(&self, m: usize) -> u32 {
        self.seg.u32(self.lay.member(m) + M_STATE).load(Ordering::Acquire)
    }

    /// Leaves the group: the peers' waits that still need this member fail.
    pub(super) fn leave(&self) {
        self.seg.u32(self.lay.member(self.me) + M_STATE).store(LEFT, Ordering::Release);
        self.ring();
    }

    /// Posts step `s` of this member, tagged `tag` (the collective's number
    /// and the step's place in it), and waits until every peer has posted
    /// it; then checks that all tagged it alike. `op` names the wait in
    /// errors.
    pub(super) fn step(&self, op: &'static str, s: u64, tag: u64) -> Result<()> {
        let h = (s % 2) as usize;
        self.tag(self.me, h).store(tag, Ordering::Relaxed);
        self.posted(self.me).store(s + 1, Ordering::Release);
        self.ring();
        let n = self.n();
        self.wait(op, Awaited::Step(s), self.seg.u32(OFF_BELL), self.seg.u32(OFF_WAITERS), || (0..n).all(|m| self.posted(m).load(Ordering::Acquire) > s))?;
        if let Some(m) = (0..n).find(|&m| self.tag(m, h).load(Ordering::Relaxed) != tag) {
            let theirs = self.tag(m, h).load(Ordering::Relaxed);
            return Err(Error::CollectiveMismatch {
                op,
                detail: format!(
                    "rank {} is at collective #{} (step {}) of this group but rank {} at #{} (step {}): a rank skipped or added a collective",
                    self.ranks[self.me],
                    tag >> 32,
                    tag & 0xffff_ffff,
                    self.ranks[m],
                    theirs >> 32,
                    theirs & 0xffff_ffff
                ),
            });
        }
        Ok(())
    }

    /// Waits until `ready()`, sleeping on `bell`: fails with the job's
    /// failure, when an awaited peer left or died, or past the timeout (then
    /// the awaited peer is declared failed, so that every rank stops).
    pub(super) fn wait(&self, op: &'static str, awaited: Awaited, bell: &AtomicU32, waiters: &AtomicU32, ready: impl Fn() -> bool) -> Result<()> {
        if ready() {
            return Ok(());
        }
        let start = Instant::now();
        if self.spin {
            while start.elapsed() < SPIN {
                for _ in 0..64 {
                    std::hint::spin_loop();
                }
                if ready() {
                    return Ok(());
                }
            }
        }
        for _ in 0..2 {
            std::thread::yield_now();
            if ready() {
                return Ok(());
            }
        }
        let timeout = self.node.timeout;
        let mut next_check = start + LIVENESS;
        loop {
            waiters.fetch_add(1, Ordering::SeqCst);
            let seen = bell.load(Ordering::SeqCst);
            if ready() {
                waiters.fetch_sub(1, Ordering::SeqCst);
                return Ok(());
            }
            let waited = start.elapsed();
            if waited < timeout && self.node.failure().is_none() {
                sys::wait(bell, seen, SLICE.min(timeout - waited));
            }
            waiters.fetch_sub(1, Ordering::SeqCst);
            if ready() {
                return Ok(());
            }
            if let Some(e) = self.node.failure() {
                return Err(e);
            }
            let missing = self.missing(&awaited);
            if let Some(&m) = missing.iter().find(|&&m| self.state(m) == LEFT) {
                // A peer that left because the job failed recorded the
                // failure before leaving: that is the root cause.
                if let Some(e) = self.node.failure() {
                    return Err(e);
                }
                return Err(Error::PeerFailed {
                    rank: self.ranks[m],
                    reason: format!("it left the job (its communicator for group {:?} was dropped) while this rank still needed it", self.ranks),
                });
            }
            let now = Instant::now();
            if now >= next_check {
                next_check = now + LIVENESS;
                if let Some(&m) = missing.iter().find(|&&m| !self.node.alive(self.ranks[m])) {
                    let rank = self.ranks[m];
                    let pid = self.node.pids[rank];
                    self.node.fail(rank, format!("its process (pid {pid}) exited or was killed while rank {} waited for it in {op}", self.ranks[self.me]));
                    return Err(self.node.failure().unwrap_or(Error::PeerFailed { rank, reason: "its process exited or was killed".into() }));
                }
            }
            let waited = now - start;
            if waited >= timeout {
                let names: Vec<usize> = missing.iter().map(|&m| self.ranks[m]).collect();
                let me = self.ranks[self.me];
                let first = names.first().copied().unwrap_or(me);
                self.node.fail(
                    first,
                    format!("sent nothing for {waited:?} while rank {me} waited for its {op}: it hangs, is stuck outside the collectives, or is far slower than its peers"),
                );
                return Err(Error::Timeout {
                    op,
                    waited,
                    detail: format!("rank {me} of group {:?} waited for rank(s) {names:?}, which never reached this step; declared rank {first} failed so that every rank stops", self.ranks),
                });
            }
        }
    }

    fn missing(&self, awaited: &Awaited) -> Vec<usize> {
        match *awaited {
            Awaited::Step(s) => (0..self.n()).filter(|&m| self.posted(m).load(Ordering::Acquire) <= s).collect(),
            Awaited::Peer(m) => vec![m],
        }
    }

    /// Whether member `m` has left the group.
    pub(super) fn has_left(&self, m: usize) -> bool {
        self.state(m) == LEFT
    }

    /// The staging half of member `m` for step `s`, to read.
    ///
    /// # Safety
    ///
    /// Only between seeing `m` post step `s` and posting step `s + 1`
    /// (see the module documentation).
    pub(super) unsafe fn staged(&self, m: usize, s: u64, off: usize, len: usize) -> &[u8] {
        assert!(off + len <= self.lay.half, "staging read past its half");
        // SAFETY: by the caller's contract, `m` does not write this half now.
        unsafe { self.seg.bytes(self.lay.staging_at(m, (s % 2) as usize) + off, len) }
    }

    /// This member's staging half for step `s`, to write.
    ///
    /// # Safety
    ///
    /// Only before posting step `s`, after seeing every peer post step
    /// `s - 1`, and no other borrow of the same half may live.
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn stage(&self, s: u64, off: usize, len: usize) -> &mut [u8] {
        assert!(off + len <= self.lay.half, "staging write past its half");
        // SAFETY: by the caller's contract, no peer reads this half now.
        unsafe { self.seg.bytes_mut(self.lay.staging_at(self.me, (s % 2) as usize) + off, len) }
    }

    /// Member `m`'s call record for step `s`, to read (same contract as
    /// [`staged`](Self::staged)).
    pub(super) unsafe fn call(&self, m: usize, s: u64) -> &[u8] {
        // SAFETY: as for `staged`.
        unsafe { self.seg.bytes(self.lay.call_at(m, (s % 2) as usize), self.lay.call) }
    }

    /// This member's call record for step `s`, to write (same contract as
    /// [`stage`](Self::stage)).
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn call_mut(&self, s: u64) -> &mut [u8] {
        // SAFETY: as for `stage`.
        unsafe { self.seg.bytes_mut(self.lay.call_at(self.me, (s % 2) as usize), self.lay.call) }
    }
}
