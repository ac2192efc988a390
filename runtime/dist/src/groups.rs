//! The communicators of one rank: one per mesh axis, and the data replicas
//! (data × expert parallel) together.

use crate::{Communicator, SingleRank};
use std::sync::Arc;

/// One communicator per mesh axis, and one over the data replicas.
#[derive(Clone, Debug)]
pub struct Groups {
    /// The tensor-parallel group.
    pub tp: Arc<dyn Communicator>,
    /// The data-parallel group.
    pub dp: Arc<dyn Communicator>,
    /// The pipeline-parallel group.
    pub pp: Arc<dyn Communicator>,
    /// The expert-parallel group.
    pub ep: Arc<dyn Communicator>,
    /// The data replicas: the data- and expert-parallel axes together
    /// ([`Mesh::replica_group`](crate::mesh::Mesh::replica_group)), over
    /// which the gradients of every parameter but the experts are summed.
    /// The same members as `dp` when `ep` is 1, as `ep` when `dp` is 1.
    pub replicas: Arc<dyn Communicator>,
}

impl Groups {
    /// Every communicator.
    pub fn all(&self) -> [&Arc<dyn Communicator>; 5] {
        [&self.tp, &self.dp, &self.pp, &self.ep, &self.replicas]
    }

    /// Stops every group of this rank (see [`Communicator::abort`]).
    pub fn abort(&self, reason: &str) {
        for c in self.all() {
            c.abort(reason);
        }
    }

    /// The failure that stopped any of this rank's groups, if one has (see
    /// [`Communicator::failure`]).
    pub fn failure(&self) -> Option<tessera_core::Error> {
        self.all().into_iter().find_map(|c| c.failure())
    }

    /// Every axis of size one.
    pub fn single() -> Self {
        let one: Arc<dyn Communicator> = Arc::new(SingleRank);
        Groups { tp: one.clone(), dp: one.clone(), pp: one.clone(), ep: one.clone(), replicas: one }
    }
}
