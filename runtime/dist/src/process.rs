//! Communicators between processes: every rank is an operating-system
//! process (on this machine or another), connected to every other by TCP,
//! and to the others of its node by shared memory.
//!
//! A [`ProcessWorld`] is this process's place in the job: its rank, its
//! connection to every peer and its node's shared memory. It hands out the
//! communicator of each group the rank belongs to (the world, or a group of
//! a mesh axis), used through the [`Communicator`](crate::Communicator) trait exactly as the
//! in-process communicators are. A group whose ranks are all on this node
//! moves its data through shared memory ([`crate::shm`]), any other over
//! TCP; [`Transport`] (`TESSERA_TRANSPORT=tcp|shm|auto`) can force either.
//! Both run the in-process algorithms' arithmetic (see the `comm` module for
//! TCP's), so a job gives the same bits whether its ranks are threads or
//! processes, and whatever transport each group uses.
//!
//! # Failures
//!
//! Every wait has a deadline (the world's timeout). A peer whose process
//! exits without leaving the job (killed, crashed) is noticed at once, when
//! its connection closes; one that hangs is declared failed by the first
//! rank that waits for it past the timeout. Either way every rank's pending
//! and later calls return [`Error::PeerFailed`] naming the lost rank: the
//! rank that notices tells every other. A rank that calls
//! [`Communicator::abort`](crate::Communicator::abort) or panics stops the job the same way. The two
//! transports share their failures: ranks waiting in shared memory also
//! watch the TCP connections (so a killed peer is noticed at once there
//! too), and a failure found in shared memory (a dead process, a timeout,
//! an abort) is sent to every rank over TCP.

mod comm;
mod link;
mod transport;
mod wire;

pub use transport::{ProcessComm, Transport};

use crate::groups::check_group;
use crate::host_comm::HostComm;
use crate::mesh::Mesh;
use crate::shm::node::Linked;
use crate::shm::ShmWorld;
use crate::store::Rendezvous;
use crate::Groups;
use comm::TcpCore;
use link::Links;
use parking_lot::Mutex;
use std::collections::HashSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::Duration;
use tessera_core::{Device, Error, Result};
use transport::ProcessCore;

/// This process's rank in a job of processes, and its connections to the
/// others.
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use std::net::TcpListener;
/// use std::time::Duration;
/// use tessera::dist::{process::ProcessWorld, Communicator};
/// use tessera::{Device, Tensor};
///
/// // Rank 1 of 2; both ranks know both listeners' addresses (a rendezvous
/// // store usually hands them out).
/// let listener = TcpListener::bind("127.0.0.1:0")?;
/// let addrs = ["127.0.0.1:29600".parse().unwrap(), listener.local_addr()?];
/// let dev = Device::cpu();
/// let world = ProcessWorld::connect(1, listener, &addrs, 42, &dev, Duration::from_secs(60))?;
/// let comm = world.communicator()?;
/// let x = Tensor::from_vec(vec![1.0f32; 3], [3], &dev)?;
/// let sum = comm.all_reduce_sum(&x)?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct ProcessWorld {
    links: Arc<Links>,
    /// This node's shared memory, unless the transport is TCP only.
    shm: Option<ShmWorld>,
    transport: Transport,
    /// Groups this rank already has a communicator for.
    taken: Mutex<HashSet<u64>>,
}

impl std::fmt::Debug for Links {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Links").field("rank", &self.me()).field("size", &self.size()).finish()
    }
}

impl ProcessWorld {
    /// Connects rank `rank` of the job whose ranks listen at `addrs` (one
    /// address per rank, this rank's own included: `listener` listens
    /// there) to every other rank. `job` tells this job's connections from
    /// strays (a process of another job, or of an earlier attempt of this
    /// one); every rank passes the same. Tensors received are allocated on
    /// `device`, this rank's CPU device. Returns once every peer is
    /// connected, or fails after `timeout`, which also bounds every later
    /// wait.
    pub fn connect(rank: usize, listener: TcpListener, addrs: &[SocketAddr], job: u64, device: &Device, timeout: Duration) -> Result<ProcessWorld> {
        if rank >= addrs.len() {
            return Err(Error::no_such_rank("ProcessWorld::connect", format!("rank {rank} is not a rank of a job of {} ranks", addrs.len())));
        }
        let dev = match device {
            Device::Cpu(d) => d.clone(),
            Device::Cuda(d) => return d.unsupported("communicators between processes over TCP (CUDA ranks communicate through NCCL)"),
        };
        let links = Links::connect(rank, listener, addrs, job, dev, timeout)?;
        Ok(ProcessWorld { links: Arc::new(links), shm: None, transport: Transport::Tcp, taken: Mutex::default() })
    }

    /// Connects this process to every other rank of the job it joined
    /// through `rendezvous`: each rank listens on a free port of the
    /// interface that reaches the store's host, publishes its address in
    /// the store, and connects to the addresses the others published (see
    /// [`connect`](Self::connect) for `device` and `timeout`); the ranks of
    /// each node also join its shared memory ([`ShmWorld::join`]), unless
    /// `TESSERA_TRANSPORT` is `tcp` (see [`Transport::from_env`]). Every
    /// rank of the job calls it.
    pub fn join(rendezvous: &Rendezvous, device: &Device, timeout: Duration) -> Result<ProcessWorld> {
        Self::join_with(rendezvous, device, timeout, Transport::from_env()?)
    }

    /// [`join`](Self::join) with the transport given rather than read from
    /// the environment. Every rank passes the same.
    pub fn join_with(rendezvous: &Rendezvous, device: &Device, timeout: Duration, transport: Transport) -> Result<ProcessWorld> {
        let env = rendezvous.env();
        let store = rendezvous.store();
        let ip = store.local_ip();
        // Listening on every interface: the address published is the one
        // that reached the store, which peers on other hosts can reach too.
        let any: IpAddr = if ip.is_ipv4() { Ipv4Addr::UNSPECIFIED.into() } else { Ipv6Addr::UNSPECIFIED.into() };
        let listener = TcpListener::bind((any, 0)).map_err(|e| Error::rendezvous(format!("{any}:0"), format!("cannot listen for the other ranks: {e}")))?;
        let port = listener.local_addr().map_err(|e| Error::rendezvous(format!("{any}:0"), e.to_string()))?.port();
        store.set(&rendezvous.key(&format!("tcp/addr/{}", env.rank)), SocketAddr::new(ip, port).to_string().as_bytes())?;
        let job_key = rendezvous.key("tcp/job");
        if env.rank == 0 {
            store.set(&job_key, &job_id().to_le_bytes())?;
        }
        let job = store.get(&job_key, timeout)?;
        let job =
            u64::from_le_bytes(job.as_slice().try_into().map_err(|_| Error::rendezvous(store.addr(), format!("the job id under {job_key} is not 8 bytes")))?);
        let addrs = (0..env.world_size)
            .map(|r| {
                let key = rendezvous.key(&format!("tcp/addr/{r}"));
                let text = store.get(&key, timeout)?;
                String::from_utf8_lossy(&text)
                    .parse::<SocketAddr>()
                    .map_err(|e| Error::rendezvous(store.addr(), format!("rank {r} published an address that does not parse ({e})")))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut world = ProcessWorld::connect(env.rank, listener, &addrs, job, device, timeout)?;
        world.transport = transport;
        if transport != Transport::Tcp {
            let shm = ShmWorld::join_job(rendezvous, job, device, timeout)?;
            // A failure either transport sees stops the other's waits too:
            // shared-memory waiters poll the connections' failure, and a
            // failure found in shared memory is sent to every rank.
            let (seen, tell) = (world.links.clone(), world.links.clone());
            shm.node().link(Linked { failure: Box::new(move || seen.failure()), fail: Box::new(move |rank, reason| tell.fail(rank, reason)) });
            world.shm = Some(shm);
        }
        Ok(world)
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.links.me()
    }

    /// Number of ranks in the job.
    pub fn world_size(&self) -> usize {
        self.links.size()
    }

    /// How long each wait lasts at most.
    pub fn timeout(&self) -> Duration {
        self.links.timeout()
    }

    /// How this job's groups reach one another (see [`Transport`]).
    pub fn transport(&self) -> Transport {
        self.transport
    }

    /// Whether world rank `rank` runs on this process's node, as far as
    /// shared memory knows (never, when the transport is TCP only).
    pub fn is_local(&self, rank: usize) -> bool {
        self.shm.as_ref().is_some_and(|s| s.is_local(rank))
    }

    /// The communicator of the whole job.
    pub fn communicator(&self) -> Result<ProcessComm> {
        let all: Vec<usize> = (0..self.world_size()).collect();
        self.tagged_group("world", &all)
    }

    /// This rank's communicator in the group of world ranks `ranks` (member
    /// `i` has group rank `i`) named `tag`: groups with different tags are
    /// independent even when their members are the same. Every member asks
    /// for it with the same tag and list; asking twice is an error.
    pub fn tagged_group(&self, tag: &str, ranks: &[usize]) -> Result<ProcessComm> {
        let id = check_group("ProcessWorld::group", self.rank(), self.world_size(), tag, ranks)?;
        let shared = self.shm.as_ref().filter(|s| ranks.iter().all(|&r| s.is_local(r)));
        if let (Transport::Shm, None) = (self.transport, shared) {
            let far = ranks.iter().find(|&&r| !self.is_local(r)).copied().unwrap_or_default();
            return Err(Error::topology(
                "ProcessWorld::group",
                format!("{}=shm, but rank {far} of group {tag:?} {ranks:?} runs on another node than rank {}: shared memory joins the ranks of one node only; use auto (shared memory within a node, TCP between nodes)", Transport::VAR, self.rank()),
            ));
        }
        if !self.taken.lock().insert(id) {
            return Err(Error::state_mismatch("ProcessWorld::group", format!("rank {} already has a communicator for group {tag:?} {ranks:?}", self.rank())));
        }
        match shared {
            Some(shm) => Ok(HostComm::new(ProcessCore::Shm(shm.tagged_core(tag, ranks)?))),
            None => Ok(HostComm::new(ProcessCore::Tcp(TcpCore::new(self.links.clone(), id, ranks.to_vec())))),
        }
    }

    /// Stops the job on behalf of world rank `rank`: every pending and
    /// later call on every rank returns [`Error::PeerFailed`] naming it.
    pub fn abort(&self, rank: usize, reason: &str) {
        match &self.shm {
            Some(shm) => shm.abort(rank, reason),
            None => self.links.fail(rank, format!("aborted: {reason}")),
        }
    }

    /// A check of the job's failure that outlives this world: what a
    /// watchdog polls to stop work the connections cannot see (collectives
    /// queued on a GPU) once a rank is lost.
    pub fn watcher(&self) -> impl Fn() -> Option<Error> + Send + 'static {
        let links = Arc::downgrade(&self.links);
        move || links.upgrade().and_then(|l| l.failure())
    }

    /// The error every call returns once the job has stopped, or `Ok` while
    /// it runs.
    pub fn check(&self) -> Result<()> {
        match &self.shm {
            Some(shm) => shm.check(),
            None => self.links.failure().map_or(Ok(()), Err),
        }
    }
}

/// A number that tells this job's connections from any other's: the time,
/// this process and its address space, hashed.
pub(crate) fn job_id() -> u64 {
    use std::hash::Hasher;
    let mut h = fnv::FnvHasher::default();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    h.write_u128(now.as_nanos());
    h.write_u32(std::process::id());
    h.write_usize(&h as *const _ as usize);
    h.finish()
}

/// This process's communicators for every axis of `mesh` and for its data
/// replicas, each group tagged with its axis so that groups with the same
/// members stay independent; each group through shared memory when its
/// ranks are all on this node (see [`ProcessWorld::tagged_group`]), over TCP
/// otherwise.
pub fn mesh_groups(world: &ProcessWorld, mesh: &Mesh) -> Result<Groups> {
    let n = world.world_size();
    let world_is = format!("the job has {n} processes");
    Groups::of_mesh(mesh, world.rank(), (n, &world_is, "start as many processes as the mesh has ranks"), |tag, members| {
        Ok(Arc::new(world.tagged_group(tag, members)?))
    })
}
