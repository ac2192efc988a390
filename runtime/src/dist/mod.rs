//! Distribution across ranks: the mesh of parallel axes, and communicators
//! over its groups.

mod comm;
mod groups;
pub mod inproc;
pub mod mesh;
#[cfg(feature = "cuda")]
pub mod nccl;

pub use comm::{Communicator, Completer, Pending, SingleRank};
pub use groups::Groups;
