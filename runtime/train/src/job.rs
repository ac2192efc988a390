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

/// Where a run's ranks live.
#[derive(Clone, Debug)]
pub struct Job {
    processes: Option<Arc<ProcessJob>>,
}

/// This process's place in a job of processes.
pub(crate) struct ProcessJob {
    pub(crate) env: ProcessEnv,
    /// The whole job, for what the trainer itself exchanges: rank 0's
    /// verdict on the run directory, and each step's figures. Declared
    /// before the world, so it is dropped first.
    pub(crate) control: Box<dyn Communicator>,
    pub(crate) world: JobWorld,
    /// Kept for the run (TCP only): rank 0 serves the store until it is
    /// dropped.
    _rendezvous: Option<Rendezvous>,
    /// This rank's device, on which the world receives.
    pub(crate) device: Device,
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
    /// This process's communicators for every axis of `mesh`.
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
        Job { processes: None }
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
        if env.world_size != mesh.world_size() {
            return Err(Error::config(
                "mesh",
                format!(
                    "the mesh {} has {} ranks but the launcher started {} processes ({} = {}); start one process per rank (`tessera launch --nproc-per-node {}`), or change the mesh",
                    mesh.spec(),
                    mesh.world_size(),
                    env.world_size,
                    env.launcher.world_size_var(),
                    env.world_size,
                    mesh.world_size()
                ),
            ));
        }
        if mesh.rank_device()? == RankDevice::Cuda {
            return Err(Error::config(
                "mesh.device",
                "CUDA ranks run as threads of one process (one per GPU, NCCL between them); processes with a GPU each are not supported yet: run without a launcher, or with mesh.launch = \"threads\"",
            ));
        }
        let timeout = mesh.timeout();
        let device = Device::cpu();
        let all: Vec<usize> = (0..env.world_size).collect();
        let job = match mesh.process_comms()? {
            ProcessComms::Tcp => {
                let rendezvous = Rendezvous::join(&env, timeout)?;
                let world = ProcessWorld::join(&rendezvous, &device, timeout)?;
                let control = Box::new(world.tagged_group("trainer", &all)?);
                ProcessJob { env, control, world: JobWorld::Tcp(world), _rendezvous: Some(rendezvous), device }
            }
            #[cfg(feature = "mpi")]
            ProcessComms::Mpi => {
                use tessera_dist::mpi::{MpiOptions, MpiWorld};
                // MPI finds the peers itself: no rendezvous store.
                let options = MpiOptions { timeout: Some(timeout), ..MpiOptions::from_env()? };
                let world = MpiWorld::init_with(&device, options)?;
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
                ProcessJob { env, control, world: JobWorld::Mpi(world), _rendezvous: None, device }
            }
            #[cfg(not(feature = "mpi"))]
            ProcessComms::Mpi => unreachable!("mesh.comm = \"mpi\" is refused without the mpi feature"),
        };
        Ok(Job { processes: Some(Arc::new(job)) })
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
        let verdict = broadcast_text(p.control.as_ref(), &verdict, &p.device)?;
        match outcome {
            Some(r) => r.map(Some),
            None if verdict.is_empty() => Ok(None),
            None => Err(Error::RankFailed { rank: 0, reason: format!("{what}: {verdict}") }.into()),
        }
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
