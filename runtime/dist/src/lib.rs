//! Distribution across ranks: the mesh of parallel axes, and communicators
//! over its groups.
//!
//! Its place: above the tensor core (`tessera-core`), below everything that
//! runs on more than one rank. It owns the mesh of parallel axes, each rank's
//! [`Groups`], the communicators (in-process, between processes through
//! shared memory or TCP, MPI with the `mpi` feature, and NCCL), and how processes find each other (the launchers'
//! environment, the rendezvous store); it knows nothing of modules or
//! training. Users reach it as `tessera::dist`.

mod call;
mod comm;
pub mod env;
mod groups;
mod host;
mod host_comm;
pub mod inproc;
pub mod mesh;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod process;
mod serial;
pub mod shm;
mod short_slice;
pub mod store;

pub use comm::{Communicator, Completer, Pending, SingleRank};
pub use groups::Groups;
pub use host_comm::HostComm;
