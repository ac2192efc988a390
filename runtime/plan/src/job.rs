//! A launched job of processes as a profile: every process is a rank, and
//! the job's own communicators are measured, inside a node and between
//! nodes, over whichever library will carry its training: Tessera's
//! connections (shared memory, TCP), MPI, or NCCL between processes with a
//! GPU each.

use tessera_core::{Device, Error, Result};
use tessera_dist::process::ProcessWorld;
use tessera_dist::Communicator;

use crate::machine::{cpu_profile, link_of, measure_device, Scale};
use crate::measure::{all_reduce_time, fit_all_reduce, Budget};
use crate::profile::{ClusterProfile, DeviceProfile, GroupFit};

/// The ranks of a launched job, through whichever library connects them.
#[derive(Clone, Copy)]
pub enum JobRanks<'a> {
    /// CPU ranks over Tessera's own connections: shared memory inside a
    /// node, TCP between.
    Process(&'a ProcessWorld),
    /// CPU ranks over the job's MPI library (a job started by `mpirun` or `srun`).
    #[cfg(feature = "mpi")]
    Mpi(&'a tessera_dist::mpi::MpiWorld),
    /// A GPU each (`device`, the one of this process's local rank), NCCL
    /// between them, its ids handed out through the job's rendezvous store.
    #[cfg(feature = "cuda")]
    Gpus {
        /// The job's processes (their host connections carry the barriers).
        world: &'a ProcessWorld,
        /// Where NCCL ids are exchanged.
        rendezvous: &'a tessera_dist::store::Rendezvous,
        /// This process's GPU.
        device: &'a Device,
    },
}

impl JobRanks<'_> {
    fn rank(&self) -> usize {
        match self {
            JobRanks::Process(w) => w.rank(),
            #[cfg(feature = "mpi")]
            JobRanks::Mpi(w) => w.rank(),
            #[cfg(feature = "cuda")]
            JobRanks::Gpus { world, .. } => world.rank(),
        }
    }

    fn world_size(&self) -> usize {
        match self {
            JobRanks::Process(w) => w.world_size(),
            #[cfg(feature = "mpi")]
            JobRanks::Mpi(w) => w.world_size(),
            #[cfg(feature = "cuda")]
            JobRanks::Gpus { world, .. } => world.world_size(),
        }
    }

    /// The host communicator of `members` named `tag`: what the ranks wait
    /// for each other on.
    fn host_group(&self, tag: &str, members: &[usize]) -> Result<Box<dyn Communicator>> {
        Ok(match self {
            JobRanks::Process(w) => Box::new(w.tagged_group(tag, members)?),
            #[cfg(feature = "mpi")]
            JobRanks::Mpi(w) => Box::new(w.tagged_group(tag, members)?),
            #[cfg(feature = "cuda")]
            JobRanks::Gpus { world, .. } => Box::new(world.tagged_group(tag, members)?),
        })
    }

    /// The communicator training would use for `members`: the one measured.
    /// Every member asks for it, in the same order as the other groups.
    fn measured_group(&self, tag: &str, members: &[usize]) -> Result<Box<dyn Communicator>> {
        match self {
            #[cfg(feature = "cuda")]
            JobRanks::Gpus { world, rendezvous, device } => Ok(Box::new(tessera_dist::nccl::process_group(world, rendezvous, tag, members, device)?)),
            _ => self.host_group(tag, members),
        }
    }

    /// The device the measured tensors live on.
    fn device(&self) -> Device {
        match self {
            #[cfg(feature = "cuda")]
            JobRanks::Gpus { device, .. } => (*device).clone(),
            _ => Device::cpu(),
        }
    }

    fn scale(&self) -> &'static Scale {
        match self {
            #[cfg(feature = "cuda")]
            JobRanks::Gpus { .. } => &Scale::GPU,
            _ => &Scale::CPU,
        }
    }

    /// What one rank's device can do: the node's cores shared by its
    /// `per_node` ranks, or the rank's own GPU.
    fn measure_device(&self, per_node: usize, budget: Budget) -> Result<DeviceProfile> {
        match self {
            #[cfg(feature = "cuda")]
            JobRanks::Gpus { device, .. } => {
                let memory = device.total_memory()?.ok_or_else(|| Error::invalid("profile_job", "the GPU reports no memory size"))?;
                crate::machine::measure_on(device, crate::machine::gpu_name(device), memory, 1, &Scale::GPU, crate::machine::Figures::Available, budget)
            }
            _ => measure_device(per_node, budget),
        }
    }

    /// Stops every rank, saying why (an MPI job ends here).
    fn abort(&self, reason: &str) {
        match self {
            JobRanks::Process(w) => w.abort(w.rank(), reason),
            #[cfg(feature = "mpi")]
            JobRanks::Mpi(w) => w.abort(reason),
            #[cfg(feature = "cuda")]
            JobRanks::Gpus { world, .. } => world.abort(world.rank(), reason),
        }
    }

    fn is_gpus(&self) -> bool {
        match self {
            #[cfg(feature = "cuda")]
            JobRanks::Gpus { .. } => true,
            _ => false,
        }
    }
}

/// Measures the job this process is a rank of: every process of the job
/// calls it. Rank 0 measures the device (its GPU, or the node's cores as
/// its `per_node` ranks share them) while the others wait; then the job's
/// own communicator is timed: groups of 2, 4, ... ranks of node 0 for the
/// link inside a node, and groups of one rank on each of 2, 4, ... nodes
/// for the link between them. Ranks are numbered node by node (`tessera
/// launch`, torchrun, Slurm and mpirun's default mapping do), `per_node` of
/// them on every node. Rank 0 gets the profile; the others `None`.
///
/// CPU ranks share their cores with their collectives (nothing overlaps
/// compute, and a waiting rank lends its cores to the busy ones); GPUs run
/// NCCL beside compute and share nothing.
pub fn profile_job(name: &str, job: JobRanks<'_>, per_node: usize, budget: Budget) -> Result<Option<ClusterProfile>> {
    const OP: &str = "profile_job";
    let (rank, size) = (job.rank(), job.world_size());
    if per_node == 0 || size % per_node != 0 {
        return Err(Error::topology(OP, format!("{size} ranks are not whole nodes of {per_node}; start the same number of processes on every node")));
    }
    let nodes = size / per_node;
    let all = job.host_group("profile", &(0..size).collect::<Vec<_>>())?;
    let device = if rank == 0 {
        match job.measure_device(per_node, budget) {
            Ok(d) => Some(d),
            Err(e) => {
                job.abort(&e.to_string());
                return Err(e);
            }
        }
    } else {
        None
    };
    all.barrier()?;
    // Each group of `members` times its all-reduces while the rest of the
    // job waits; rank 0 (a member of every group) keeps its times.
    let dev = job.device();
    let measure = |tag: String, members: Vec<usize>| -> Result<Option<GroupFit>> {
        let mut fit = None;
        if members.contains(&rank) {
            let comm = job.measured_group(&tag, &members)?;
            let times: Vec<(f64, f64)> =
                job.scale().all_reduce_bytes.iter().map(|&b| all_reduce_time(comm.as_ref(), &dev, b, 5).map(|t| (b as f64, t))).collect::<Result<_>>()?;
            if rank == 0 {
                fit = Some(fit_all_reduce(members.len(), &times)?);
            }
        }
        all.barrier()?;
        Ok(fit)
    };
    let (mut intra, mut inter) = (Vec::new(), Vec::new());
    let mut n = 2;
    while n <= per_node {
        intra.extend(measure(format!("profile-node-{n}"), (0..n).collect())?);
        n *= 2;
    }
    let mut n = 2;
    while n <= nodes {
        inter.extend(measure(format!("profile-nodes-{n}"), (0..n).map(|node| node * per_node).collect())?);
        n *= 2;
    }
    let Some(device) = device else { return Ok(None) };
    let bandwidth = device.memory_bandwidth;
    let (mut intra_node, mut inter_node) = (link_of(intra, bandwidth), (nodes > 1).then(|| link_of(inter, bandwidth)));
    if !job.is_gpus() {
        return cpu_profile(name, per_node, device, intra_node, inter_node).map(Some);
    }
    intra_node.overlaps_compute = true;
    if let Some(link) = &mut inter_node {
        link.overlaps_compute = true;
    }
    let profile = ClusterProfile {
        name: name.to_string(),
        gpus_per_node: per_node,
        device,
        intra_node,
        inter_node,
        ranks_share_cores: false,
        host_memory_bytes: crate::machine::host_memory(),
    };
    ClusterProfile::parse(&profile.to_toml(), name).map(Some)
}
