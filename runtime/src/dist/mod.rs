//! Distribution across ranks: communicators over the groups of a mesh.

mod comm;

pub use comm::{Communicator, SingleRank};
