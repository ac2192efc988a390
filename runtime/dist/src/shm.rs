//! Communicators between processes of one node, through shared memory.
//!
//! A [`ShmWorld`] is this process's place in a job whose ranks are
//! processes: its rank, the ranks that run on the same node, and the
//! node's segment (a file of the shared-memory directory, `/dev/shm`,
//! mapped by every local rank). It hands out the communicator of each group
//! of local ranks, whose collectives move data through that group's own
//! segment and give the same bits as the in-process and TCP communicators.
//! Nothing needs installing: the segments are plain files of a memory
//! filesystem. Jobs whose ranks are processes usually reach it through
//! [`ProcessWorld`](crate::process::ProcessWorld), which uses shared memory
//! for the groups within a node and TCP for the others.
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use tessera::dist::env::ProcessEnv;
//! use tessera::dist::shm::ShmWorld;
//! use tessera::dist::store::Rendezvous;
//! use tessera::dist::Communicator;
//! use tessera::{Device, Tensor};
//!
//! // Every rank, started by a launcher (`tessera launch --nproc-per-node 4`).
//! let env = ProcessEnv::detect()?.expect("started by a launcher");
//! let rendezvous = Rendezvous::join(&env, Duration::from_secs(60))?;
//! let dev = Device::cpu();
//! let world = ShmWorld::join(&rendezvous, &dev, Duration::from_secs(60))?;
//! let comm = world.communicator()?;
//! let sum = comm.all_reduce_sum(&Tensor::from_vec(vec![1.0f32; 3], [3], &dev)?)?;
//! # Ok(()) }
//! ```
//!
//! # Synchronisation
//!
//! A group's members meet at numbered steps: each writes what its peers
//! need into its own area of the segment, publishes the step with an atomic
//! counter, and waits for every peer's. A waiter spins for a few
//! microseconds only when the machine has a core for every member, then
//! sleeps on a futex in the segment, so that more ranks than cores do not
//! starve one another. Large tensors move in rounds of a megabyte per
//! member, which stay in the cache between the member that writes them and
//! the ones that read them. See the `group` and `comm` modules.
//!
//! # Failures
//!
//! Every wait has a deadline (the world's timeout) and wakes every few
//! milliseconds to look for failures: a rank that calls
//! [`Communicator::abort`](crate::Communicator::abort) or panics records the failure in the node's
//! segment, and every rank's pending and later calls return
//! [`Error::PeerFailed`] naming it; a peer whose process is gone (killed,
//! crashed: checked every 50 ms of waiting) is declared failed by the rank
//! that waits for it; one that hangs past the timeout is declared failed,
//! and the waiter returns [`Error::Timeout`] naming it.
//!
//! # Cleanup
//!
//! A segment's name is removed from the directory once every member has
//! mapped it, so no file outlives its job, however the job ends; the
//! memory goes with the last process. Files a job that died before that
//! left behind are removed by the next job on the node (see the
//! `segment` module for names).

mod arena;
mod call;
mod comm;
mod group;
pub(crate) mod node;
mod p2p;
mod segment;
mod sys;

pub use comm::ShmComm;
pub(crate) use comm::ShmCore;

use crate::groups::check_group;
use crate::host_comm::HostComm;
use crate::store::Rendezvous;
use arena::ShmArena;
use group::Group;
use node::{Found, Node};
use parking_lot::Mutex;
use std::collections::HashSet;
use std::hash::Hasher;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tessera_core::backend::CpuDevice;
use tessera_core::{Device, Error, Result};

/// The directory shared-memory segments live in, unless `TESSERA_SHM_DIR`
/// names another.
pub const DEFAULT_DIR: &str = "/dev/shm";

/// The directory of shared-memory segments: `TESSERA_SHM_DIR`, or
/// [`DEFAULT_DIR`].
pub fn shm_dir() -> PathBuf {
    std::env::var_os("TESSERA_SHM_DIR").map_or_else(|| PathBuf::from(DEFAULT_DIR), PathBuf::from)
}

/// This process's rank in a job of processes, and the shared memory of the
/// ranks on its node.
pub struct ShmWorld {
    node: Arc<Node>,
    device: CpuDevice,
    /// Each rank's node, as an opaque key: ranks with equal keys share memory.
    nodes: Vec<u64>,
    /// Groups this rank already has a communicator for.
    taken: Mutex<HashSet<u64>>,
}

impl std::fmt::Debug for ShmWorld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmWorld").field("rank", &self.rank()).field("local", &self.node.local).finish()
    }
}

/// A rank's node entry: `<node identity, hex> <process id> <arena
/// descriptor> <arena bytes>` (descriptor -1 and size 0: no arena).
fn parse_node_entry(text: &str) -> Option<(u64, u32, Option<arena::Published>)> {
    let mut f = text.split(' ');
    let node = u64::from_str_radix(f.next()?, 16).ok()?;
    let pid = f.next()?.parse().ok()?;
    let fd: i32 = f.next()?.parse().ok()?;
    let len: usize = f.next()?.parse().ok()?;
    if f.next().is_some() {
        return None;
    }
    Some((node, pid, (fd >= 0 && len > 0).then_some((fd, len))))
}

fn hash(text: &str) -> u64 {
    let mut h = fnv::FnvHasher::default();
    h.write(text.as_bytes());
    h.finish()
}

impl ShmWorld {
    /// Joins the shared memory of this process's node in the job it joined
    /// through `rendezvous`: every rank publishes its node's identity and
    /// its process id in the store, and the ranks with this node's identity
    /// map its segment. The identity is the launcher's node rank
    /// ([`ProcessEnv::node_rank`](crate::env::ProcessEnv::node_rank)) and
    /// what processes that can share memory have in common: the running
    /// kernel (its boot id), the host name, the shared-memory directory and
    /// the process-id namespace. Every rank of the job calls it, on every node.
    /// Tensors received are allocated on `device`, this rank's CPU device;
    /// `timeout` bounds the wait for the others' entries and every later
    /// wait.
    pub fn join(rendezvous: &Rendezvous, device: &Device, timeout: Duration) -> Result<ShmWorld> {
        let store = rendezvous.store();
        let key = rendezvous.key("shm/job");
        if rendezvous.env().rank == 0 {
            store.set(&key, &crate::process::job_id().to_le_bytes())?;
        }
        let job = store.get(&key, timeout)?;
        let job = u64::from_le_bytes(job.as_slice().try_into().map_err(|_| Error::rendezvous(store.addr(), format!("the job id under {key} is not 8 bytes")))?);
        Self::join_job(rendezvous, job, device, timeout)
    }

    /// [`join`](Self::join) for the job `job` (every rank passes the same).
    pub(crate) fn join_job(rendezvous: &Rendezvous, job: u64, device: &Device, timeout: Duration) -> Result<ShmWorld> {
        let device = match device {
            Device::Cpu(d) => d.clone(),
            Device::Cuda(d) => return d.unsupported("communicators through shared memory (CUDA ranks communicate through NCCL)"),
        };
        let env = rendezvous.env();
        let store = rendezvous.store();
        let dir = shm_dir();
        if !dir.is_dir() {
            return Err(node::shm_error(&dir, "use the shared-memory directory", std::io::Error::new(std::io::ErrorKind::NotFound, "no such directory")));
        }
        // The launcher's node rank is part of the identity: ranks it puts on
        // different nodes never share memory, even when they run on one
        // machine (two launchers on one host, trying a multi-node job).
        let ident = hash(&format!("{}|{}", env.node_rank, sys::node_identity(&dir)));
        let pid = std::process::id();
        // The arena this rank's large tensors will live in, which its peers
        // map (see `arena`): published as its descriptor and size.
        let arena = ShmArena::of(&device);
        let (fd, len) = arena.as_ref().map_or((-1, 0), |a| (a.fd(), a.len()));
        store.set(&rendezvous.key(&format!("shm/node/{}", env.rank)), format!("{ident:016x} {pid} {fd} {len}").as_bytes())?;
        let mut nodes = Vec::with_capacity(env.world_size);
        let mut pids = Vec::with_capacity(env.world_size);
        let mut arenas = Vec::with_capacity(env.world_size);
        for r in 0..env.world_size {
            let text = store.get(&rendezvous.key(&format!("shm/node/{r}")), timeout)?;
            let text = String::from_utf8_lossy(&text);
            let parsed = parse_node_entry(&text);
            let (n, p, a) = parsed.ok_or_else(|| Error::rendezvous(store.addr(), format!("rank {r} published a node entry that does not parse ({text:?})")))?;
            nodes.push(n);
            pids.push(p);
            arenas.push(a);
        }
        let local: Vec<usize> = (0..env.world_size).filter(|&r| nodes[r] == ident).collect();
        let pids: Vec<u32> = (0..env.world_size).map(|r| if nodes[r] == ident { pids[r] } else { 0 }).collect();
        let arenas = (0..env.world_size).map(|r| arenas[r].filter(|_| nodes[r] == ident)).collect();
        let ns = hash(&sys::pid_namespace()) as u32;
        if local[0] == env.rank {
            segment::remove_stale(&dir, ns);
        }
        let node = Node::attach(Found { dir, ns, me: env.rank, local, pids, job, timeout, arena, arenas })?;
        Ok(ShmWorld { node: Arc::new(node), device, nodes, taken: Mutex::default() })
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.node.me
    }

    /// Number of ranks in the job (on every node).
    pub fn world_size(&self) -> usize {
        self.node.world
    }

    /// The world ranks on this node, in increasing order.
    pub fn local_ranks(&self) -> &[usize] {
        &self.node.local
    }

    /// Whether world rank `rank` runs on this process's node (and can
    /// share memory with it).
    pub fn is_local(&self, rank: usize) -> bool {
        self.nodes.get(rank) == self.nodes.get(self.rank())
    }

    /// How long each wait lasts at most.
    pub fn timeout(&self) -> Duration {
        self.node.timeout
    }

    /// The communicator of the whole job; every rank must run on this node.
    pub fn communicator(&self) -> Result<ShmComm> {
        let all: Vec<usize> = (0..self.world_size()).collect();
        self.tagged_group("world", &all)
    }

    /// This rank's communicator in the group of world ranks `ranks` (member
    /// `i` has group rank `i`) named `tag`: groups with different tags are
    /// independent even when their members are the same. Every member asks
    /// for it with the same tag and list, and all must run on this node;
    /// asking twice is an error. Returns at once: no member waits for
    /// another to create the group's segment.
    pub fn tagged_group(&self, tag: &str, ranks: &[usize]) -> Result<ShmComm> {
        self.tagged_core(tag, ranks).map(HostComm::new)
    }

    /// What [`tagged_group`](Self::tagged_group)'s communicator runs on.
    pub(crate) fn tagged_core(&self, tag: &str, ranks: &[usize]) -> Result<ShmCore> {
        let id = check_group("ShmWorld::group", self.rank(), self.world_size(), tag, ranks)?;
        if let Some(&r) = ranks.iter().find(|&&r| !self.is_local(r)) {
            return Err(Error::topology(
                "ShmWorld::group",
                format!("rank {r} of group {tag:?} {ranks:?} runs on another node than rank {}: shared memory joins the ranks of one node only; use a `ProcessWorld`, which connects the other groups over TCP", self.rank()),
            ));
        }
        if !self.taken.lock().insert(id) {
            return Err(Error::state_mismatch("ShmWorld::group", format!("rank {} already has a communicator for group {tag:?} {ranks:?}", self.rank())));
        }
        let me = ranks.iter().position(|&r| r == self.rank()).expect("checked membership");
        let group = Group::attach(self.node.clone(), id, ranks.to_vec(), me)?;
        Ok(ShmCore::new(group, self.device.clone()))
    }

    /// Stops the job on behalf of world rank `rank`: every pending and
    /// later call on every rank of this node returns [`Error::PeerFailed`]
    /// naming it.
    pub fn abort(&self, rank: usize, reason: &str) {
        self.node.fail(rank, format!("aborted: {reason}"));
    }

    /// The error every call returns once the job has stopped, or `Ok` while
    /// it runs.
    pub fn check(&self) -> Result<()> {
        self.node.failure().map_or(Ok(()), Err)
    }

    /// The node's failures, for a transport that links them with its own.
    pub(crate) fn node(&self) -> &Arc<Node> {
        &self.node
    }
}

#[cfg(test)]
mod tests {
    use super::node::Linked;
    use super::ShmWorld;
    use crate::env::{Launcher, ProcessEnv};
    use crate::store::Rendezvous;
    use crate::Communicator;
    use std::net::TcpListener;
    use std::sync::Barrier;
    use std::time::Duration;
    use tessera_core::{Device, Error};

    /// A peer that leaves because of a failure only it knew of (learned
    /// through the linked transport, which the other rank's has not heard
    /// yet) is not reported as the root cause: the failure is.
    #[test]
    fn a_rank_leaving_for_a_failure_hands_the_failure_to_its_peers() {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let env = |rank| ProcessEnv {
            rank,
            world_size: 2,
            local_rank: rank,
            local_world_size: 2,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: port,
            restart: 0,
            launcher: Launcher::Torchrun,
        };
        let (joined, left) = (Barrier::new(2), Barrier::new(2));
        let errors: Vec<Option<Error>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..2)
                .map(|rank| {
                    let (joined, left, env) = (&joined, &left, env(rank));
                    s.spawn(move || {
                        let rdzv = Rendezvous::join(&env, Duration::from_secs(30)).unwrap();
                        let world = ShmWorld::join(&rdzv, &Device::cpu(), Duration::from_secs(30)).unwrap();
                        let comm = world.communicator().unwrap();
                        comm.barrier().unwrap();
                        joined.wait();
                        let out = if rank == 0 {
                            world.node().link(Linked {
                                failure: Box::new(|| Some(Error::PeerFailed { rank: 5, reason: "its data shard is corrupt".into() })),
                                fail: Box::new(|_, _| {}),
                            });
                            drop(comm);
                            None
                        } else {
                            Some(comm.barrier().unwrap_err())
                        };
                        left.wait();
                        out
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let e = errors[1].as_ref().unwrap();
        assert!(matches!(e, Error::PeerFailed { rank: 5, .. }) && e.to_string().contains("corrupt"), "{e}");
    }
}
