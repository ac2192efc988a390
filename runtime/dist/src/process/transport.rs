//! Which transport a group of processes uses, and the communicator that is
//! either.

use super::comm::TcpCore;
use crate::host_comm::{HostComm, HostCore};
use crate::shm::ShmCore;
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
/// Synchronous calls run on the calling thread, asynchronous ones in order on
/// a background thread (see [`HostComm`]). Dropping it while its thread
/// panics stops the job, so no peer waits for a rank that is gone.
pub type ProcessComm = HostComm<ProcessCore>;

impl HostComm<ProcessCore> {
    /// The transport this group uses: [`Transport::Shm`] or [`Transport::Tcp`].
    pub fn transport(&self) -> Transport {
        match self.core() {
            ProcessCore::Tcp(_) => Transport::Tcp,
            ProcessCore::Shm(_) => Transport::Shm,
        }
    }
}

/// What a [`ProcessComm`]'s calls run on: the group's transport.
pub enum ProcessCore {
    /// TCP connections to the group's other ranks.
    Tcp(TcpCore),
    /// The node's shared memory.
    Shm(ShmCore),
}

/// Runs `$call` on whichever transport `$core` holds.
macro_rules! on_transport {
    ($core:expr, $c:ident => $call:expr) => {
        match $core {
            ProcessCore::Tcp($c) => $call,
            ProcessCore::Shm($c) => $call,
        }
    };
}

impl HostCore for ProcessCore {
    const NAME: &'static str = "ProcessComm";

    fn world_rank(&self) -> usize {
        on_transport!(self, c => c.world_rank())
    }
    fn group_ranks(&self) -> &[usize] {
        on_transport!(self, c => c.group_ranks())
    }
    fn group_rank(&self) -> usize {
        on_transport!(self, c => c.group_rank())
    }
    fn all_reduce(&self, t: &Tensor) -> Result<Tensor> {
        on_transport!(self, c => c.all_reduce(t))
    }
    fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        on_transport!(self, c => c.all_gather(t, dim))
    }
    fn reduce_scatter(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        on_transport!(self, c => c.reduce_scatter(t, dim))
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        on_transport!(self, c => c.broadcast(t, root))
    }
    fn all_to_all(&self, parts: Vec<Tensor>) -> Result<Vec<Tensor>> {
        on_transport!(self, c => c.all_to_all(parts))
    }
    fn barrier(&self) -> Result<()> {
        on_transport!(self, c => c.barrier())
    }
    fn send(&self, t: &Tensor, peer: usize) -> Result<()> {
        on_transport!(self, c => c.send(t, peer))
    }
    fn recv(&self, peer: usize) -> Result<Tensor> {
        on_transport!(self, c => c.recv(peer))
    }
    fn fail(&self, reason: String) {
        on_transport!(self, c => c.fail(reason))
    }
    fn failure(&self) -> Option<Error> {
        on_transport!(self, c => c.failure())
    }
    fn close(&self) {
        on_transport!(self, c => c.close())
    }
}
