//! Where a run's ranks execute and how they reach each other: a CPU thread
//! per rank with the in-process communicator, one GPU per rank (a thread
//! each) with NCCL, or this process as one rank of a job of processes.

use super::RankDevice;
use crate::job::{Job, ProcessJob};
use parking_lot::Mutex;
use std::sync::Arc;
use tessera_core::Device;
use tessera_core::{Error, Result};
use tessera_dist::inproc::{mesh_groups, InProcess};
use tessera_dist::mesh::Mesh;
use tessera_dist::Groups;

/// The ranks of one run.
pub(crate) enum Ranks {
    /// CPU ranks: each builds its groups from the shared in-process world.
    Cpu(InProcess),
    /// GPU ranks: every rank's device and NCCL groups, created together up
    /// front (NCCL's communicators of a group are made at once).
    Cuda {
        devices: Vec<Device>,
        /// Taken by each rank's thread when it starts.
        groups: Vec<Mutex<Option<Groups>>>,
        /// The same communicators, to abort a failed rank's groups.
        handles: Vec<Groups>,
    },
    /// This process is one rank of a job of processes.
    Process(Arc<ProcessJob>),
}

impl Ranks {
    /// The ranks of `mesh` on `device`, in `job`.
    /// A CPU rank waits `timeout` for a peer before declaring it hung.
    pub(crate) fn new(device: RankDevice, mesh: &Mesh, timeout: std::time::Duration, job: &Job) -> Result<Self> {
        if let Some(p) = job.process_job() {
            return Ok(Ranks::Process(p.clone()));
        }
        match device {
            RankDevice::Cpu => Ok(Ranks::Cpu(InProcess::with_timeout(mesh.world(), timeout)?)),
            RankDevice::Cuda => {
                let devices = (0..mesh.world())
                    .map(|r| {
                        Device::cuda(r).map_err(|e| {
                            Error::config(
                                "mesh.device",
                                format!(
                                    "rank {r} runs on GPU {r}: {e}; use as many GPUs as ranks (the product of dp, tp, pp and ep), or mesh.device = \"cpu\""
                                ),
                            )
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                let handles = nccl_groups(mesh, &devices)?;
                let groups = handles.iter().map(|g| Mutex::new(Some(g.clone()))).collect();
                Ok(Ranks::Cuda { devices, groups, handles })
            }
        }
    }

    /// Rank `rank`'s device and communicators; each rank asks once.
    pub(crate) fn take(&self, mesh: &Mesh, rank: usize) -> Result<(Device, Groups)> {
        match self {
            Ranks::Cpu(world) => {
                let dev = Device::cpu();
                let groups = mesh_groups(world, mesh, rank, &dev)?;
                Ok((dev, groups))
            }
            Ranks::Process(p) => {
                if rank != p.env.rank {
                    return Err(Error::state_mismatch("trainer", format!("this process is rank {}, not rank {rank}", p.env.rank)));
                }
                let groups = match &p.device {
                    Device::Cpu(_) => p.world.mesh_groups(mesh)?,
                    Device::Cuda(_) => nccl_process_groups(p, mesh)?,
                };
                Ok((p.device.clone(), groups))
            }
            Ranks::Cuda { devices, groups, .. } => {
                let taken = groups[rank].lock().take();
                let groups = taken.ok_or_else(|| Error::state_mismatch("trainer", format!("rank {rank}'s communicators were already taken")))?;
                Ok((devices[rank].clone(), groups))
            }
        }
    }

    /// The device the machine's peak rate is measured on.
    pub(crate) fn first_device(&self) -> Device {
        match self {
            Ranks::Cpu(_) => Device::cpu(),
            Ranks::Process(p) => p.device.clone(),
            Ranks::Cuda { devices, .. } => devices[0].clone(),
        }
    }

    /// The ranks this process runs: all of them, or its own.
    pub(crate) fn local(&self, world: usize) -> Vec<usize> {
        match self {
            Ranks::Process(p) => vec![p.env.rank],
            _ => (0..world).collect(),
        }
    }

    /// Declares `rank` failed, so that every rank waiting on it stops.
    pub(crate) fn abort(&self, rank: usize, reason: &str) {
        match self {
            Ranks::Cpu(world) => world.abort(rank, reason),
            Ranks::Process(p) => p.world.abort(rank, reason),
            Ranks::Cuda { handles, .. } => handles[rank].abort(reason),
        }
    }
}

#[cfg(feature = "cuda")]
fn nccl_groups(mesh: &Mesh, devices: &[Device]) -> Result<Vec<Groups>> {
    tessera_dist::nccl::mesh_groups(mesh, devices)
}

#[cfg(feature = "cuda")]
fn nccl_process_groups(p: &ProcessJob, mesh: &Mesh) -> Result<Groups> {
    match (&p.world, &p.rendezvous) {
        (crate::job::JobWorld::Tcp(world), Some(rendezvous)) => tessera_dist::nccl::process_mesh_groups(world, rendezvous, mesh, &p.device),
        #[cfg(feature = "mpi")]
        (crate::job::JobWorld::Mpi(world), _) => tessera_dist::nccl::mpi_mesh_groups(world, mesh, &p.device),
        _ => Err(Error::config("mesh.comm", "GPU ranks of a job of processes form their NCCL groups through the rendezvous store: use mesh.comm = \"tcp\"")),
    }
}

#[cfg(not(feature = "cuda"))]
fn nccl_process_groups(_: &ProcessJob, _: &Mesh) -> Result<Groups> {
    // Unreachable in practice: opening a CUDA device already failed.
    Err(Error::NotCompiledWithCuda)
}

#[cfg(not(feature = "cuda"))]
fn nccl_groups(_: &Mesh, _: &[Device]) -> Result<Vec<Groups>> {
    // Unreachable in practice: opening a CUDA device already failed.
    Err(Error::NotCompiledWithCuda)
}
