//! `tessera profile`: this machine, measured for the planner.
//!
//! What each of `--ranks` CPU ranks (threads of one process, sharing the
//! machine) can do while all of them work: matrix-product rates by shape
//! and dtype, memory bandwidth, and the in-process communicator's
//! all-reduce fitted to a latency and bandwidth per group size. Started by
//! a launcher (`tessera launch`, torchrun, Slurm), every process is a rank
//! and the job's own communicators are measured instead: shared memory
//! inside a node, TCP between nodes, or MPI (`--comm mpi`). With `--device
//! cuda` it measures a node of this machine's GPUs (cuBLAS products, NCCL's
//! all-reduce), or under a launcher a job of processes with a GPU each,
//! NCCL inside and between nodes. The result is a profile file
//! (docs/planner.md) that the planner reads as it reads the shipped A100,
//! H100 and H200 profiles.

use anyhow::Context;
use std::path::PathBuf;
use std::time::Duration;
use tessera::dist::env::ProcessEnv;
use tessera::dist::process::ProcessWorld;
use tessera::dist::store::Rendezvous;
use tessera::Device;
use tessera_plan::job::{profile_job, JobRanks};
use tessera_plan::machine::{profile_cpu, profile_cuda};
use tessera_plan::measure::Budget;

/// Arguments of `tessera profile`.
#[derive(clap::Args)]
pub struct Args {
    /// Where to write the profile (TOML); without it, stdout.
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
    /// The profile's name.
    #[arg(long, default_value = "this-machine")]
    name: String,
    /// CPU ranks that share the machine, as a job on it would run them
    /// (default 8). Under a launcher the processes are the ranks.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=1024))]
    ranks: Option<u16>,
    /// What the ranks run on: `cpu`, or `cuda` (this machine's GPUs, a node
    /// of `--gpus` of them, NCCL between them; under a launcher, a GPU per
    /// process; a build with the cuda feature).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    device: String,
    /// With `--device cuda` and no launcher: the GPUs of the node (this
    /// machine's first ones).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=1024))]
    gpus: u16,
    /// Under a launcher, what connects the processes: `tcp` (Tessera's own
    /// connections, shared memory inside a node) or `mpi` (the job's MPI
    /// library, for jobs started by mpirun or srun; a build with the mpi
    /// feature), as `mesh.comm` chooses for training.
    #[arg(long, default_value = "tcp", value_parser = ["tcp", "mpi"])]
    comm: String,
    /// Seconds spent timing each figure (more: steadier figures).
    #[arg(long, default_value_t = 0.3)]
    seconds_per_figure: f64,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if !(args.seconds_per_figure.is_finite() && args.seconds_per_figure > 0.0 && args.seconds_per_figure <= 3600.0) {
        anyhow::bail!("--seconds-per-figure is {}; give a number of seconds above 0 (at most 3600)", args.seconds_per_figure);
    }
    let budget = Budget { per_figure: Duration::from_secs_f64(args.seconds_per_figure) };
    let (profile, what) = match ProcessEnv::detect()? {
        Some(_) if args.device == "cuda" && args.comm == "mpi" => {
            anyhow::bail!("--device cuda under a launcher measures NCCL between the processes (their ids go through the job's store); drop --comm mpi")
        }
        Some(env) => {
            if args.ranks.is_some() {
                anyhow::bail!("--ranks is for ranks as threads; under a launcher the processes are the ranks ({} of them): drop --ranks", env.world_size);
            }
            if env.rank == 0 {
                eprintln!("tessera profile: measuring a job of {} processes, {} per node", env.world_size, env.local_world_size);
            }
            if env.rank == 0 && args.device == "cpu" {
                // Rank 0 measures the device for its node's ranks as threads
                // sharing the node, as `--ranks` does: with the node's cores
                // (a launcher gives each rank its share, RAYON_NUM_THREADS).
                let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
                rayon::ThreadPoolBuilder::new().num_threads(cores).build_global().context("sizing the thread pool")?;
            }
            // Rank 0 measures the device while the others wait at a barrier:
            // allow them that long and more.
            let timeout = Duration::from_secs_f64(120.0 + 300.0 * args.seconds_per_figure);
            let measured = if args.device == "cuda" {
                profile_gpu_job(&args.name, &env, timeout, budget)?
            } else if args.comm == "mpi" {
                profile_mpi_job(&args.name, &env, timeout, budget)?
            } else {
                let rendezvous = Rendezvous::join(&env, timeout).context("joining the job")?;
                let world = ProcessWorld::join(&rendezvous, &Device::cpu(), timeout).context("connecting the job's ranks")?;
                profile_job(&args.name, JobRanks::Process(&world), env.local_world_size, budget).context("measuring the job")?
            };
            match measured {
                Some(p) if args.device == "cuda" => {
                    (p, format!("a job of {} processes with a GPU each, {} per node, over NCCL", env.world_size, env.local_world_size))
                }
                Some(p) => (p, format!("a job of {} CPU processes, {} per node, over {}", env.world_size, env.local_world_size, args.comm)),
                // Rank 0 reports and writes.
                None => return Ok(()),
            }
        }
        None if args.comm == "mpi" => {
            anyhow::bail!("--comm mpi measures a job started by mpirun or srun, and this process was not; run `mpirun -np N tessera profile --comm mpi`")
        }
        None if args.device == "cuda" => {
            if args.ranks.is_some() {
                anyhow::bail!("--ranks counts CPU ranks; with --device cuda give --gpus");
            }
            let gpus = usize::from(args.gpus);
            eprintln!("tessera profile: measuring {gpus} GPUs of this machine");
            (profile_cuda(&args.name, gpus, budget).context("measuring this machine's GPUs")?, format!("a node of {gpus} GPUs"))
        }
        None => {
            let ranks = usize::from(args.ranks.unwrap_or(8));
            eprintln!("tessera profile: measuring {ranks} CPU ranks sharing this machine (about {:.0} s)", args.seconds_per_figure * 120.0 + 2.0);
            (profile_cpu(&args.name, ranks, budget).context("measuring this machine")?, format!("this machine for {ranks} CPU ranks"))
        }
    };
    let d = &profile.device;
    eprintln!(
        "per rank: f32 {:.1} GFLOP/s, bf16 {:.1} GFLOP/s (best shape), memory {:.1} GB/s, {:.1} GiB",
        d.peak_flops["f32"] / 1e9,
        d.peak_flops["bf16"] / 1e9,
        d.memory_bandwidth / 1e9,
        d.memory_bytes as f64 / (1u64 << 30) as f64
    );
    for fit in &profile.intra_node.by_size {
        eprintln!("all-reduce over {} ranks: {:.1} us per step, {:.2} GB/s", fit.size, fit.latency * 1e6, fit.bandwidth / 1e9);
    }
    for fit in profile.inter_node.iter().flat_map(|l| &l.by_size) {
        eprintln!("all-reduce over {} nodes: {:.1} us per step, {:.2} GB/s", fit.size, fit.latency * 1e6, fit.bandwidth / 1e9);
    }
    let text = format!("# A profile of {what}, written by `tessera profile`.\n{}", profile.to_toml());
    match &args.out {
        Some(path) => {
            tessera::file::write_atomic(path, text.as_bytes()).with_context(|| format!("cannot write `{}`", path.display()))?;
            eprintln!("wrote {}", path.display());
        }
        None => say!("{}", text.trim_end()),
    }
    Ok(())
}

/// Measures the MPI job this process is a rank of (`--comm mpi`).
#[cfg(feature = "mpi")]
fn profile_mpi_job(name: &str, env: &ProcessEnv, timeout: Duration, budget: Budget) -> anyhow::Result<Option<tessera_plan::profile::ClusterProfile>> {
    use tessera::dist::mpi::{MpiOptions, MpiWorld};
    let options = MpiOptions { timeout: Some(timeout), ..MpiOptions::from_env()? };
    let world = MpiWorld::init_with(&Device::cpu(), options).context("starting MPI")?;
    if (world.rank(), world.world_size()) != (env.rank, env.world_size) {
        anyhow::bail!(
            "MPI says this process is rank {} of {}, but the launcher's variables say rank {} of {}: start the job with the MPI's own launcher",
            world.rank(),
            world.world_size(),
            env.rank,
            env.world_size
        );
    }
    profile_job(name, JobRanks::Mpi(&world), env.local_world_size, budget).context("measuring the job")
}

/// Without MPI in the build there is no MPI job to measure.
#[cfg(not(feature = "mpi"))]
fn profile_mpi_job(_: &str, _: &ProcessEnv, _: Duration, _: Budget) -> anyhow::Result<Option<tessera_plan::profile::ClusterProfile>> {
    anyhow::bail!("--comm mpi needs a build with the mpi feature (`cargo build --release -p tessera-cli --features mpi`, and MPI installed; see docs/launch.md), or use --comm tcp")
}

/// Measures the job of processes with a GPU each that this process is a
/// rank of (`--device cuda` under a launcher): its local rank's GPU, NCCL
/// between the processes, inside the node and between nodes.
#[cfg(feature = "cuda")]
fn profile_gpu_job(name: &str, env: &ProcessEnv, timeout: Duration, budget: Budget) -> anyhow::Result<Option<tessera_plan::profile::ClusterProfile>> {
    let device = Device::cuda(env.local_rank).with_context(|| format!("opening GPU {} for local rank {}", env.local_rank, env.local_rank))?;
    let rendezvous = Rendezvous::join(env, timeout).context("joining the job")?;
    let world = ProcessWorld::join(&rendezvous, &Device::cpu(), timeout).context("connecting the job's ranks")?;
    let job = JobRanks::Gpus { world: &world, rendezvous: &rendezvous, device: &device };
    profile_job(name, job, env.local_world_size, budget).context("measuring the job")
}

/// Without the CUDA backend there are no GPUs to measure.
#[cfg(not(feature = "cuda"))]
fn profile_gpu_job(_: &str, _: &ProcessEnv, _: Duration, _: Budget) -> anyhow::Result<Option<tessera_plan::profile::ClusterProfile>> {
    anyhow::bail!("--device cuda needs a build with the cuda feature (`cargo build --release -p tessera-cli --features cuda`; see docs/cuda.md)")
}
