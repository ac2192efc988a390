//! In-process communicators: every rank is a thread of one process.
//!
//! [`InProcess`] is the state a world of ranks shares; each rank thread asks
//! it for the communicator of every group it belongs to (the world, or a
//! sub-group such as one tensor-parallel group of a mesh axis) and uses it
//! through the [`Communicator`](crate::Communicator) trait, exactly as it would use a
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
//! default). A rank that calls [`Communicator::abort`](crate::Communicator::abort), panics (its
//! communicator is dropped while unwinding), or gives up waiting stops the
//! whole world: every pending and later call on every rank returns
//! [`Error::PeerFailed`] naming it. A rank that drops its communicator
//! normally leaves only that group: its peers' calls that still need it
//! fail the same way. Mismatched calls are detected at the first step of
//! every collective and reported on every rank as
//! [`Error::CollectiveMismatch`].

mod collectives;
mod landing;
mod state;

use crate::groups::check_members;
use crate::host_comm::HostComm;
use collectives::Core;
use state::{GroupState, World};
use std::sync::Arc;
use std::time::Duration;
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
    /// receives with [`Communicator::recv`](crate::Communicator::recv) are allocated on `device`, which
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
        check_members("InProcess::group", self.world.size, ranks)?;
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
    /// receives with [`Communicator::recv`](crate::Communicator::recv) are allocated on `device`. An
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
        Ok(HostComm::new(Core::new(self.world.clone(), self.state.clone(), me, device.clone())))
    }
}

/// One rank's communicator in an in-process group.
///
/// Synchronous calls run on the calling thread, asynchronous ones in order on
/// a background thread (see [`HostComm`]). Dropping it finishes the queued
/// calls, then leaves the group; dropped while its thread panics, it stops
/// the world so no peer waits for it.
pub type InProcessComm = HostComm<Core>;

impl HostComm<Core> {
    /// The device received messages are allocated on.
    pub fn device(&self) -> &Device {
        self.core().device()
    }
}

/// The communicators of world rank `rank` for every axis of `mesh` (its
/// tensor-, data-, pipeline- and expert-parallel groups) and for its data
/// replicas, each group tagged with its axis so that groups with the same
/// members stay independent.
pub fn mesh_groups(world: &InProcess, mesh: &crate::mesh::Mesh, rank: usize, device: &Device) -> Result<crate::Groups> {
    let n = world.world_size();
    let world_is = format!("the in-process world has {n}");
    crate::Groups::of_mesh(mesh, rank, (n, &world_is, "build both for the same world"), |tag, members| {
        Ok(Arc::new(world.tagged_group(tag, members)?.communicator(rank, device)?))
    })
}
