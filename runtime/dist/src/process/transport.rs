//! Which transport a group of processes uses, and the communicator that is
//! either.

use super::comm::TcpComm;
use crate::comm::{Communicator, Pending};
use crate::shm::ShmComm;
use std::fmt;
use tessera_core::tensor::Tensor;
use tessera_core::{Error, Result};

/// How the processes of a job reach one another: read from
/// `TESSERA_TRANSPORT` by [`ProcessWorld::join`](super::ProcessWorld::join).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Transport {
    /// TCP for every group, even between processes of one node.
    Tcp,
    /// Shared memory for every group; a group whose ranks are not all on
    /// one node is an error.
    Shm,
    /// Shared memory for the groups whose ranks are all on one node, TCP
    /// for the others (the default).
    #[default]
    Auto,
}

impl Transport {
    /// The environment variable that chooses the transport.
    pub const VAR: &'static str = "TESSERA_TRANSPORT";

    /// The transport `TESSERA_TRANSPORT` names (`tcp`, `shm` or `auto`);
    /// [`Transport::Auto`] when it is not set.
    pub fn from_env() -> Result<Transport> {
        match std::env::var(Self::VAR) {
            Ok(v) => Self::parse(&v),
            Err(std::env::VarError::NotPresent) => Ok(Transport::Auto),
            Err(e) => Err(Error::environment(Self::VAR, format!("{e}; set it to tcp, shm or auto"))),
        }
    }

    /// The transport named `text`: `tcp`, `shm` or `auto`.
    pub fn parse(text: &str) -> Result<Transport> {
        match text.trim().to_ascii_lowercase().as_str() {
            "tcp" => Ok(Transport::Tcp),
            "shm" => Ok(Transport::Shm),
            "auto" | "" => Ok(Transport::Auto),
            other => Err(Error::environment(
                Self::VAR,
                format!(
                    "{other:?} is not a transport; use tcp, shm (shared memory, ranks of one node) or auto (shared memory within a node, TCP between nodes)"
                ),
            )),
        }
    }
}

impl fmt::Display for Transport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Transport::Tcp => "tcp",
            Transport::Shm => "shm",
            Transport::Auto => "auto",
        })
    }
}

/// One rank's communicator for a group of ranks that are processes: through
/// shared memory when the group's ranks are all on this node (and the
/// transport allows it), over TCP otherwise. Both run the in-process
/// algorithms' arithmetic, so which one a group gets never changes its bits.
///
/// Synchronous calls run on the calling thread; the `*_async` forms run in
/// order on a background thread (see [`Communicator`]'s ordering rules).
/// Dropping it while its thread panics stops the job, so no peer waits for
/// a rank that is gone.
pub struct ProcessComm {
    inner: Inner,
}

enum Inner {
    Tcp(TcpComm),
    Shm(ShmComm),
}

impl ProcessComm {
    pub(super) fn tcp(c: TcpComm) -> Self {
        ProcessComm { inner: Inner::Tcp(c) }
    }

    pub(super) fn shm(c: ShmComm) -> Self {
        ProcessComm { inner: Inner::Shm(c) }
    }

    fn comm(&self) -> &dyn Communicator {
        match &self.inner {
            Inner::Tcp(c) => c,
            Inner::Shm(c) => c,
        }
    }

    /// This rank's index in the world (its group rank is [`Communicator::rank`]).
    pub fn world_rank(&self) -> usize {
        match &self.inner {
            Inner::Tcp(c) => c.world_rank(),
            Inner::Shm(c) => c.world_rank(),
        }
    }

    /// The world ranks of the group's members, in group-rank order.
    pub fn group_ranks(&self) -> &[usize] {
        match &self.inner {
            Inner::Tcp(c) => c.group_ranks(),
            Inner::Shm(c) => c.group_ranks(),
        }
    }

    /// The transport this group uses: [`Transport::Shm`] or [`Transport::Tcp`].
    pub fn transport(&self) -> Transport {
        match &self.inner {
            Inner::Tcp(_) => Transport::Tcp,
            Inner::Shm(_) => Transport::Shm,
        }
    }
}

impl fmt::Debug for ProcessComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.inner {
            Inner::Tcp(c) => c.fmt(f),
            Inner::Shm(c) => c.fmt(f),
        }
    }
}

impl Communicator for ProcessComm {
    fn rank(&self) -> usize {
        self.comm().rank()
    }
    fn size(&self) -> usize {
        self.comm().size()
    }
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        self.comm().all_reduce_sum(t)
    }
    fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        self.comm().all_gather(t, dim)
    }
    fn reduce_scatter_sum(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        self.comm().reduce_scatter_sum(t, dim)
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        self.comm().broadcast(t, root)
    }
    fn all_to_all(&self, parts: Vec<Tensor>) -> Result<Vec<Tensor>> {
        self.comm().all_to_all(parts)
    }
    fn barrier(&self) -> Result<()> {
        self.comm().barrier()
    }
    fn send(&self, t: &Tensor, peer: usize) -> Result<()> {
        self.comm().send(t, peer)
    }
    fn recv(&self, peer: usize) -> Result<Tensor> {
        self.comm().recv(peer)
    }
    fn all_reduce_sum_async(&self, t: &Tensor) -> Result<Pending> {
        self.comm().all_reduce_sum_async(t)
    }
    fn all_gather_async(&self, t: &Tensor, dim: usize) -> Result<Pending> {
        self.comm().all_gather_async(t, dim)
    }
    fn reduce_scatter_sum_async(&self, t: &Tensor, dim: usize) -> Result<Pending> {
        self.comm().reduce_scatter_sum_async(t, dim)
    }
    fn broadcast_async(&self, t: &Tensor, root: usize) -> Result<Pending> {
        self.comm().broadcast_async(t, root)
    }
    fn all_to_all_async(&self, parts: Vec<Tensor>) -> Result<Pending<Vec<Tensor>>> {
        self.comm().all_to_all_async(parts)
    }
    fn barrier_async(&self) -> Result<Pending<()>> {
        self.comm().barrier_async()
    }
    fn abort(&self, reason: &str) {
        self.comm().abort(reason)
    }
    fn failure(&self) -> Option<Error> {
        self.comm().failure()
    }
}
