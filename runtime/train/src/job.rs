//! Where a run's ranks live: threads of this process, or processes that a
//! launcher started (`tessera launch`, torchrun, Slurm's `srun`, `mpirun`),
//! of which this process is one.
//!
//! A program that trains builds its [`Job`] first, from the configuration
//! and the environment, so that what must happen once per run (writing the
//! data, taking the run directory's lock) happens on rank 0 alone while the
//! other processes wait ([`Job::primary_first`]); then it hands the job to
//! the [`Trainer`](crate::Trainer).

use crate::config::{LaunchMode, ProcessComms, RankDevice};
use crate::TrainConfig;
use std::sync::Arc;
use tessera_core::{Device, Error, Result, Tensor};
use tessera_dist::env::ProcessEnv;
use tessera_dist::mesh::Mesh;
use tessera_dist::process::ProcessWorld;
use tessera_dist::store::Rendezvous;
use tessera_dist::{Communicator, Groups};
use tessera_observe::Trace;

/// Where a run's ranks live.
#[derive(Clone, Debug)]
pub struct Job {
    processes: Option<Arc<ProcessJob>>,
    /// The data-parallel degree and gradient accumulation of an elastic
    /// job that runs on another number of processes than the mesh has.
    resized: Option<(usize, usize)>,
}

/// This process's place in a job of processes.
pub(crate) struct ProcessJob {
    pub(crate) env: ProcessEnv,
    /// The whole job, for what the trainer itself exchanges: rank 0's
    /// verdict on the run directory, each step's figures, the trace.
    /// Declared before the world, so it is dropped first.
    pub(crate) control: Box<dyn Communicator>,
    pub(crate) world: JobWorld,
    /// Kept for the run (TCP only): rank 0 serves the store until it is
    /// dropped; the CUDA build also hands out the NCCL groups' ids through it.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) rendezvous: Option<Rendezvous>,
    /// This rank's device: the CPU, or its GPU (`LOCAL_RANK`).
    pub(crate) device: Device,
    /// The CPU device the connections between processes receive on: the
    /// rank's own when it is a CPU rank (received tensors are used as they
    /// are), the host's for a GPU rank.
    pub(crate) host: Device,
}

/// How the processes of a job reach each other (`mesh.comm`).
pub(crate) enum JobWorld {
    /// Tessera's TCP connections.
    Tcp(ProcessWorld),
    /// The job's MPI library.
    #[cfg(feature = "mpi")]
    Mpi(tessera_dist::mpi::MpiWorld),
}

impl JobWorld {
    /// This process's host communicators for every axis of `mesh`.
    pub(crate) fn mesh_groups(&self, mesh: &Mesh) -> Result<Groups> {
        match self {
            JobWorld::Tcp(w) => tessera_dist::process::mesh_groups(w, mesh),
            #[cfg(feature = "mpi")]
            JobWorld::Mpi(w) => tessera_dist::mpi::mesh_groups(w, mesh),
        }
    }

    /// Stops the job on behalf of this process's rank `rank` (over MPI:
    /// ends the whole job, this process included).
    pub(crate) fn abort(&self, rank: usize, reason: &str) {
        match self {
            JobWorld::Tcp(w) => w.abort(rank, reason),
            #[cfg(feature = "mpi")]
            JobWorld::Mpi(w) => w.abort(reason),
        }
    }
}

impl std::fmt::Debug for ProcessJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessJob").field("rank", &self.env.rank).field("world_size", &self.env.world_size).finish()
    }
}

impl Job {
    /// Every rank a thread of this process.
    pub fn threads() -> Job {
        Job { processes: None, resized: None }
    }

    /// The job `config` runs as: with `mesh.launch = "auto"`, processes
    /// when a launcher's variables are in the environment (see
    /// [`ProcessEnv::detect`]), threads otherwise. As processes, this joins
    /// the others (with `mesh.comm = "tcp"`, the rendezvous, then a
    /// connection to every rank; with `"mpi"`, `MPI_Init`), waiting at most
    /// `mesh.timeout_s`; every process of the job calls it.
    pub fn for_config(config: &TrainConfig) -> Result<Job> {
        let env = ProcessEnv::detect()?;
        Job::with_env(config, env)
    }

    /// [`for_config`](Self::for_config) with the launcher's environment
    /// given (`None`: no launcher).
    pub fn with_env(config: &TrainConfig, env: Option<ProcessEnv>) -> Result<Job> {
        let mesh = &config.mesh;
        let env = match (mesh.launch_mode()?, env) {
            (LaunchMode::Threads, _) | (LaunchMode::Auto, None) => return Ok(Job::threads()),
            (LaunchMode::Processes, None) => {
                return Err(Error::config(
                    "mesh.launch",
                    format!(
                        "\"processes\" needs this process to be started by a launcher, which tells it its rank; run it as `tessera launch --nproc-per-node {} -- PROGRAM ARGS` (or under torchrun, srun or mpirun), or use `auto` or `threads`",
                        mesh.world_size()
                    ),
                ))
            }
            (_, Some(env)) => env,
        };
        let resized = match (env.world_size == mesh.world_size(), mesh.elastic) {
            (true, _) => None,
            (false, true) => Some(mesh.resized(env.world_size, config.batch.grad_accum)?),
            (false, false) => None,
        };
        if env.world_size != mesh.world_size() && resized.is_none() {
            return Err(Error::config(
                "mesh",
                format!(
                    "the mesh {} has {} ranks but the launcher started {} processes ({} = {}); start one process per rank (`tessera launch --nproc-per-node {}`), change the mesh, or let the data-parallel degree follow the processes with mesh.elastic = true",
                    mesh.spec(),
                    mesh.world_size(),
                    env.world_size,
                    env.launcher.world_size_var(),
                    env.world_size,
                    mesh.world_size()
                ),
            ));
        }
        // A GPU per process: the node's `LOCAL_RANK`-th.
        let device = match mesh.rank_device()? {
            RankDevice::Cpu => Device::cpu(),
            RankDevice::Cuda => Device::cuda(env.local_rank).map_err(|e| {
                Error::config(
                    "mesh.device",
                    format!(
                        "rank {} runs on GPU {} of its node (LOCAL_RANK): {e}; start at most as many processes per node as it has GPUs",
                        env.rank, env.local_rank
                    ),
                )
            })?,
        };
        let timeout = mesh.timeout();
        // CPU ranks receive on their own device; a GPU rank's connections
        // receive on the host.
        let host = match &device {
            Device::Cpu(_) => device.clone(),
            Device::Cuda(_) => Device::cpu(),
        };
        let all: Vec<usize> = (0..env.world_size).collect();
        let job = match mesh.process_comms()? {
            ProcessComms::Tcp => {
                let rendezvous = Rendezvous::join(&env, timeout)?;
                let world = ProcessWorld::join(&rendezvous, &host, timeout)?;
                let control = Box::new(world.tagged_group("trainer", &all)?);
                ProcessJob { env, control, world: JobWorld::Tcp(world), rendezvous: Some(rendezvous), device, host }
            }
            #[cfg(feature = "mpi")]
            ProcessComms::Mpi => {
                use tessera_dist::mpi::{MpiOptions, MpiWorld};
                // MPI finds the peers itself: no rendezvous store (GPU ranks
                // share their NCCL ids by MPI_Bcast).
                let options = MpiOptions { timeout: Some(timeout), ..MpiOptions::from_env()? };
                let world = MpiWorld::init_with(&host, options)?;
                if world.rank() != env.rank || world.world_size() != env.world_size {
                    return Err(Error::config(
                        "mesh.comm",
                        format!(
                            "MPI says this process is rank {} of {}, but {} says rank {} of {}: start the job with the MPI's own launcher (its mpirun, or srun --mpi=...)",
                            world.rank(),
                            world.world_size(),
                            env.launcher.rank_var(),
                            env.rank,
                            env.world_size
                        ),
                    ));
                }
                let control = Box::new(world.tagged_group("trainer", &all)?);
                ProcessJob { env, control, world: JobWorld::Mpi(world), rendezvous: None, device, host }
            }
            #[cfg(not(feature = "mpi"))]
            ProcessComms::Mpi => unreachable!("mesh.comm = \"mpi\" is refused without the mpi feature"),
        };
        Ok(Job { processes: Some(Arc::new(job)), resized })
    }

    /// This process's rank when ranks are processes; 0 when they are
    /// threads (this process runs them all).
    pub fn rank(&self) -> usize {
        self.processes.as_ref().map_or(0, |p| p.env.rank)
    }

    /// Whether this process writes the run's reports (metrics, plots, the
    /// summary): the only process of a threaded run, rank 0 of a job of
    /// processes.
    pub fn is_primary(&self) -> bool {
        self.rank() == 0
    }

    /// The number of processes in the job; `None` when ranks are threads.
    pub fn processes(&self) -> Option<usize> {
        self.processes.as_ref().map(|p| p.env.world_size)
    }

    /// `config` as this job runs it: an elastic job on another number of
    /// processes than its mesh has gets the data-parallel degree of those
    /// processes and the gradient accumulation that keeps its global batch
    /// (see [`MeshConfig::elastic`](crate::MeshConfig::elastic)).
    pub fn fit(&self, config: &TrainConfig) -> TrainConfig {
        let mut config = config.clone();
        if let Some((dp, accum)) = self.resized {
            config.mesh.dp = dp;
            config.batch.grad_accum = accum;
        }
        config
    }

    /// The data-parallel degree and gradient accumulation an elastic job
    /// runs with instead of its configuration's, when they differ.
    pub fn resized(&self) -> Option<(usize, usize)> {
        self.resized
    }

    pub(crate) fn process_job(&self) -> Option<&Arc<ProcessJob>> {
        self.processes.as_ref()
    }

    /// Runs `f` on the primary process while every other process waits for
    /// it, then returns its value there (`Some`) and `None` elsewhere; for
    /// what a run does once (writing its data, taking its directory's lock)
    /// before the ranks start. A failure of `f` is every process's error:
    /// the primary's own, and on the others [`Error::RankFailed`] naming
    /// rank 0 and its message. `what` names the work in that message.
    pub fn primary_first<T, E>(&self, what: &str, f: impl FnOnce() -> std::result::Result<T, E>) -> std::result::Result<Option<T>, E>
    where
        E: std::fmt::Display + From<Error>,
    {
        let Some(p) = &self.processes else { return f().map(Some) };
        let outcome = if p.env.rank == 0 { Some(f()) } else { None };
        let verdict = match &outcome {
            // `{:#}` shows a chain of causes where the error type has one.
            Some(Err(e)) => format!("{e:#}"),
            _ => String::new(),
        };
        let verdict = broadcast_text(p.control.as_ref(), &verdict, &p.host)?;
        match outcome {
            Some(r) => r.map(Some),
            None if verdict.is_empty() => Ok(None),
            None => Err(Error::RankFailed { rank: 0, reason: format!("{what}: {verdict}") }.into()),
        }
    }
}

impl Job {
    /// In a job of processes, hands every rank's spans to rank 0's `trace`
    /// (each process traces its own rank); nothing to do when ranks are
    /// threads, which share one trace. Every process calls it.
    pub(crate) fn gather_trace(&self, trace: &Trace) -> Result<()> {
        let Some(p) = &self.processes else { return Ok(()) };
        let comm = &p.control;
        let mine: Vec<u32> = if p.env.rank == 0 { Vec::new() } else { trace.export().bytes().map(u32::from).collect() };
        let lens = comm.all_gather(&Tensor::from_vec(vec![mine.len() as u32], [1], &p.host)?, 0)?.to_vec::<u32>()?;
        if p.env.rank != 0 {
            if !mine.is_empty() {
                comm.send(&Tensor::from_vec(mine.clone(), [mine.len()], &p.host)?, 0)?;
            }
            return Ok(());
        }
        for (r, &len) in lens.iter().enumerate().skip(1) {
            if len > 0 {
                let bytes: Vec<u8> = comm.recv(r)?.to_vec::<u32>()?.iter().map(|&b| b as u8).collect();
                trace.merge(&String::from_utf8_lossy(&bytes))?;
            }
        }
        Ok(())
    }
}

/// Rank 0's `text`, on every rank of `comm`.
pub(crate) fn broadcast_text(comm: &dyn Communicator, text: &str, dev: &Device) -> Result<String> {
    let len = comm.broadcast(&Tensor::from_vec(vec![text.len() as u32], [1], dev)?, 0)?.to_vec::<u32>()?[0] as usize;
    if len == 0 {
        return Ok(String::new());
    }
    let bytes: Vec<u32> = if comm.rank() == 0 { text.bytes().map(u32::from).collect() } else { vec![0; len] };
    let got = comm.broadcast(&Tensor::from_vec(bytes, [len], dev)?, 0)?.to_vec::<u32>()?;
    Ok(String::from_utf8_lossy(&got.iter().map(|&b| b as u8).collect::<Vec<_>>()).into_owned())
}
