//! The communicator of every backend whose collectives run on host threads
//! (in-process, shared memory, TCP, MPI), written once over what differs
//! between them: the backend's state and algorithms ([`HostCore`]).
//!
//! What they share is the calling convention: a synchronous call runs on the
//! calling thread, an `*_async` call in order on a background thread
//! ([`Serial`]), point-to-point messages outside that order, and a panic on
//! either thread stops the job so that no peer waits for a rank that is gone.

use crate::comm::{Communicator, Pending};
use crate::serial::Serial;
use std::fmt;
use std::thread;
use tessera_core::tensor::Tensor;
use tessera_core::{Error, Result};

/// A backend's state and its algorithms, which [`HostComm`] runs in program
/// order. Every method is one rank's side of the operation of the same
/// name in [`Communicator`].
///
/// Public only to name the communicators' types ([`HostComm<C>`]); it
/// cannot be implemented outside this crate.
pub trait HostCore: Send + Sync + 'static {
    /// The communicator's name in its `Debug` form.
    const NAME: &'static str;

    /// This rank's index in the world.
    fn world_rank(&self) -> usize;
    /// The world ranks of the group's members, in group-rank order.
    fn group_ranks(&self) -> &[usize];
    /// This rank's index in the group.
    fn group_rank(&self) -> usize;

    /// See [`Communicator::all_reduce_sum`].
    fn all_reduce(&self, t: &Tensor) -> Result<Tensor>;
    /// See [`Communicator::all_gather`].
    fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor>;
    /// See [`Communicator::reduce_scatter_sum`].
    fn reduce_scatter(&self, t: &Tensor, dim: usize) -> Result<Tensor>;
    /// See [`Communicator::broadcast`].
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor>;
    /// See [`Communicator::all_to_all`].
    fn all_to_all(&self, parts: Vec<Tensor>) -> Result<Vec<Tensor>>;
    /// See [`Communicator::barrier`].
    fn barrier(&self) -> Result<()>;
    /// See [`Communicator::send`].
    fn send(&self, t: &Tensor, peer: usize) -> Result<()>;
    /// See [`Communicator::recv`].
    fn recv(&self, peer: usize) -> Result<Tensor>;

    /// Stops the job because this rank failed for `reason`: every waiting
    /// and later call of its peers fails naming it (or, where the backend
    /// cannot carry on after a failure, the job ends).
    fn fail(&self, reason: String);
    /// The failure that stopped the job, if one has.
    fn failure(&self) -> Option<Error>;
    /// Leaves the group when the communicator is dropped, after its queued
    /// calls have finished.
    fn close(&self);

    /// An error unless `peer` is a group rank other than this one (the
    /// check of [`Communicator::send`] and [`Communicator::recv`]).
    fn check_peer(&self, op: &'static str, peer: usize) -> Result<()> {
        let n = self.group_ranks().len();
        if peer >= n {
            return Err(Error::no_such_rank(op, format!("peer {peer} is not a rank of this group of {n} ranks")));
        }
        if peer == self.group_rank() {
            return Err(Error::no_such_rank(op, format!("peer {peer} is this rank itself; keep the tensor instead of sending it")));
        }
        Ok(())
    }

    /// An error unless `root` is a group rank (the check of
    /// [`Communicator::broadcast`]).
    fn check_root(&self, op: &'static str, root: usize) -> Result<()> {
        let n = self.group_ranks().len();
        if root >= n {
            return Err(Error::no_such_rank(op, format!("root {root} is not a rank of this group of {n} ranks")));
        }
        Ok(())
    }

    /// An error unless `parts` holds one tensor per group rank (the check of
    /// [`Communicator::all_to_all`]).
    fn check_parts(&self, op: &'static str, parts: &[Tensor]) -> Result<()> {
        let n = self.group_ranks().len();
        if parts.len() != n {
            return Err(Error::invalid(op, format!("{} parts given; pass exactly one per rank of the group ({n})", parts.len())));
        }
        Ok(())
    }
}

/// One rank's communicator in a group whose collectives run on host threads;
/// `C` is the backend ([`InProcessComm`](crate::inproc::InProcessComm),
/// [`ShmComm`](crate::shm::ShmComm),
/// [`ProcessComm`](crate::process::ProcessComm), `MpiComm`).
///
/// Synchronous calls run on the calling thread. Asynchronous calls run in
/// order on a background thread the communicator starts on first use; a
/// synchronous call issued while some are still queued waits its turn behind
/// them, which keeps every rank's calls in program order (see
/// [`Communicator`]'s ordering rules).
///
/// Dropping it finishes the queued calls (each bounded by the backend's
/// timeout), then leaves the group; dropped while its thread panics, it stops
/// the job, so no peer waits for it.
pub struct HostComm<C: HostCore> {
    serial: Serial<C>,
}

impl<C: HostCore> HostComm<C> {
    /// The communicator of world rank `core.world_rank()` over `core`.
    pub(crate) fn new(core: C) -> Self {
        let rank = core.world_rank();
        HostComm { serial: Serial::new(core, rank) }
    }

    /// This rank's index in the world (its group rank is [`Communicator::rank`]).
    pub fn world_rank(&self) -> usize {
        self.core().world_rank()
    }

    /// The world ranks of the group's members, in group-rank order.
    pub fn group_ranks(&self) -> &[usize] {
        self.core().group_ranks()
    }

    /// The backend's state.
    pub(crate) fn core(&self) -> &C {
        self.serial.core()
    }
}

impl<C: HostCore> fmt::Debug for HostComm<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct(C::NAME).field("world_rank", &self.world_rank()).field("group", &self.group_ranks()).finish()
    }
}

impl<C: HostCore> Drop for HostComm<C> {
    fn drop(&mut self) {
        if thread::panicking() {
            self.core().fail("its thread panicked (that panic's message is the root cause)".into());
        }
        self.serial.shut_down();
        self.core().close();
    }
}

impl<C: HostCore> Communicator for HostComm<C> {
    fn rank(&self) -> usize {
        self.core().group_rank()
    }
    fn size(&self) -> usize {
        self.core().group_ranks().len()
    }
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        let t = t.clone();
        self.serial.run("all_reduce_sum", move |c| c.all_reduce(&t))
    }
    fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        let t = t.clone();
        self.serial.run("all_gather", move |c| c.all_gather(&t, dim))
    }
    fn reduce_scatter_sum(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        let t = t.clone();
        self.serial.run("reduce_scatter_sum", move |c| c.reduce_scatter(&t, dim))
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        let t = t.clone();
        self.serial.run("broadcast", move |c| c.broadcast(&t, root))
    }
    fn all_to_all(&self, parts: Vec<Tensor>) -> Result<Vec<Tensor>> {
        self.serial.run("all_to_all", move |c| c.all_to_all(parts))
    }
    fn barrier(&self) -> Result<()> {
        self.serial.run("barrier", |c| c.barrier())
    }
    fn send(&self, t: &Tensor, peer: usize) -> Result<()> {
        self.core().send(t, peer)
    }
    fn recv(&self, peer: usize) -> Result<Tensor> {
        self.core().recv(peer)
    }
    /// Queued behind this rank's background collectives (a receiver that
    /// waits for it has issued the same collectives before, so they finish).
    fn send_async(&self, t: &Tensor, peer: usize) -> Result<Pending<()>> {
        let t = t.clone();
        self.serial.submit("send", move |c| c.send(&t, peer))
    }
    fn all_reduce_sum_async(&self, t: &Tensor) -> Result<Pending> {
        let t = t.clone();
        self.serial.submit("all_reduce_sum", move |c| c.all_reduce(&t))
    }
    fn all_gather_async(&self, t: &Tensor, dim: usize) -> Result<Pending> {
        let t = t.clone();
        self.serial.submit("all_gather", move |c| c.all_gather(&t, dim))
    }
    fn reduce_scatter_sum_async(&self, t: &Tensor, dim: usize) -> Result<Pending> {
        let t = t.clone();
        self.serial.submit("reduce_scatter_sum", move |c| c.reduce_scatter(&t, dim))
    }
    fn broadcast_async(&self, t: &Tensor, root: usize) -> Result<Pending> {
        let t = t.clone();
        self.serial.submit("broadcast", move |c| c.broadcast(&t, root))
    }
    fn all_to_all_async(&self, parts: Vec<Tensor>) -> Result<Pending<Vec<Tensor>>> {
        self.serial.submit("all_to_all", move |c| c.all_to_all(parts))
    }
    fn barrier_async(&self) -> Result<Pending<()>> {
        self.serial.submit("barrier", |c| c.barrier())
    }
    fn abort(&self, reason: &str) {
        self.core().fail(format!("aborted: {reason}"));
    }
    fn failure(&self) -> Option<Error> {
        self.core().failure()
    }
}
