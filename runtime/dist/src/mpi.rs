//! Communicators over MPI (cargo feature `mpi`): the engine of CPU clusters,
//! for jobs started by `mpirun` or `srun`, through the system's Open MPI or
//! MPICH.
//!
//! An [`MpiWorld`] is this process's place in the MPI job (`MPI_COMM_WORLD`).
//! It hands out the communicator of each group the rank belongs to (the
//! world, or a group of a mesh axis), each an MPI communicator of its own,
//! used through the [`Communicator`](crate::Communicator) trait exactly as the in-process and TCP
//! communicators are.
//!
//! ```no_run
//! # fn main() -> tessera::Result<()> {
//! use tessera::dist::{mpi::MpiWorld, Communicator};
//! use tessera::{Device, Tensor};
//!
//! // Every process of `mpirun -np 4 ./program` runs this.
//! let world = MpiWorld::init()?;
//! let comm = world.communicator()?;
//! let x = Tensor::from_vec(vec![world.rank() as f32; 3], [3], &Device::cpu())?;
//! let sum = comm.all_reduce_sum(&x)?; // [6, 6, 6] on every rank
//! # Ok(()) }
//! ```
//!
//! # Threads
//!
//! A rank calls collectives from its own thread, and every communicator runs
//! its `*_async` calls on a background thread of its own (the rules of
//! [`Communicator`](crate::Communicator)); a rank with a communicator per mesh axis therefore
//! has several threads inside MPI at once, each blocked in a collective of a
//! different communicator. The world asks for `MPI_THREAD_MULTIPLE` and
//! refuses to start with less. The alternative, one lock around every MPI
//! call (`MPI_THREAD_SERIALIZED`), deadlocks with blocking calls: rank 0's
//! tensor-parallel all-reduce would hold the lock waiting for rank 1, while
//! rank 1's data-parallel one holds rank 1's lock waiting for rank 0. It
//! would work only with non-blocking collectives polled under the lock,
//! which Open MPI runs through a different, slower engine (libnbc) than its
//! tuned blocking ones, and which would put a lock and a poll loop in the
//! way of the all-reduce this backend is measured against. Open MPI (since
//! 3.0) and MPICH both provide `MPI_THREAD_MULTIPLE` in their usual builds.
//!
//! Calls on one communicator never overlap: they run one at a time in
//! program order (as in every host backend), which is also MPI's rule for
//! collectives on one communicator. Creating a group ([`MpiWorld::tagged_group`]) is
//! collective over its members (`MPI_Comm_create_group`): every member
//! calls it, and members create the groups they share in the same order
//! ([`mesh_groups`] creates one partition of the world at a time: every
//! tensor-parallel group, then every data-parallel one, and so on).
//!
//! # Sums
//!
//! [`Reduction`] chooses how `all_reduce_sum` and `reduce_scatter_sum` add:
//!
//! - **[`Native`](Reduction::Native)** (the default): MPI adds, with
//!   `MPI_Allreduce` and `MPI_Reduce_scatter_block` and `MPI_SUM`, at MPI's
//!   own speed. `bf16` and `f16`, which MPI has no type for, are widened to
//!   `f32`, summed as `f32` and rounded once, as the in-process communicator
//!   does. The order of the additions is the MPI library's (it depends on
//!   the algorithm it picks for the message size and the number of ranks),
//!   so sums may differ from the thread run's in the last bits: at most
//!   `2(n−1)·u·Σ|xᵢ|` for `n` ranks, `u` the unit roundoff of the
//!   accumulation (`2⁻²⁴` for `f32`, `bf16` and `f16`, `2⁻⁵³` for `f64`), plus
//!   one unit in the last place of `bf16`/`f16` for the final rounding.
//!   Integer sums are exact either way. Every rank receives the same bits
//!   with Open MPI's and MPICH's algorithms (each element is summed once and
//!   shared, or summed symmetrically); the standard only recommends it, and
//!   the MPI tests check it for the installed library.
//! - **[`Exact`](Reduction::Exact)**: the in-process algorithm, with MPI
//!   moving the data. `MPI_Alltoallv` gives rank `r` chunk `r` of every
//!   input, which it sums in rank order with the in-process communicator's
//!   own arithmetic, and `MPI_Allgatherv` gives everyone every summed chunk.
//!   Results are bit-identical to the thread run's, as the TCP
//!   communicator's are, at the cost of MPI's tuned reductions.
//!
//! Gathers, broadcasts, all-to-all and messages only move data, so they give
//! the same bits either way. The choice is [`MpiOptions::reduction`], or
//! `TESSERA_MPI_REDUCTION=native|exact` for [`MpiWorld::init`].
//!
//! # Mismatched calls
//!
//! MPI itself detects little: a rank that calls `MPI_Allreduce` while
//! another calls `MPI_Allgather` on the same communicator, or passes another
//! count, is erroneous and may hang, crash, or return garbage, depending on
//! the library and the message sizes; only a receive that is too short for
//! its message is reliably reported (as a truncation error). So, unless
//! [`MpiOptions::verify`] is off, every collective starts with a small
//! `MPI_Allgather` of each rank's call (the collective, its `dim` or
//! `root`, the dtype and shape of its tensor, its number in the group, and
//! whether its own arguments were valid). Every rank sees every call and
//! all reach the same verdict: a mismatch, or invalid arguments on any rank,
//! is [`Error::CollectiveMismatch`] (the invalid rank's own error on that
//! rank) on every rank, before any data moves, and the group stays usable.
//! It costs one small collective per call (a few microseconds between
//! processes of one node). What it cannot see: a rank that never calls the
//! collective at all (the others wait; see the timeout below), and calls on
//! different communicators made in orders that deadlock each other.
//! With `verify` off (`TESSERA_MPI_VERIFY=0`), a rank's own invalid
//! arguments are still its error, but its peers enter MPI and wait for it
//! until the timeout, and a mismatch is whatever the MPI library makes of it.
//! `all_to_all` and `send` carry each tensor's shape and dtype in any case.
//!
//! # Failures
//!
//! MPI (before MPI 5's fault tolerance) cannot report a lost peer and carry
//! on: after an error the library's state is undefined. So this backend
//! never returns [`Error::PeerFailed`] or [`Error::Timeout`]; the job ends
//! instead, and the launcher (`mpirun`, `srun`) ends every process and exits
//! with a failure status. Precisely:
//!
//! - **The error handler** of every communicator is `MPI_ERRORS_ARE_FATAL`
//!   (set on `MPI_COMM_WORLD`, inherited by the groups): an error inside MPI
//!   (a broken connection, a peer that died mid-transfer, exhausted
//!   resources) aborts the job from inside MPI, with the library's message.
//!   What a caller can fix (a bad `dim` or `root`, shapes that differ,
//!   mismatched calls) is found before MPI is called and returned as a typed
//!   error on every rank, as above.
//! - **A rank that dies** (killed, crashed, or exits without finalizing):
//!   Open MPI's `mpirun` sees its process end and kills every other rank of
//!   the job, reporting which rank died and how; MPICH's Hydra and `srun`
//!   (with `--kill-on-bad-exit`, which Slurm sets for MPI jobs by default in
//!   most configurations) do the same.
//! - **[`Communicator::abort`](crate::Communicator::abort)** (and [`MpiWorld::abort`]) prints
//!   `tessera: rank R aborts the MPI job: REASON` to stderr and calls
//!   `MPI_Abort(MPI_COMM_WORLD, 70)`: the launcher ends every process and
//!   exits with status 70 (Open MPI) or reports the abort (MPICH). It does
//!   not return. A rank whose thread panics while holding a communicator
//!   aborts the same way, naming the panic.
//! - **A rank that hangs**: a blocked MPI call cannot be cancelled, so a
//!   watchdog thread per process aborts the job when a call has waited past
//!   the timeout ([`MpiOptions::timeout`], `TESSERA_MPI_TIMEOUT_S`, 60 s by
//!   default, `0` for none), naming the call and the group it waited in.
//!
//! A supervisor restarts such a job from its last checkpoint, as for any
//! failure (see the launch documentation).

mod call;
mod comm;
mod watchdog;
mod wire;

use crate::groups::check_group;
use crate::host_comm::HostComm;
pub use comm::MpiComm;
use comm::MpiCore;

use crate::mesh::Mesh;
use crate::Groups;
use ::mpi::environment::Universe;
use ::mpi::topology::SimpleCommunicator;
use ::mpi::traits::{AsRaw, Communicator as _, Group as _};
use ::mpi::Threading;
use parking_lot::Mutex;
use std::collections::HashSet;
use std::fmt;
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;
use tessera_core::{Device, Error, Result};
use watchdog::Watchdog;

/// The exit status `MPI_Abort` asks the launcher for: `EX_SOFTWARE`.
pub const ABORT_CODE: i32 = 70;

/// How the MPI communicators sum (see the [module documentation](self#sums)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Reduction {
    /// MPI's own `MPI_Allreduce` and `MPI_Reduce_scatter_block`: fastest;
    /// sums may differ from the thread run's in the last bits.
    #[default]
    Native,
    /// The in-process algorithm with MPI moving the data: bit-identical to
    /// the thread run, slower.
    Exact,
}

impl Reduction {
    /// Its name in `TESSERA_MPI_REDUCTION`.
    pub fn name(self) -> &'static str {
        match self {
            Reduction::Native => "native",
            Reduction::Exact => "exact",
        }
    }
}

/// How an [`MpiWorld`] runs its communicators.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MpiOptions {
    /// How sums are computed.
    pub reduction: Reduction,
    /// Whether every collective first compares the ranks' calls (a small
    /// all-gather), so that mismatches are errors instead of whatever MPI
    /// does with them.
    pub verify: bool,
    /// How long a blocking MPI call may wait before the job is aborted;
    /// `None` waits forever.
    pub timeout: Option<Duration>,
}

impl Default for MpiOptions {
    fn default() -> Self {
        MpiOptions { reduction: Reduction::Native, verify: true, timeout: Some(MpiWorld::DEFAULT_TIMEOUT) }
    }
}

impl MpiOptions {
    /// The defaults, changed by `TESSERA_MPI_REDUCTION` (`native` or
    /// `exact`), `TESSERA_MPI_VERIFY` (`1` or `0`) and
    /// `TESSERA_MPI_TIMEOUT_S` (seconds; `0` for none) where set.
    pub fn from_env() -> Result<MpiOptions> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// [`from_env`](Self::from_env) with the variables read through `get`.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<MpiOptions> {
        let mut o = MpiOptions::default();
        if let Some(v) = get("TESSERA_MPI_REDUCTION") {
            o.reduction = match v.trim() {
                "native" => Reduction::Native,
                "exact" => Reduction::Exact,
                other => {
                    return Err(Error::environment(
                        "TESSERA_MPI_REDUCTION",
                        format!("`{other}` is not a reduction; use `native` (MPI sums, fastest) or `exact` (bit-identical to the thread run)"),
                    ))
                }
            };
        }
        if let Some(v) = get("TESSERA_MPI_VERIFY") {
            o.verify = match v.trim() {
                "1" | "true" => true,
                "0" | "false" => false,
                other => return Err(Error::environment("TESSERA_MPI_VERIFY", format!("`{other}` is not `1` or `0`"))),
            };
        }
        if let Some(v) = get("TESSERA_MPI_TIMEOUT_S") {
            let s: f64 = v
                .trim()
                .parse()
                .ok()
                .filter(|s: &f64| s.is_finite() && *s >= 0.0 && *s <= 86_400.0)
                .ok_or_else(|| Error::environment("TESSERA_MPI_TIMEOUT_S", format!("`{v}` is not a number of seconds from 0 (no timeout) to 86400")))?;
            o.timeout = (s > 0.0).then(|| Duration::from_secs_f64(s));
        }
        Ok(o)
    }
}

/// This process's rank in an MPI job, and the MPI library's state.
///
/// Cheap to clone (clones share it). MPI is initialized once per process:
/// create one world and keep it, or a clone, for as long as any of its
/// communicators is used. `MPI_Finalize` runs when the world and every
/// communicator made from it have been dropped; MPI cannot be initialized
/// again after that, in this process.
#[derive(Clone)]
pub struct MpiWorld {
    shared: Arc<Shared>,
    /// How communicators made from this handle sum and verify (see
    /// [`with_reduction`](Self::with_reduction)).
    reduction: Reduction,
    verify: bool,
}

/// What the world and its communicators share.
pub(crate) struct Shared {
    rank: usize,
    size: usize,
    timeout: Option<Duration>,
    /// Where received messages are allocated.
    device: Device,
    watchdog: Option<Watchdog>,
    /// Groups this rank already has a communicator for.
    taken: Mutex<HashSet<u64>>,
    /// Finalizes MPI when dropped, after everything else.
    universe: Mutex<Option<Universe>>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.watchdog.take();
        drop(self.universe.lock().take());
    }
}

impl fmt::Debug for MpiWorld {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MpiWorld").field("rank", &self.rank()).field("size", &self.world_size()).field("options", &self.options()).finish()
    }
}

impl MpiWorld {
    /// How long a blocking call waits by default before the job is aborted.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

    /// Initializes MPI in this process (every process of the job calls it),
    /// with the options of [`MpiOptions::from_env`]; received messages are
    /// allocated on a new CPU device.
    pub fn init() -> Result<MpiWorld> {
        Self::init_with(&Device::cpu(), MpiOptions::from_env()?)
    }

    /// Initializes MPI (`MPI_Init_thread` at `MPI_THREAD_MULTIPLE`) with
    /// `options`; messages received with [`Communicator::recv`](crate::Communicator::recv) are
    /// allocated on `device`, this rank's CPU device.
    pub fn init_with(device: &Device, options: MpiOptions) -> Result<MpiWorld> {
        const OP: &str = "MpiWorld::init";
        if let Device::Cuda(d) = device {
            return d.unsupported("MPI communicators (they move host memory; CUDA ranks communicate through NCCL)");
        }
        let Some((universe, threading)) = ::mpi::initialize_with_threading(Threading::Multiple) else {
            let why = if ::mpi::environment::is_finalized() {
                "MPI was already finalized in this process (every MpiWorld and its communicators were dropped), and MPI cannot start twice: keep the world for the life of the process"
            } else {
                "MPI is already initialized in this process: create one MpiWorld and clone it"
            };
            return Err(Error::unsupported(OP, why));
        };
        if threading < Threading::Multiple {
            drop(universe);
            return Err(Error::unsupported(
                OP,
                format!("the MPI library provides threading level {threading:?}, but Tessera's MPI communicators call MPI from several threads at once (MPI_THREAD_MULTIPLE); use an MPI built with thread support (Open MPI 3.0 or later, MPICH with --enable-threads=multiple)"),
            ));
        }
        let world = universe.world();
        // SAFETY: MPI is initialized; MPI_COMM_WORLD and the predefined
        // handler are valid handles for its whole life.
        unsafe { ::mpi::ffi::MPI_Comm_set_errhandler(world.as_raw(), ::mpi::ffi::RSMPI_ERRORS_ARE_FATAL) };
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        let watchdog = options.timeout.map(|t| Watchdog::start(rank, t)).transpose()?;
        let shared =
            Shared { rank, size, timeout: options.timeout, device: device.clone(), watchdog, taken: Mutex::default(), universe: Mutex::new(Some(universe)) };
        Ok(MpiWorld { shared: Arc::new(shared), reduction: options.reduction, verify: options.verify })
    }

    /// This process's rank in `MPI_COMM_WORLD`.
    pub fn rank(&self) -> usize {
        self.shared.rank
    }

    /// Number of processes in the job.
    pub fn world_size(&self) -> usize {
        self.shared.size
    }

    /// The options communicators made from this handle run with.
    pub fn options(&self) -> MpiOptions {
        MpiOptions { reduction: self.reduction, verify: self.verify, timeout: self.shared.timeout }
    }

    /// A handle on the same world whose communicators sum with `reduction`
    /// (those made before keep theirs): a program may use both kinds side
    /// by side.
    pub fn with_reduction(&self, reduction: Reduction) -> MpiWorld {
        MpiWorld { reduction, ..self.clone() }
    }

    /// A handle on the same world whose communicators compare the ranks'
    /// calls before each collective, or not (see [`MpiOptions::verify`]).
    pub fn with_verify(&self, verify: bool) -> MpiWorld {
        MpiWorld { verify, ..self.clone() }
    }

    /// The device received messages are allocated on.
    pub fn device(&self) -> &Device {
        &self.shared.device
    }

    /// The MPI library's own description of itself (`MPI_Get_library_version`).
    pub fn library_version() -> String {
        ::mpi::environment::library_version().unwrap_or_else(|e| format!("(not UTF-8: {e})"))
    }

    /// The communicator of the whole job (every rank calls it).
    pub fn communicator(&self) -> Result<MpiComm> {
        let all: Vec<usize> = (0..self.world_size()).collect();
        self.tagged_group("world", &all)
    }

    /// This rank's communicator in the group of world ranks `ranks` (member
    /// `i` has group rank `i`) named `tag`: groups with different tags are
    /// independent even when their members are the same.
    ///
    /// Creating a group is collective over its members: each calls this
    /// with the same tag and list, and members create the groups they have
    /// in common in the same order (it returns once every member has
    /// called it). Asking twice for the same group is an error.
    pub fn tagged_group(&self, tag: &str, ranks: &[usize]) -> Result<MpiComm> {
        const OP: &str = "MpiWorld::group";
        let id = check_group(OP, self.rank(), self.world_size(), tag, ranks)?;
        if !self.shared.taken.lock().insert(id) {
            return Err(Error::state_mismatch(OP, format!("rank {} already has a communicator for group {tag:?} {ranks:?}", self.rank())));
        }
        let name: Arc<str> = format!("{tag:?} {ranks:?}").into();
        let world = SimpleCommunicator::world();
        let members: Vec<i32> = ranks.iter().map(|&r| r as i32).collect();
        let group = world.group().include(&members);
        // The tag keeps concurrent creations of different groups apart; any
        // value up to 32767 is valid under every MPI.
        let mpi_tag = (id % 32_768) as i32;
        let comm = {
            let _w = self.shared.watchdog.as_ref().map(|w| w.watch("creating the group", &name));
            world.split_by_subgroup_with_tag(&group, mpi_tag)
        }
        .ok_or_else(|| Error::topology(OP, format!("MPI created no communicator for group {name}")))?;
        Ok(HostComm::new(MpiCore::new(self.shared.clone(), comm, ranks.to_vec(), name, self.reduction, self.verify)))
    }

    /// Aborts the job on behalf of this rank (see [`Communicator::abort`](crate::Communicator::abort)).
    pub fn abort(&self, reason: &str) -> ! {
        abort_job(&format!("aborted: {reason}"))
    }
}

/// Prints why and aborts the whole job (`MPI_Abort` on `MPI_COMM_WORLD`);
/// never returns.
pub(crate) fn abort_job(reason: &str) -> ! {
    let rank = SimpleCommunicator::world().rank();
    let _ = writeln!(std::io::stderr(), "tessera: rank {rank} aborts the MPI job: {reason}");
    // SAFETY: only code holding a live world gets here, so MPI is
    // initialized and not finalized; MPI_Abort may be called from any
    // thread at MPI_THREAD_MULTIPLE.
    unsafe { ::mpi::ffi::MPI_Abort(::mpi::ffi::RSMPI_COMM_WORLD, ABORT_CODE) };
    std::process::abort()
}

/// This process's communicators for every axis of `mesh` and for its data
/// replicas, each group tagged with its axis so that groups with the same
/// members stay independent. Every rank of the job calls it.
pub fn mesh_groups(world: &MpiWorld, mesh: &Mesh) -> Result<Groups> {
    let n = world.world_size();
    let world_is = format!("the MPI job has {n} processes");
    let fix = format!("start as many processes as the mesh has ranks (`mpirun -np {}`)", mesh.world());
    Groups::of_mesh(mesh, world.rank(), (n, &world_is, &fix), |tag, members| Ok(Arc::new(world.tagged_group(tag, members)?)))
}
