//! In-process communicators: every rank is a thread of one process.
//!
//! [`InProcess`] is the state a world of ranks shares; each rank thread asks
//! it for the communicator of every group it belongs to (the world, or a
//! sub-group such as one tensor-parallel group of a mesh axis) and uses it
//! through the [`Communicator`] trait, exactly as it would use a
//! communicator between processes or GPUs.
//!
//! ```
//! use tessera::dist::{inproc::InProcess, Communicator};
//! use tessera::{Device, Tensor};
//!
//! let world = InProcess::new(2).unwrap();
//! let sums: Vec<Vec<f32>> = std::thread::scope(|s| {
//!     let threads: Vec<_> = (0..2)
//!         .map(|rank| {
//!             let world = world.clone();
//!             s.spawn(move || {
//!                 let dev = Device::cpu();
//!                 let comm = world.communicator(rank, &dev).unwrap();
//!                 let x = Tensor::from_vec(vec![rank as f32 + 1.0; 3], [3], &dev).unwrap();
//!                 comm.all_reduce_sum(&x).unwrap().to_vec::<f32>().unwrap()
//!             })
//!         })
//!         .collect();
//!     threads.into_iter().map(|t| t.join().unwrap()).collect()
//! });
//! assert_eq!(sums, vec![vec![3.0; 3], vec![3.0; 3]]);
//! ```
//!
//! # Algorithms
//!
//! The ranks share memory, so a collective does not pass chunks around a
//! ring: each rank publishes its (contiguous) input on a per-group board and
//! reads what it needs straight from its peers' tensors.
//!
//! - **all-reduce** is a reduce-scatter whose sums go straight to every
//!   rank: each rank allocates its result before the first step and posts
//!   it with its input, and rank `r` sums chunk `r` (elements
//!   `r·N/n .. (r+1)·N/n`) of all `n` inputs and writes each block of the sum
//!   into all `n` results while the block is in its cache. Each rank reads
//!   `N` and writes `N` elements, what copying the result would cost and
//!   less than a ring's `2(n−1)/n·N` each way, with two synchronisations
//!   instead of `2(n−1)`.
//! - **reduce-scatter** is the first phase alone, **all-gather** the second.
//! - **broadcast**, **all-to-all** and **send/recv** copy straight from the
//!   sender's tensor into a new tensor on the receiver's device.
//!
//! Each element of a sum is computed by exactly one rank, adding the inputs
//! in rank order in `f32` (`f64` for `f64`) and rounding once, and everyone
//! else copies it: every rank gets bit-identical results, whatever the
//! thread timing. A rank's result is allocated on its own device (the device
//! of the tensor it passed in), so memory accounting sees received bytes
//! where they land.
//!
//! A collective that reads a rank's input returns on that rank only once
//! every peer is done reading it, so the input may be modified in place as
//! soon as the call returns (or, for an asynchronous call, once it is waited
//! for).
//!
//! # Failures
//!
//! Every wait has a deadline ([`InProcess::with_timeout`], 60 s by
//! default). A rank that calls [`Communicator::abort`], panics (its
//! communicator is dropped while unwinding), or gives up waiting stops the
//! whole world: every pending and later call on every rank returns
//! [`Error::PeerFailed`] naming it. A rank that drops its communicator
//! normally leaves only that group: its peers' calls that still need it
//! fail the same way. Mismatched calls are detected at the first step of
//! every collective and reported on every rank as
//! [`Error::CollectiveMismatch`].

mod landing;
mod state;

use super::comm::{Communicator, Pending};
use super::serial::{OnPanic, Serial};
use crate::host::{concat, cpu_device, elements, reduce, streams, sum_blocks, wrap, Summand};
use landing::Landing;
use state::{GroupState, Kind, Payload, Post, World};
use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Duration;
use tessera_core::tensor::{with_elem, Tensor};
use tessera_core::Device;
use tessera_core::{Error, Result};

/// The shared state of a world of ranks that are threads of this process.
///
/// Cheap to clone (clones share the world); hand one clone to every rank
/// thread, which then creates its communicators from it.
#[derive(Clone, Debug)]
pub struct InProcess {
    world: Arc<World>,
}

/// A group of ranks of an [`InProcess`] world: the world itself or one group
/// of a mesh axis. Each member creates its communicator with
/// [`communicator`](Self::communicator).
#[derive(Clone, Debug)]
pub struct Group {
    world: Arc<World>,
    state: Arc<GroupState>,
}

impl InProcess {
    /// How long a rank waits for its peers before giving up, unless set with
    /// [`with_timeout`](Self::with_timeout).
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

    /// A world of `world_size` ranks that wait at most
    /// [`DEFAULT_TIMEOUT`](Self::DEFAULT_TIMEOUT) for each other.
    pub fn new(world_size: usize) -> Result<Self> {
        Self::with_timeout(world_size, Self::DEFAULT_TIMEOUT)
    }

    /// A world of `world_size` ranks in which every wait (for the peers of a
    /// collective step, or for a message) gives up after `timeout` with
    /// [`Error::Timeout`] and stops the world.
    pub fn with_timeout(world_size: usize, timeout: Duration) -> Result<Self> {
        if world_size == 0 {
            return Err(Error::topology("InProcess::new", "a world needs at least one rank"));
        }
        Ok(InProcess { world: Arc::new(World::new(world_size, timeout)) })
    }

    /// Number of ranks in the world.
    pub fn world_size(&self) -> usize {
        self.world.size
    }

    /// How long each wait lasts at most.
    pub fn timeout(&self) -> Duration {
        self.world.timeout
    }

    /// The communicator of world rank `rank` for the whole world. Tensors it
    /// receives with [`Communicator::recv`] are allocated on `device`, which
    /// should be the rank's own device.
    ///
    /// Each rank creates it once (from its own thread or not); a second
    /// request for the same rank is an error.
    pub fn communicator(&self, rank: usize, device: &Device) -> Result<InProcessComm> {
        let all: Vec<usize> = (0..self.world.size).collect();
        self.tagged_group("world", &all)?.communicator(rank, device)
    }

    /// The group whose members are the world ranks `ranks`, in this order
    /// (member `i` has group rank `i`). Every rank that asks for the same
    /// list gets the same group; use [`tagged_group`](Self::tagged_group)
    /// when two mesh axes have the same members but must not share a
    /// group's ordering (their collectives may be issued in different
    /// orders, or concurrently).
    pub fn group(&self, ranks: &[usize]) -> Result<Group> {
        self.tagged_group("", ranks)
    }

    /// The group of `ranks` named `tag` (e.g. the mesh axis, `"tp"`): groups
    /// with different tags are independent even when their members are the
    /// same.
    pub fn tagged_group(&self, tag: &str, ranks: &[usize]) -> Result<Group> {
        if ranks.is_empty() {
            return Err(Error::topology("InProcess::group", "a group needs at least one rank"));
        }
        if let Some(&r) = ranks.iter().find(|&&r| r >= self.world.size) {
            return Err(Error::no_such_rank("InProcess::group", format!("rank {r} in {ranks:?} is not a rank of this world of {} ranks", self.world.size)));
        }
        let mut sorted = ranks.to_vec();
        sorted.sort_unstable();
        if sorted.windows(2).any(|w| w[0] == w[1]) {
            return Err(Error::topology("InProcess::group", format!("rank list {ranks:?} names a rank twice")));
        }
        Ok(Group { world: self.world.clone(), state: self.world.group(tag, ranks) })
    }

    /// Stops the world on behalf of `rank` (e.g. from a supervisor that saw
    /// the rank's thread fail): every pending and later call on every rank
    /// returns [`Error::PeerFailed`] naming `rank` and `reason`.
    pub fn abort(&self, rank: usize, reason: &str) {
        self.world.fail(rank, format!("aborted: {reason}"));
    }

    /// The error every rank's calls return once the world has stopped, or
    /// `Ok` while it runs.
    pub fn check(&self) -> Result<()> {
        self.world.failure().map_or(Ok(()), |f| Err(f.error()))
    }
}

impl Group {
    /// The members' world ranks, in group-rank order.
    pub fn ranks(&self) -> &[usize] {
        &self.state.ranks
    }

    /// Number of members.
    pub fn size(&self) -> usize {
        self.state.size()
    }

    /// The communicator of world rank `rank` in this group; tensors it
    /// receives with [`Communicator::recv`] are allocated on `device`. An
    /// error when `rank` is not a member or already has a communicator here.
    pub fn communicator(&self, rank: usize, device: &Device) -> Result<InProcessComm> {
        let me = self
            .state
            .ranks
            .iter()
            .position(|&r| r == rank)
            .ok_or_else(|| Error::no_such_rank("Group::communicator", format!("rank {rank} is not a member of group {:?}", self.state.ranks)))?;
        if let Device::Cuda(d) = device {
            return d.unsupported("the in-process communicator (CUDA ranks will communicate through NCCL)");
        }
        self.state.attach(me, device)?;
        let core = Core { world: self.world.clone(), group: self.state.clone(), me, device: device.clone(), step: AtomicU64::new(0) };
        let on_panic: OnPanic<Core> = Arc::new(|core, msg| core.world.fail(core.world_rank(), format!("its communication thread panicked: {msg}")));
        Ok(InProcessComm { serial: Serial::new(core, rank, on_panic) })
    }
}

/// One rank's communicator in an in-process group.
///
/// Synchronous calls run on the calling thread. Asynchronous calls run in
/// order on a background thread the communicator starts on first use; a
/// synchronous call issued while some are still queued waits its turn behind
/// them, which keeps every rank's calls in program order.
///
/// Dropping it finishes the queued calls, then leaves the group; dropped
/// while its thread panics, it stops the world so no peer waits for it.
pub struct InProcessComm {
    serial: Serial<Core>,
}

impl InProcessComm {
    /// This rank's index in the world (its group rank is [`Communicator::rank`]).
    pub fn world_rank(&self) -> usize {
        self.core().world_rank()
    }

    /// The world ranks of the group's members, in group-rank order.
    pub fn group_ranks(&self) -> &[usize] {
        &self.core().group.ranks
    }

    /// The device received messages are allocated on.
    pub fn device(&self) -> &Device {
        &self.core().device
    }

    fn core(&self) -> &Core {
        self.serial.core()
    }

    fn run<T: Send + 'static>(&self, op: &'static str, f: impl FnOnce(&Core) -> Result<T> + Send + 'static) -> Result<T> {
        self.serial.run(op, f)
    }

    fn submit<T: Send + 'static>(&self, op: &'static str, f: impl FnOnce(&Core) -> Result<T> + Send + 'static) -> Result<Pending<T>> {
        self.serial.submit(op, f)
    }
}

impl fmt::Debug for InProcessComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InProcessComm")
            .field("world_rank", &self.world_rank())
            .field("group", &self.core().group.ranks)
            .field("device", &self.core().device)
            .finish()
    }
}

impl Drop for InProcessComm {
    fn drop(&mut self) {
        let rank = self.world_rank();
        if thread::panicking() {
            self.core().world.fail(rank, "its thread panicked (that panic's message is the root cause)".into());
        }
        self.serial.shut_down();
        let core = self.core();
        core.group.depart(core.me, format!("its communicator for group {:?} was dropped while the other ranks still needed it", core.group.ranks));
    }
}

impl Communicator for InProcessComm {
    fn rank(&self) -> usize {
        self.core().me
    }
    fn size(&self) -> usize {
        self.core().group.size()
    }
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        let t = t.clone();
        self.run("all_reduce_sum", move |c| c.all_reduce(&t))
    }
    fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        let t = t.clone();
        self.run("all_gather", move |c| c.all_gather(&t, dim))
    }
    fn reduce_scatter_sum(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        let t = t.clone();
        self.run("reduce_scatter_sum", move |c| c.reduce_scatter(&t, dim))
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        let t = t.clone();
        self.run("broadcast", move |c| c.broadcast(&t, root))
    }
    fn all_to_all(&self, parts: Vec<Tensor>) -> Result<Vec<Tensor>> {
        self.run("all_to_all", move |c| c.all_to_all(parts))
    }
    fn barrier(&self) -> Result<()> {
        self.run("barrier", |c| c.barrier())
    }
    fn send(&self, t: &Tensor, peer: usize) -> Result<()> {
        self.core().send(t, peer)
    }
    fn recv(&self, peer: usize) -> Result<Tensor> {
        self.core().recv(peer)
    }
    fn all_reduce_sum_async(&self, t: &Tensor) -> Result<Pending> {
        let t = t.clone();
        self.submit("all_reduce_sum", move |c| c.all_reduce(&t))
    }
    fn all_gather_async(&self, t: &Tensor, dim: usize) -> Result<Pending> {
        let t = t.clone();
        self.submit("all_gather", move |c| c.all_gather(&t, dim))
    }
    fn reduce_scatter_sum_async(&self, t: &Tensor, dim: usize) -> Result<Pending> {
        let t = t.clone();
        self.submit("reduce_scatter_sum", move |c| c.reduce_scatter(&t, dim))
    }
    fn broadcast_async(&self, t: &Tensor, root: usize) -> Result<Pending> {
        let t = t.clone();
        self.submit("broadcast", move |c| c.broadcast(&t, root))
    }
    fn all_to_all_async(&self, parts: Vec<Tensor>) -> Result<Pending<Vec<Tensor>>> {
        self.submit("all_to_all", move |c| c.all_to_all(parts))
    }
    fn barrier_async(&self) -> Result<Pending<()>> {
        self.submit("barrier", |c| c.barrier())
    }
    fn abort(&self, reason: &str) {
        self.core().world.fail(self.world_rank(), format!("aborted: {reason}"));
    }
    fn failure(&self) -> Option<Error> {
        self.core().world.failure().map(|f| f.error())
    }
}

/// What a communicator's calls run on, shared with its background thread.
struct Core {
    world: Arc<World>,
    group: Arc<GroupState>,
    /// This rank's index in the group.
    me: usize,
    device: Device,
    /// The number of this rank's next collective step on the group's board.
    step: AtomicU64,
}

/// `p` if it holds host tensors only: the in-process communicator moves host
/// memory, so every collective rejects CUDA tensors at its first step (which
/// is what lets `data` assume CPU storage).
fn host_only(op: &'static str, p: Payload) -> Result<Payload> {
    let tensors: &[Tensor] = match &p {
        Payload::One(t) | Payload::Reduce(t, _) => std::slice::from_ref(t),
        Payload::Many(ts) => ts,
        Payload::None => &[],
    };
    for t in tensors {
        if let Device::Cuda(d) = t.device() {
            return d.unsupported(op);
        }
    }
    Ok(p)
}

/// Sums elements `mine` of every rank's input, in rank order, and writes
/// each block of the sum into every rank's result while it is in cache.
fn reduce_into_landings<T: Summand>(posts: &[Arc<Post>], mine: Range<usize>) {
    let guards: Vec<_> = posts.iter().map(|p| p.one().read()).collect();
    let srcs: Vec<&[T]> = guards.iter().zip(posts).map(|(g, p)| &elements::<T>(p.one(), g)[mine.clone()]).collect();
    let outs: Vec<&Landing> = posts.iter().map(|p| p.landing()).collect();
    let stream = streams(std::mem::size_of_val(srcs[0]) * posts.len());
    sum_blocks(&srcs, |at, block| {
        for o in &outs {
            o.write(mine.start + at, block, stream);
        }
    });
}

/// The element range of part `i` when `len` elements are cut into `n`
/// near-equal parts.
fn chunk(len: usize, n: usize, i: usize) -> Range<usize> {
    i * len / n..(i + 1) * len / n
}

impl Post {
    fn one(&self) -> &Tensor {
        match &self.data {
            Payload::One(t) | Payload::Reduce(t, _) => t,
            _ => unreachable!("the first step checked every rank posted a tensor"),
        }
    }

    fn landing(&self) -> &Landing {
        match &self.data {
            Payload::Reduce(_, out) => out,
            _ => unreachable!("the first step checked every rank posted its all-reduce result"),
        }
    }
}

impl Core {
    fn world_rank(&self) -> usize {
        self.group.ranks[self.me]
    }

    fn size(&self) -> usize {
        self.group.size()
    }

    /// One step on the group's board.
    fn exchange(&self, op: &'static str, post: Post) -> Result<Vec<Arc<Post>>> {
        let step = self.step.fetch_add(1, Ordering::Relaxed);
        self.group.exchange(&self.world, op, self.me, step, post)
    }

    /// The last step of a collective that read this rank's input: returns
    /// once every peer has finished reading it.
    fn release(&self, op: &'static str) -> Result<()> {
        self.exchange(op, Post::phase(Payload::None)).map(drop)
    }

    /// The first step of every collective: posts this rank's call, whether
    /// its own arguments are valid (`local`), and checks that every rank made
    /// the same call with agreeing arguments. Every rank reaches the same
    /// verdict, since all see the same posts.
    fn open(&self, op: &'static str, kind: Kind, t: Option<&Tensor>, local: Result<Payload>) -> Result<Vec<Arc<Post>>> {
        let local = local.and_then(|p| host_only(op, p));
        let meta = t.map(|t| (t.dtype(), t.dims().to_vec()));
        let (data, invalid, own_error) = match local {
            Ok(d) => (d, None, None),
            Err(e) => (Payload::None, Some(e.to_string()), Some(e)),
        };
        let posts = self.exchange(op, Post { kind, meta, invalid, data })?;
        let ranks = &self.group.ranks;
        let first = &posts[0];
        if let Some((i, p)) = posts.iter().enumerate().find(|(_, p)| p.kind != first.kind) {
            return Err(Error::CollectiveMismatch { op, detail: format!("rank {} called {first} while rank {} called {p}", ranks[0], ranks[i]) });
        }
        if let Some(e) = own_error {
            return Err(e);
        }
        if let Some((i, p)) = posts.iter().enumerate().find(|(_, p)| p.invalid.is_some()) {
            let why = p.invalid.as_deref().unwrap_or_default();
            return Err(Error::CollectiveMismatch { op, detail: format!("rank {} passed invalid arguments ({why})", ranks[i]) });
        }
        if t.is_some() {
            if let Some((i, p)) = posts.iter().enumerate().find(|(_, p)| p.meta != first.meta) {
                return Err(Error::CollectiveMismatch { op, detail: format!("rank {} called {first} but rank {} called {p}", ranks[0], ranks[i]) });
            }
        }
        Ok(posts)
    }

    fn all_reduce(&self, t: &Tensor) -> Result<Tensor> {
        const OP: &str = "all_reduce_sum";
        // Every rank allocates its result first and shows it to the others
        // with its input (see `landing`): rank `r` sums chunk `r` of every
        // input and writes it into every rank's result, so each rank reads
        // its share of the inputs once and writes `S` bytes in all.
        let local = t.contiguous().and_then(|c| host_only(OP, Payload::One(c)));
        let out = match &local {
            Ok(Payload::One(c)) => Some(Arc::new(Landing::new(cpu_device(c.device()), c.dtype(), c.elem_count()))),
            _ => None,
        };
        let local = local.map(|p| match (p, &out) {
            (Payload::One(c), Some(o)) => Payload::Reduce(c, o.clone()),
            (p, _) => p,
        });
        let posts = self.open(OP, Kind::AllReduce, Some(t), local)?;
        let mine = chunk(t.elem_count(), self.size(), self.me);
        with_elem!(t.dtype(), T => reduce_into_landings::<T>(&posts, mine));
        drop(posts);
        // Reaching this step means every rank has written its chunk into
        // every result and finished reading every input.
        self.release(OP)?;
        let out = out.expect("the first step checked this rank's input");
        let storage = Landing::finish(out)
            .map_err(|_| Error::state_mismatch(OP, "a peer still held this rank's result after the last step (a bug in the in-process communicator)"))?;
        Ok(wrap(storage, t.shape().clone(), cpu_device(t.device())))
    }

    fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        const OP: &str = "all_gather";
        let local = t.shape().dim(OP, dim).and_then(|_| t.contiguous()).map(Payload::One);
        let posts = self.open(OP, Kind::AllGather { dim }, Some(t), local)?;
        let dev = cpu_device(t.device());
        let dims = t.dims();
        let outer: usize = dims[..dim].iter().product();
        let block: usize = dims[dim..].iter().product();
        let pieces: Vec<(&Tensor, Range<usize>)> = (0..outer).flat_map(|o| posts.iter().map(move |p| (p.one(), o * block..(o + 1) * block))).collect();
        let mut out_dims = dims.to_vec();
        out_dims[dim] *= self.size();
        let out = wrap(concat(dev, t.dtype(), &pieces), out_dims, dev);
        drop(pieces);
        drop(posts);
        self.release(OP)?;
        Ok(out)
    }

    fn reduce_scatter(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        const OP: &str = "reduce_scatter_sum";
        let n = self.size();
        let local = t
            .shape()
            .dim(OP, dim)
            .and_then(|d| match d % n {
                0 => t.contiguous(),
                _ => Err(Error::shape(
                    OP,
                    format!("dimension {dim} of shape {} has size {d}, which does not split into {n} equal parts; pad it to a multiple of {n}", t.shape()),
                )),
            })
            .map(Payload::One);
        let posts = self.open(OP, Kind::ReduceScatter { dim }, Some(t), local)?;
        let dev = cpu_device(t.device());
        let dims = t.dims();
        let outer: usize = dims[..dim].iter().product();
        let block: usize = dims[dim..].iter().product();
        let part = block / n;
        let segments: Vec<Range<usize>> = (0..outer).map(|o| o * block + self.me * part..o * block + (self.me + 1) * part).collect();
        let inputs: Vec<(&Tensor, usize)> = posts.iter().map(|p| (p.one(), 0)).collect();
        let mut out_dims = dims.to_vec();
        out_dims[dim] /= n;
        let out = wrap(reduce(dev, t.dtype(), &inputs, &segments), out_dims, dev);
        drop(inputs);
        drop(posts);
        self.release(OP)?;
        Ok(out)
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        const OP: &str = "broadcast";
        let n = self.size();
        let local = if root >= n {
            Err(Error::no_such_rank(OP, format!("root {root} is not a rank of this group of {n} ranks")))
        } else if root == self.me {
            t.contiguous().map(Payload::One)
        } else {
            Ok(Payload::None)
        };
        let posts = self.open(OP, Kind::Broadcast { root }, Some(t), local)?;
        let out = if root == self.me {
            t.clone()
        } else {
            let dev = cpu_device(t.device());
            let src = posts[root].one();
            wrap(concat(dev, t.dtype(), &[(src, 0..src.elem_count())]), t.shape().clone(), dev)
        };
        drop(posts);
        self.release(OP)?;
        Ok(out)
    }

    fn all_to_all(&self, parts: Vec<Tensor>) -> Result<Vec<Tensor>> {
        const OP: &str = "all_to_all";
        let n = self.size();
        let local = if parts.len() != n {
            Err(Error::invalid(OP, format!("{} parts given; pass exactly one per rank of the group ({n})", parts.len())))
        } else {
            parts.iter().map(Tensor::contiguous).collect::<Result<Vec<_>>>().map(Payload::Many)
        };
        let posts = self.open(OP, Kind::AllToAll, None, local)?;
        let mine = &parts[self.me];
        let dev = cpu_device(mine.device());
        let out = posts
            .iter()
            .enumerate()
            .map(|(j, p)| {
                if j == self.me {
                    return mine.clone();
                }
                let Payload::Many(theirs) = &p.data else { unreachable!("checked at the first step") };
                let src = &theirs[self.me];
                wrap(concat(dev, src.dtype(), &[(src, 0..src.elem_count())]), src.shape().clone(), dev)
            })
            .collect();
        drop(posts);
        self.release(OP)?;
        Ok(out)
    }

    fn barrier(&self) -> Result<()> {
        self.open("barrier", Kind::Barrier, None, Ok(Payload::None)).map(drop)
    }

    fn check_peer(&self, op: &'static str, peer: usize) -> Result<()> {
        let n = self.size();
        if peer >= n {
            return Err(Error::no_such_rank(op, format!("peer {peer} is not a rank of this group of {n} ranks")));
        }
        if peer == self.me {
            return Err(Error::no_such_rank(op, format!("peer {peer} is this rank itself; keep the tensor instead of sending it")));
        }
        Ok(())
    }

    fn send(&self, t: &Tensor, peer: usize) -> Result<()> {
        self.check_peer("send", peer)?;
        if let Some(f) = self.world.failure() {
            return Err(f.error());
        }
        // Copied straight onto the receiver's device when it is known, so the
        // message is counted where it will live and needs no second copy.
        if let Device::Cuda(d) = t.device() {
            return d.unsupported("send");
        }
        let to = self.group.device_of(peer).unwrap_or_else(|| self.device.clone());
        let dev = cpu_device(&to);
        let src = t.contiguous()?;
        let msg = wrap(concat(dev, t.dtype(), &[(&src, 0..src.elem_count())]), t.shape().clone(), dev);
        self.group.post_message(&self.world, self.me, peer, msg)
    }

    fn recv(&self, peer: usize) -> Result<Tensor> {
        self.check_peer("recv", peer)?;
        let msg = self.group.take_message(&self.world, peer, self.me)?;
        if msg.device().same(&self.device) {
            return Ok(msg);
        }
        let dev = cpu_device(&self.device);
        Ok(wrap(concat(dev, msg.dtype(), &[(&msg, 0..msg.elem_count())]), msg.shape().clone(), dev))
    }
}

/// The communicators of world rank `rank` for every axis of `mesh` (its
/// tensor-, data-, pipeline- and expert-parallel groups) and for its data
/// replicas, each group tagged with its axis so that groups with the same
/// members stay independent.
pub fn mesh_groups(world: &InProcess, mesh: &crate::mesh::Mesh, rank: usize, device: &Device) -> Result<crate::Groups> {
    use crate::mesh::Axis;
    if world.world_size() != mesh.world() {
        return Err(Error::topology(
            "mesh_groups",
            format!("the mesh {mesh} has {} ranks but the in-process world has {}; build both for the same world", mesh.world(), world.world_size()),
        ));
    }
    let comm = |axis: Axis| -> Result<Arc<dyn Communicator>> {
        let members = mesh.group(axis, rank)?;
        Ok(Arc::new(world.tagged_group(axis.name(), &members)?.communicator(rank, device)?))
    };
    let replicas = Arc::new(world.tagged_group("replicas", &mesh.replica_group(rank)?)?.communicator(rank, device)?);
    Ok(crate::Groups { tp: comm(Axis::Tp)?, dp: comm(Axis::Dp)?, pp: comm(Axis::Pp)?, ep: comm(Axis::Ep)?, replicas })
}
