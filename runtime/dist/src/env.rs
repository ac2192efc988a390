//! Where this process stands in a job whose ranks are processes: its rank,
//! the world size, its place on its node and the address of rank 0, read
//! from the variables a launcher sets.
//!
//! ```
//! use tessera::dist::env::{Launcher, ProcessEnv};
//!
//! let vars = [("RANK", "5"), ("WORLD_SIZE", "8"), ("LOCAL_RANK", "1"), ("LOCAL_WORLD_SIZE", "4"), ("MASTER_ADDR", "node01")];
//! let get = |k: &str| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string());
//! let env = ProcessEnv::from_vars(get)?.expect("a launcher's variables are set");
//! assert_eq!((env.rank, env.world_size, env.node_rank, env.master_port), (5, 8, 1, 29500));
//! assert_eq!(env.launcher, Launcher::Torchrun);
//!
//! // No launcher variables at all: a plain single-process run.
//! assert_eq!(ProcessEnv::from_vars(|_| None)?, None);
//! # Ok::<(), tessera::Error>(())
//! ```
//!
//! # Which launcher wins
//!
//! Launchers nest: `tessera launch` or torchrun may run inside an `mpirun`
//! or a Slurm job, and `mpirun` inside a Slurm allocation. The innermost
//! launcher started this process, and its variables describe it; the outer
//! ones' variables are inherited and describe the enclosing job. So the
//! sources are tried in this order and the first that is present is used,
//! alone (variables of different launchers are never mixed):
//!
//! 1. **torchrun-style** ([`Launcher::Torchrun`]: `tessera launch`, torchrun,
//!    or set by hand) when any of `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//!    `LOCAL_WORLD_SIZE` is set. All four are then required (torchrun and
//!    `tessera launch` set them all; by hand on one node, `LOCAL_RANK=RANK`
//!    and `LOCAL_WORLD_SIZE=WORLD_SIZE`). `GROUP_RANK`, if set, is the node
//!    rank.
//! 2. **Open MPI** ([`Launcher::OpenMpi`]) when any `OMPI_COMM_WORLD_*`
//!    variable is set: `OMPI_COMM_WORLD_RANK`, `_SIZE`, `_LOCAL_RANK` and
//!    `_LOCAL_SIZE` are required. (`OMPI_COMM_WORLD_NODE_RANK` is not read:
//!    despite its name it is a process's rank among all processes on its
//!    node, not the node's index.)
//! 3. **MPICH / Intel MPI / MVAPICH** (Hydra's PMI, [`Launcher::Mpich`])
//!    when `PMI_RANK` or `PMI_SIZE` is set: `PMI_RANK`, `PMI_SIZE`,
//!    `MPI_LOCALRANKID` and `MPI_LOCALNRANKS` are required, except that
//!    when the two local variables are both absent and a Slurm step is
//!    present, the PMI variables came from Slurm's own PMI plugin
//!    (`srun --mpi=pmi2`) and the Slurm step is used instead.
//! 4. **Slurm** ([`Launcher::Slurm`]) when this process is a task of a job
//!    step started by `srun`: see below.
//!
//! When none is present, [`ProcessEnv::from_vars`] returns `Ok(None)`: a
//! plain single-process run.
//!
//! # Common rules
//!
//! - `MASTER_ADDR` and `MASTER_PORT`, when set, name rank 0's rendezvous
//!   store under every launcher. Without `MASTER_PORT` the port is 29500
//!   (torchrun's default), except under Slurm (below). Without
//!   `MASTER_ADDR` the address is `127.0.0.1` when every rank runs on this
//!   node (the local world is the world), the first host of the step under
//!   Slurm, and otherwise an [`Error::Environment`] that says how to export
//!   it (`mpirun -x MASTER_ADDR=<host of rank 0>`).
//! - The node rank is `GROUP_RANK` under torchrun and `SLURM_NODEID` under
//!   Slurm when set; otherwise `rank / local_world_size`, which is right
//!   when every node runs the same number of ranks, numbered node by node
//!   (the default placement of every launcher above).
//! - The restart count is `TESSERA_RESTART_COUNT`, else
//!   `TORCHELASTIC_RESTART_COUNT`, else (under Slurm) `SLURM_RESTART_COUNT`
//!   (a requeued job), else 0.
//! - Every malformed value, partial set or contradiction (a rank not below
//!   the world size, a local rank not below the local size, a port out of
//!   range, an unparsable node list) is an [`Error::Environment`] that names
//!   the variable, its value and the fix. Nothing here panics.
//!
//! # Slurm
//!
//! A batch script (`sbatch`) and an `salloc` shell carry `SLURM_*`
//! variables too, often `SLURM_PROCID=0` and `SLURM_NTASKS=N`, but they are
//! not tasks of a step: a program run straight from the script must not
//! take itself for rank 0 of `N` and wait for `N - 1` peers that will never
//! come. Slurm sets `SLURM_STEP_ID` (and the older `SLURM_STEPID`) only in
//! the tasks of a step; the batch script, the external step and the
//! interactive step either lack it or carry one of Slurm's reserved step ids
//! (`0xFFFFFFF0` and above). So Slurm is used only when one of the two
//! holds an ordinary step id; otherwise the Slurm variables are ignored.
//!
//! Within a step:
//! - rank `SLURM_PROCID`, local rank `SLURM_LOCALID`, node rank
//!   `SLURM_NODEID`;
//! - world size `SLURM_STEP_NUM_TASKS`, else `SLURM_NTASKS` (the step's
//!   own count is right even under `srun --preserve-env`);
//! - local world size: this node's entry of `SLURM_STEP_TASKS_PER_NODE`,
//!   else of `SLURM_TASKS_PER_NODE` (both like `4(x2),3`), else
//!   `SLURM_NTASKS_PER_NODE`;
//! - master address: `MASTER_ADDR`, else the first host of
//!   `SLURM_STEP_NODELIST`, else of `SLURM_JOB_NODELIST`, else of
//!   `SLURM_NODELIST` (task 0 of a step runs on its first node; see
//!   [`hostlist`] for the syntax);
//! - master port: `MASTER_PORT`, else `20000 + 10 · (job id mod 1000) +
//!   (step id mod 10)` from `SLURM_JOB_ID` (or `SLURM_JOBID`) and the step
//!   id, else 29500. The port is the same on every task of a step, differs
//!   between concurrent steps of one job and between jobs whose ids differ
//!   in their last three digits, and stays in 20000..=29999, below Linux's
//!   ephemeral range (32768 and up), so that outgoing connections do not
//!   take it. Two jobs sharing a first node and the last three digits of
//!   their id collide: rank 0's bind then fails with an error that says to
//!   set `MASTER_PORT`.

pub mod hostlist;

use std::fmt;
use std::net::IpAddr;
use tessera_core::{Error, Result};

/// The launcher that started this process, as told by its variables.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Launcher {
    /// `tessera launch`, torchrun, or variables set by hand: `RANK`,
    /// `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`.
    Torchrun,
    /// Open MPI's `mpirun`: `OMPI_COMM_WORLD_*`.
    OpenMpi,
    /// MPICH, Intel MPI or MVAPICH through Hydra: `PMI_RANK`, `PMI_SIZE`,
    /// `MPI_LOCALRANKID`, `MPI_LOCALNRANKS`.
    Mpich,
    /// A task of a Slurm job step (`srun`): `SLURM_PROCID` and friends.
    Slurm,
}

impl Launcher {
    /// The variable that gives the rank under this launcher.
    pub fn rank_var(self) -> &'static str {
        match self {
            Launcher::Torchrun => "RANK",
            Launcher::OpenMpi => "OMPI_COMM_WORLD_RANK",
            Launcher::Mpich => "PMI_RANK",
            Launcher::Slurm => "SLURM_PROCID",
        }
    }

    /// The variable that gives the world size under this launcher.
    pub fn world_size_var(self) -> &'static str {
        match self {
            Launcher::Torchrun => "WORLD_SIZE",
            Launcher::OpenMpi => "OMPI_COMM_WORLD_SIZE",
            Launcher::Mpich => "PMI_SIZE",
            Launcher::Slurm => "SLURM_STEP_NUM_TASKS",
        }
    }
}

impl fmt::Display for Launcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Launcher::Torchrun => "torchrun-style variables",
            Launcher::OpenMpi => "Open MPI",
            Launcher::Mpich => "MPICH (Hydra/PMI)",
            Launcher::Slurm => "a Slurm step",
        })
    }
}

/// This process's place in a job whose ranks are processes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessEnv {
    /// This process's rank in the world, `0..world_size`.
    pub rank: usize,
    /// The number of ranks in the job.
    pub world_size: usize,
    /// This process's rank among the ranks of its node, `0..local_world_size`.
    pub local_rank: usize,
    /// The number of ranks on this process's node.
    pub local_world_size: usize,
    /// The index of this process's node: `GROUP_RANK` under torchrun,
    /// `SLURM_NODEID` under Slurm, otherwise `rank / local_world_size`.
    pub node_rank: usize,
    /// The host (name or address) of rank 0, which serves the rendezvous store.
    pub master_addr: String,
    /// The port of rank 0's rendezvous store.
    pub master_port: u16,
    /// Which attempt of the job this is: 0 for the first, one more after
    /// each restart by a supervisor.
    pub restart: u32,
    /// The launcher whose variables these are.
    pub launcher: Launcher,
}

/// The port torchrun uses when `MASTER_PORT` is not set.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// Slurm's reserved step ids (batch script, external, interactive, pending
/// steps and others) start here; an ordinary step id is below it.
const SLURM_RESERVED_STEP_IDS: u64 = 0xFFFF_FFF0;

impl ProcessEnv {
    /// This process's place, read from its environment; `Ok(None)` when no
    /// launcher's variables are present (a plain single-process run). See
    /// the [module documentation](self) for the sources and their order.
    pub fn detect() -> Result<Option<ProcessEnv>> {
        Self::from_vars(|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
    }

    /// [`ProcessEnv::detect`] over the variables `get` returns (`None` for
    /// an unset variable): the same rules, testable without touching the
    /// process's environment.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Option<ProcessEnv>> {
        let v = Vars(&get);
        // Each source is looked at only when no source before it is
        // present, so a stray variable of an outer launcher cannot fail a
        // run that an inner launcher describes completely.
        let found = if v.any(&["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"]) {
            torchrun(&v)?
        } else if v.any(&["OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"]) {
            open_mpi(&v)?
        } else if v.any(&["PMI_RANK", "PMI_SIZE"]) && (v.any(&["MPI_LOCALRANKID", "MPI_LOCALNRANKS"]) || slurm_step(&v)?.is_none()) {
            mpich(&v)?
        } else if let Some(step) = slurm_step(&v)? {
            slurm(&v, step)?
        } else {
            return Ok(None);
        };
        found.finish(&v).map(Some)
    }

    /// Whether every rank of the job runs on this node.
    pub fn single_node(&self) -> bool {
        self.local_world_size == self.world_size
    }
}

/// Access to the variables, with parsing that names what it reads.
struct Vars<'a>(&'a dyn Fn(&str) -> Option<String>);

impl Vars<'_> {
    fn get(&self, name: &str) -> Option<String> {
        (self.0)(name)
    }

    fn any(&self, names: &[&str]) -> bool {
        names.iter().any(|n| self.get(n).is_some())
    }

    /// The first of `names` that is set, with its value.
    fn first(&self, names: &[&'static str]) -> Option<(&'static str, String)> {
        names.iter().find_map(|n| self.get(n).map(|v| (*n, v)))
    }

    /// A whole number, if the variable is set.
    fn number(&self, name: &str, meaning: &str) -> Result<Option<u64>> {
        match self.get(name) {
            None => Ok(None),
            Some(value) => parse_number(&value).map(Some).ok_or_else(|| {
                Error::environment(
                    name,
                    format!("`{value}` is not a whole number; {name} must be {meaning}, as the launcher sets it: unset it or give a number"),
                )
            }),
        }
    }

    /// A whole number that must be set because `because` is.
    fn required(&self, name: &str, meaning: &str, because: &str) -> Result<u64> {
        self.number(name, meaning)?.ok_or_else(|| {
            Error::environment(name, format!("not set, but {because} is: the launcher's variables are incomplete; {name} must be {meaning} (launch with `tessera launch`, torchrun, srun or mpirun, which set all of them, or set it too)"))
        })
    }
}

/// A non-negative decimal number (surrounding whitespace allowed).
fn parse_number(s: &str) -> Option<u64> {
    let t = s.trim();
    if t.is_empty() || !t.bytes().all(|b| b.is_ascii_digit()) || t.len() > 19 {
        return None;
    }
    t.parse().ok()
}

/// What a launcher's variables say, before the checks common to all.
struct Found {
    launcher: Launcher,
    /// (variable, value) of each field, for error messages.
    rank: (&'static str, u64),
    world: (&'static str, u64),
    local_rank: (&'static str, u64),
    local_world: (&'static str, u64),
    node_rank: Option<(&'static str, u64)>,
    /// The id of the Slurm step, when this process is one of its tasks: it
    /// gives the default master address and port, and the restart count.
    slurm_step: Option<u64>,
    /// A hint for the missing-MASTER_ADDR error.
    addr_hint: &'static str,
}

impl Found {
    fn finish(self, v: &Vars<'_>) -> Result<ProcessEnv> {
        let (rank_var, rank) = self.rank;
        let (world_var, world) = self.world;
        let (lrank_var, local_rank) = self.local_rank;
        let (lworld_var, local_world) = self.local_world;
        if world == 0 {
            return Err(Error::environment(world_var, format!("is 0; {world_var} is the number of ranks in the job and must be at least 1")));
        }
        if rank >= world {
            return Err(Error::environment(
                rank_var,
                format!("{rank_var}={rank} is not below {world_var}={world}: ranks are numbered 0 to {}; fix whichever of the two is wrong", world - 1),
            ));
        }
        if local_world == 0 {
            return Err(Error::environment(lworld_var, format!("is 0; {lworld_var} is the number of ranks on this node and must be at least 1")));
        }
        if local_rank >= local_world {
            return Err(Error::environment(
                lrank_var,
                format!(
                    "{lrank_var}={local_rank} is not below {lworld_var}={local_world}: local ranks are numbered 0 to {}; fix whichever of the two is wrong",
                    local_world - 1
                ),
            ));
        }
        if local_world > world {
            return Err(Error::environment(
                lworld_var,
                format!("{lworld_var}={local_world} is more than {world_var}={world}: a node cannot run more ranks than the whole job; fix whichever of the two is wrong"),
            ));
        }
        let node_rank = match self.node_rank {
            Some((var, n)) if n >= world => {
                return Err(Error::environment(
                    var,
                    format!("{var}={n} is not below {world_var}={world}: there cannot be more nodes than ranks; fix or unset {var}"),
                ));
            }
            Some((_, n)) => n,
            None => rank / local_world,
        };

        let restart = restart(v, self.slurm_step.is_some())?;
        let master_port = match v.get("MASTER_PORT") {
            None => match self.slurm_step {
                None => DEFAULT_MASTER_PORT,
                Some(step) => slurm_port(v, step)?,
            },
            Some(p) => match parse_number(&p) {
                Some(n @ 1..=65535) => n as u16,
                _ => {
                    return Err(Error::environment(
                        "MASTER_PORT",
                        format!("`{p}` is not a TCP port; MASTER_PORT must be a number from 1 to 65535 naming the port of rank 0's rendezvous store, e.g. {DEFAULT_MASTER_PORT}"),
                    ))
                }
            },
        };
        let master_addr = match v.get("MASTER_ADDR") {
            Some(a) => check_host(&a)?,
            None => match self.slurm_step {
                Some(_) => slurm_master(v)?,
                None if local_world == world => "127.0.0.1".to_string(),
                None => {
                    return Err(Error::environment(
                        "MASTER_ADDR",
                        format!(
                            "not set, and the {world} ranks of this job span more than one node ({lworld_var}={local_world} of {world_var}={world}), so the host of rank 0 is unknown; export the host name or address of rank 0's node as MASTER_ADDR to every rank, {}",
                            self.addr_hint
                        ),
                    ))
                }
            },
        };
        Ok(ProcessEnv {
            rank: rank as usize,
            world_size: world as usize,
            local_rank: local_rank as usize,
            local_world_size: local_world as usize,
            node_rank: node_rank as usize,
            master_addr,
            master_port,
            restart,
            launcher: self.launcher,
        })
    }
}

/// The port of a Slurm step's store: `20000 + 10 · (job id mod 1000) +
/// (step id mod 10)`, or the default without a job id.
fn slurm_port(v: &Vars<'_>, step: u64) -> Result<u16> {
    let Some((name, _)) = v.first(&["SLURM_JOB_ID", "SLURM_JOBID"]) else { return Ok(DEFAULT_MASTER_PORT) };
    let id = v.number(name, "the Slurm job id (set MASTER_PORT to choose the port instead)")?.unwrap_or(0);
    Ok(20000 + 10 * (id % 1000) as u16 + (step % 10) as u16)
}

/// The host of task 0 of a Slurm step: the first host of its node list.
fn slurm_master(v: &Vars<'_>) -> Result<String> {
    match v.first(&["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"]) {
        Some((name, list)) => hostlist::first(list.trim()).map_err(|e| {
            Error::environment(name, format!("`{list}` is not a Slurm host list such as `node[01-04,07],gpu-a1`: {e}; set MASTER_ADDR to the host of task 0 instead"))
        }),
        None => Err(Error::environment(
            "SLURM_JOB_NODELIST",
            "none of SLURM_STEP_NODELIST, SLURM_JOB_NODELIST or SLURM_NODELIST is set in this Slurm step, so the host of task 0 is unknown; set MASTER_ADDR to it",
        )),
    }
}

/// `MASTER_ADDR` checked: a host name or an IP address (IPv6 may be in brackets).
fn check_host(raw: &str) -> Result<String> {
    let a = raw.trim();
    let unbracketed = a.strip_prefix('[').and_then(|s| s.strip_suffix(']')).unwrap_or(a);
    if unbracketed.parse::<IpAddr>().is_ok() {
        return Ok(unbracketed.to_string());
    }
    // A fully qualified name may end with the root's dot.
    let name = a.strip_suffix('.').unwrap_or(a);
    let name_ok = !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| !label.is_empty() && label.len() <= 63 && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'));
    if name_ok {
        Ok(a.to_string())
    } else {
        Err(Error::environment(
            "MASTER_ADDR",
            format!("`{raw}` is neither a host name nor an IP address; MASTER_ADDR must name the host of rank 0, e.g. `node01`, `10.0.0.5` or `127.0.0.1` (no scheme, no port: the port goes in MASTER_PORT)"),
        ))
    }
}

fn restart(v: &Vars<'_>, slurm: bool) -> Result<u32> {
    let mut names = vec!["TESSERA_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"];
    if slurm {
        names.push("SLURM_RESTART_COUNT");
    }
    let Some((name, value)) = v.first(&names) else { return Ok(0) };
    match parse_number(&value) {
        Some(n) if n <= u32::MAX as u64 => Ok(n as u32),
        _ => Err(Error::environment(
            name,
            format!("`{value}` is not a restart count; {name} must be a whole number (0 for the first attempt of the job, set by the supervisor that restarts it): unset it or give a number"),
        )),
    }
}

fn torchrun(v: &Vars<'_>) -> Result<Found> {
    let because = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"].into_iter().find(|n| v.get(n).is_some()).unwrap_or("RANK");
    let rank = v.required("RANK", "this process's rank, from 0 to WORLD_SIZE-1", because)?;
    let world = v.required("WORLD_SIZE", "the number of ranks in the job", because)?;
    let local_rank = v.required("LOCAL_RANK", "this process's rank on its node, from 0 to LOCAL_WORLD_SIZE-1 (equal to RANK on a single node)", because)?;
    let local_world = v.required("LOCAL_WORLD_SIZE", "the number of ranks on this node (equal to WORLD_SIZE on a single node)", because)?;
    let node_rank = v.number("GROUP_RANK", "the index of this node among the job's nodes")?;
    Ok(Found {
        launcher: Launcher::Torchrun,
        rank: ("RANK", rank),
        world: ("WORLD_SIZE", world),
        local_rank: ("LOCAL_RANK", local_rank),
        local_world: ("LOCAL_WORLD_SIZE", local_world),
        node_rank: node_rank.map(|n| ("GROUP_RANK", n)),
        slurm_step: None,
        addr_hint: "e.g. `tessera launch --master-addr <host>` or `torchrun --master-addr <host>`",
    })
}

fn open_mpi(v: &Vars<'_>) -> Result<Found> {
    let because = ["OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"]
        .into_iter()
        .find(|n| v.get(n).is_some())
        .unwrap_or("OMPI_COMM_WORLD_RANK");
    let rank = v.required("OMPI_COMM_WORLD_RANK", "this process's rank in MPI_COMM_WORLD", because)?;
    let world = v.required("OMPI_COMM_WORLD_SIZE", "the size of MPI_COMM_WORLD", because)?;
    let local_rank = v.required("OMPI_COMM_WORLD_LOCAL_RANK", "this process's rank on its node", because)?;
    let local_world = v.required("OMPI_COMM_WORLD_LOCAL_SIZE", "the number of ranks on this node", because)?;
    Ok(Found {
        launcher: Launcher::OpenMpi,
        rank: ("OMPI_COMM_WORLD_RANK", rank),
        world: ("OMPI_COMM_WORLD_SIZE", world),
        local_rank: ("OMPI_COMM_WORLD_LOCAL_RANK", local_rank),
        local_world: ("OMPI_COMM_WORLD_LOCAL_SIZE", local_world),
        node_rank: None,
        slurm_step: None,
        addr_hint: "e.g. `mpirun -x MASTER_ADDR=<host of rank 0> -x MASTER_PORT=29500 ...`",
    })
}

fn mpich(v: &Vars<'_>) -> Result<Found> {
    let because = if v.get("PMI_RANK").is_some() { "PMI_RANK" } else { "PMI_SIZE" };
    let rank = v.required("PMI_RANK", "this process's rank", because)?;
    let world = v.required("PMI_SIZE", "the number of ranks in the job", because)?;
    let local_rank = v.required("MPI_LOCALRANKID", "this process's rank on its node (Hydra's mpiexec sets it)", because)?;
    let local_world = v.required("MPI_LOCALNRANKS", "the number of ranks on this node (Hydra's mpiexec sets it)", because)?;
    Ok(Found {
        launcher: Launcher::Mpich,
        rank: ("PMI_RANK", rank),
        world: ("PMI_SIZE", world),
        local_rank: ("MPI_LOCALRANKID", local_rank),
        local_world: ("MPI_LOCALNRANKS", local_world),
        node_rank: None,
        slurm_step: None,
        addr_hint: "e.g. `mpiexec -genv MASTER_ADDR <host of rank 0> -genv MASTER_PORT 29500 ...`",
    })
}

/// The id of the Slurm step this process is a task of, if it is one.
fn slurm_step(v: &Vars<'_>) -> Result<Option<u64>> {
    let Some((name, value)) = v.first(&["SLURM_STEP_ID", "SLURM_STEPID"]) else { return Ok(None) };
    match parse_number(&value) {
        Some(id) if id < SLURM_RESERVED_STEP_IDS => Ok(Some(id)),
        Some(_) => Ok(None),
        None => Err(Error::environment(name, format!("`{value}` is not a Slurm step id (a whole number, set by srun); unset it if it was not set by Slurm"))),
    }
}

fn slurm(v: &Vars<'_>, step: u64) -> Result<Found> {
    let because = "SLURM_STEP_ID (this process is a task of a Slurm step)";
    let rank = v.required("SLURM_PROCID", "this task's rank in the step", because)?;
    let (world_var, world) = match v.first(&["SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"]) {
        Some((name, _)) => (name, v.required(name, "the number of tasks of the step", because)?),
        None => return Err(Error::environment("SLURM_NTASKS", format!("neither SLURM_STEP_NUM_TASKS nor SLURM_NTASKS is set, but {because} is: the number of ranks is unknown; run the job with `srun`, which sets them, or export SLURM_NTASKS"))),
    };
    let local_rank = v.required("SLURM_LOCALID", "this task's rank on its node", because)?;
    let node = v.required("SLURM_NODEID", "the index of this task's node in the step", because)?;

    let local_world = match v.first(&["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"]) {
        Some((name, list)) => {
            let counts = hostlist::tasks_per_node(list.trim()).map_err(|e| {
                Error::environment(name, format!("`{list}` is not a Slurm task count list such as `4(x2),3`: {e}; unset it or fix its syntax"))
            })?;
            let Some(&count) = counts.get(node as usize) else {
                return Err(Error::environment(
                    name,
                    format!("`{list}` lists {} node(s) but SLURM_NODEID={node}: the two describe different steps; unset the stale one", counts.len()),
                ));
            };
            if name == "SLURM_STEP_TASKS_PER_NODE" && world_var == "SLURM_STEP_NUM_TASKS" {
                let sum: u64 = counts.iter().map(|&c| c as u64).sum();
                if sum != world {
                    return Err(Error::environment(
                        name,
                        format!("`{list}` adds up to {sum} tasks but SLURM_STEP_NUM_TASKS={world}: the two describe different steps; unset the stale one"),
                    ));
                }
            }
            (name, count as u64)
        }
        None => match v.number("SLURM_NTASKS_PER_NODE", "the number of tasks on each node")? {
            Some(n) => ("SLURM_NTASKS_PER_NODE", n),
            None => {
                return Err(Error::environment(
                    "SLURM_TASKS_PER_NODE",
                    format!("none of SLURM_STEP_TASKS_PER_NODE, SLURM_TASKS_PER_NODE or SLURM_NTASKS_PER_NODE is set, but {because} is: the number of ranks on this node is unknown; run the job with `srun`, which sets them"),
                ))
            }
        },
    };

    Ok(Found {
        launcher: Launcher::Slurm,
        rank: ("SLURM_PROCID", rank),
        world: (world_var, world),
        local_rank: ("SLURM_LOCALID", local_rank),
        local_world,
        node_rank: Some(("SLURM_NODEID", node)),
        slurm_step: Some(step),
        addr_hint: "e.g. `export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)` before srun",
    })
}

#[cfg(test)]
mod tests;
