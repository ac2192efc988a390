//! The communicators of one rank: one per mesh axis (the data-parallel one
//! spanning the context-parallel ranks too), and the data replicas (data ×
//! context × expert parallel) together.

use crate::mesh::{Axis, Mesh};
use crate::{Communicator, SingleRank};
use std::sync::Arc;
use tessera_core::{Error, Result};

/// One communicator per mesh axis, and one over the data replicas.
#[derive(Clone, Debug)]
pub struct Groups {
    /// The tensor-parallel group.
    pub tp: Arc<dyn Communicator>,
    /// The data-parallel group: the ranks that hold the same parameters,
    /// over the data- and context-parallel axes
    /// ([`Mesh::data_group`](crate::mesh::Mesh::data_group); the dp axis
    /// alone when cp is 1). Gradients are averaged and optimizer states
    /// sharded over it.
    pub dp: Arc<dyn Communicator>,
    /// The context-parallel group: the ranks that split each sequence, in
    /// ring order (a rank's index is its coordinate on the cp axis).
    pub cp: Arc<dyn Communicator>,
    /// The pipeline-parallel group.
    pub pp: Arc<dyn Communicator>,
    /// The expert-parallel group.
    pub ep: Arc<dyn Communicator>,
    /// The data replicas: the data-, context- and expert-parallel axes
    /// together ([`Mesh::replica_group`](crate::mesh::Mesh::replica_group)),
    /// over which the gradients of every parameter but the experts are
    /// summed. The same members as `dp` when `ep` is 1, as `ep` when `dp`
    /// and `cp` are 1.
    pub replicas: Arc<dyn Communicator>,
}

impl Groups {
    /// Every communicator.
    pub fn all(&self) -> [&Arc<dyn Communicator>; 6] {
        [&self.tp, &self.dp, &self.cp, &self.pp, &self.ep, &self.replicas]
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
        Groups { tp: one.clone(), dp: one.clone(), cp: one.clone(), pp: one.clone(), ep: one.clone(), replicas: one }
    }

    /// The groups of world rank `rank` in `mesh`, each made by
    /// `group(tag, members)` with the axis's name as its tag (so that axes
    /// with the same members stay independent), one at a time and in the
    /// same order on every rank: tp, dp (over dp × cp), cp, pp, ep, then the replicas (backends
    /// that create groups collectively, such as MPI, rely on that order).
    ///
    /// `world` is the backend's number of ranks and `world_is` how it says
    /// so (`"the job has 4 processes"`), for the error when it is not the
    /// mesh's; `fix` says what to do then.
    pub(crate) fn of_mesh(
        mesh: &Mesh,
        rank: usize,
        (world, world_is, fix): (usize, &str, &str),
        mut group: impl FnMut(&str, &[usize]) -> Result<Arc<dyn Communicator>>,
    ) -> Result<Groups> {
        if world != mesh.world() {
            return Err(Error::topology("mesh_groups", format!("the mesh {mesh} has {} ranks but {world_is}; {fix}", mesh.world())));
        }
        let tp = group("tp", &mesh.group(Axis::Tp, rank)?)?;
        let dp = group("dp", &mesh.data_group(rank)?)?;
        let mut axis = |a: Axis| group(a.name(), &mesh.group(a, rank)?);
        let (cp, pp, ep) = (axis(Axis::Cp)?, axis(Axis::Pp)?, axis(Axis::Ep)?);
        let replicas = group("replicas", &mesh.replica_group(rank)?)?;
        Ok(Groups { tp, dp, cp, pp, ep, replicas })
    }
}

/// Checks that `ranks` can be a group of a world of `world` ranks: not
/// empty, every rank in the world, none twice. `op` names the caller in
/// errors.
pub(crate) fn check_members(op: &'static str, world: usize, ranks: &[usize]) -> Result<()> {
    if ranks.is_empty() {
        return Err(Error::topology(op, "a group needs at least one rank"));
    }
    if let Some(&r) = ranks.iter().find(|&&r| r >= world) {
        return Err(Error::no_such_rank(op, format!("rank {r} in {ranks:?} is not a rank of this world of {world} ranks")));
    }
    let mut sorted = ranks.to_vec();
    sorted.sort_unstable();
    if sorted.windows(2).any(|w| w[0] == w[1]) {
        return Err(Error::topology(op, format!("rank list {ranks:?} names a rank twice")));
    }
    Ok(())
}

/// Checks `ranks` as [`check_members`] does, and that rank `me` is one of
/// them; returns the group's identity ([`group_id`]).
pub(crate) fn check_group(op: &'static str, me: usize, world: usize, tag: &str, ranks: &[usize]) -> Result<u64> {
    check_members(op, world, ranks)?;
    if !ranks.contains(&me) {
        return Err(Error::no_such_rank(op, format!("rank {me} is not a member of group {ranks:?}")));
    }
    Ok(group_id(tag, ranks))
}

/// A group's identity between processes: FNV-1a of its tag and members,
/// the same on every rank.
pub(crate) fn group_id(tag: &str, ranks: &[usize]) -> u64 {
    use std::hash::Hasher;
    let mut h = fnv::FnvHasher::default();
    h.write(tag.as_bytes());
    h.write_u8(0xff);
    for &r in ranks {
        h.write_u64(r as u64);
    }
    h.finish()
}
