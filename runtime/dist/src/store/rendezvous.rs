//! The rendezvous: rank 0 serves the store, every rank connects and
//! registers, and all wait until the whole world has arrived.

use super::server::bind_error;
use super::{addr_text, Store, StoreServer};
use crate::env::ProcessEnv;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs};
use std::time::{Duration, Instant};
use tessera_core::{Error, Result};

/// The one key outside every attempt's namespace: the attempt the store's
/// server belongs to.
const ATTEMPT_KEY: &str = "tessera/attempt";

/// How long rank 0 keeps serving after the rendezvous failed, so that the
/// other ranks can still read the store to say why.
const FAILURE_LINGER: Duration = Duration::from_secs(1);

/// How long rank 0 gives the holder of its port to answer.
const PROBE_TIMEOUT: Duration = Duration::from_millis(500);

/// The ranks of a job, found: the store they share, and, on rank 0, the
/// server of that store.
///
/// ```
/// use std::time::Duration;
/// use tessera::dist::env::{Launcher, ProcessEnv};
/// use tessera::dist::store::Rendezvous;
///
/// // A world of one, as `RANK=0 WORLD_SIZE=1 ... MASTER_PORT=<port>` gives it.
/// let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
/// let env = ProcessEnv {
///     rank: 0, world_size: 1, local_rank: 0, local_world_size: 1, node_rank: 0,
///     master_addr: "127.0.0.1".into(), master_port: port, restart: 0, launcher: Launcher::Torchrun,
/// };
/// let rdzv = Rendezvous::join(&env, Duration::from_secs(10))?;
/// rdzv.store().set(&rdzv.key("addr/0"), b"127.0.0.1:40000")?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Keys
///
/// Everything a job attempt writes lives under `tessera/<restart>/`
/// ([`Rendezvous::key`]), so a restarted job (a new [`ProcessEnv::restart`])
/// never reads its predecessor's keys. The rendezvous itself uses
/// `tessera/<restart>/rdzv/...`, and the store's id of its attempt
/// `tessera/attempt`.
pub struct Rendezvous {
    /// Dropped last: rank 0 serves until the rendezvous is dropped.
    store: Store,
    env: ProcessEnv,
    server: Option<StoreServer>,
}

/// A point in time that may be too far to represent.
struct Deadline(Option<Instant>);

impl Deadline {
    fn left(&self) -> Duration {
        self.0.map_or(Duration::MAX, |d| d.saturating_duration_since(Instant::now()))
    }
}

impl Rendezvous {
    /// Joins the job `env` describes, waiting up to `timeout` for every
    /// rank: rank 0 serves the store on `env.master_addr:env.master_port`,
    /// every rank (rank 0 too) connects to it, registers, and waits until
    /// all `world_size` ranks have; when `join` returns, every rank has
    /// joined.
    ///
    /// Rank 0 binds `master_addr` itself when it is an IP address (so
    /// `127.0.0.1` keeps the store on this host) and `localhost` as
    /// `127.0.0.1`. A host name is bound as every interface (`0.0.0.0`, or
    /// `::` when the name has only IPv6 addresses): a name may resolve to a
    /// different address on rank 0's host than on the others (Debian's
    /// `/etc/hosts` maps a host's own name to `127.0.1.1`), and binding
    /// that address would leave the other hosts unable to connect. Rank 0
    /// checks that `master_addr` leads back to its own server.
    ///
    /// A restarted job (a larger [`ProcessEnv::restart`]) may start while
    /// processes of the previous attempt still run: a rank that reaches the
    /// previous attempt's store waits and retries until that store goes
    /// away, and rank 0 waits for the previous attempt's rank 0 to release
    /// the port; a process of an older attempt that reaches a newer store
    /// stops.
    ///
    /// Every failure is an [`Error::Rendezvous`] naming the store's address,
    /// the cause and the fix: ranks that disagree on the world size, a rank
    /// started twice, a rank outside the world, a master that cannot be
    /// reached, a port in use on rank 0, and a timeout, which says how
    /// many ranks arrived and which are missing. A rank that finds the job
    /// misconfigured reports it in the store, and every other waiting rank
    /// fails with its report. After a failure rank 0 keeps serving for a
    /// second before it returns, so that the other ranks can still read the
    /// store to say what went wrong.
    pub fn join(env: &ProcessEnv, timeout: Duration) -> Result<Rendezvous> {
        let deadline = Deadline(Instant::now().checked_add(timeout));
        let shown = addr_text(&env.master_addr, env.master_port);
        if env.rank >= env.world_size {
            return Err(Error::rendezvous(
                &shown,
                format!(
                    "rank {} is not below the world size {}: ranks are numbered from 0 to the world size minus one; check {} and {}",
                    env.rank,
                    env.world_size,
                    env.launcher.rank_var(),
                    env.launcher.world_size_var()
                ),
            ));
        }
        let server = if env.rank == 0 { Some(serve(env, &shown, &deadline)?) } else { None };
        let store = connect(env, &shown, &deadline, server.as_ref())?;
        let rdzv = Rendezvous { store, env: env.clone(), server };
        match rdzv.register(&shown, &deadline, timeout) {
            Ok(()) => {
                if let Some(server) = &rdzv.server {
                    if let (true, Some(ip)) = (rdzv.store.local_ip().is_loopback(), server.reachable_ip()) {
                        rdzv.store.set_local_ip(ip);
                    }
                }
                Ok(rdzv)
            }
            Err(error) => {
                if rdzv.server.is_some() {
                    std::thread::sleep(FAILURE_LINGER);
                }
                Err(error)
            }
        }
    }

    /// The store every rank of the job shares.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// This process's place in the job.
    pub fn env(&self) -> &ProcessEnv {
        &self.env
    }

    /// The store's server, on rank 0 (which serves it until the
    /// rendezvous is dropped); `None` on every other rank.
    pub fn server(&self) -> Option<&StoreServer> {
        self.server.as_ref()
    }

    /// The key `name` in this job attempt's namespace:
    /// `tessera/<restart>/<name>`. Names starting with `rdzv/` are the
    /// rendezvous's own.
    pub fn key(&self, name: &str) -> String {
        attempt_key(self.env.restart, name)
    }

    /// Registers this rank and waits for the others.
    fn register(&self, shown: &str, deadline: &Deadline, timeout: Duration) -> Result<()> {
        let env = &self.env;
        let store = &self.store;
        let key = |name: &str| self.key(&format!("rdzv/{name}"));
        let fail = |detail: String| Error::rendezvous(shown, detail);
        // Reports a misconfiguration to every rank, and fails with it.
        let report = |detail: String| {
            let _ = store.set(&key("abort"), detail.as_bytes());
            Error::rendezvous(shown, detail)
        };

        let world = match store.get(&key("world_size"), deadline.left()) {
            Ok(v) => parse_number(&v).ok_or_else(|| fail(format!("the store holds a world size that is not a number ({})", String::from_utf8_lossy(&v))))?,
            Err(Error::Timeout { .. }) => {
                return Err(fail(
                    "rank 0 never published the world size: the store is not a Tessera job's rendezvous store (does MASTER_PORT name another program's store?)"
                        .into(),
                ))
            }
            Err(e) => return Err(e),
        };
        if world != env.world_size as u64 {
            let outside = if env.rank as u64 >= world { format!(", and rank {} is not even in rank 0's world", env.rank) } else { String::new() };
            return Err(report(format!(
                "the ranks disagree on the world size: rank {} was started with a world of {} ({}) but rank 0 with a world of {world}{outside}; start every rank with the same world size",
                env.rank,
                env.world_size,
                env.launcher.world_size_var()
            )));
        }
        let times = store.add(&key(&format!("rank/{}", env.rank)), 1)?;
        if times > 1 {
            return Err(report(format!(
                "rank {} joined twice: two processes of attempt {} were started as rank {}; check how the launcher assigns ranks ({}), and that no other job uses this MASTER_ADDR:MASTER_PORT",
                env.rank,
                env.restart,
                env.rank,
                env.launcher.rank_var()
            )));
        }
        if store.add(&key("arrived"), 1)? as u64 == world {
            store.set(&key("joined"), b"")?;
        }
        match store.wait_any(&[&key("joined"), &key("abort")], deadline.left()) {
            Ok(0) => Ok(()),
            Ok(_) => {
                let why = store.try_get(&key("abort"))?.map(|v| String::from_utf8_lossy(&v).into_owned()).unwrap_or_default();
                Err(fail(format!("another rank stopped the rendezvous: {why}")))
            }
            Err(Error::Timeout { .. }) => {
                let keys: Vec<String> = (0..world).map(|r| key(&format!("rank/{r}"))).collect();
                let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
                let advice = "Check that those ranks were started, that their MASTER_ADDR and MASTER_PORT name this store and no firewall blocks it, and their output for an earlier error; or raise the timeout if they start late";
                Err(fail(match store.check(&keys) {
                    Ok(present) => {
                        let missing: Vec<u64> = (0..world).filter(|&r| !present[r as usize]).collect();
                        format!("the rendezvous timed out after {timeout:?}: {} of {world} ranks arrived; missing: {}. {advice}", world - missing.len() as u64, rank_ranges(&missing))
                    }
                    Err(e) => format!("the rendezvous timed out after {timeout:?} waiting for some of the {world} ranks, and the store went away before they could be named ({e}). {advice}"),
                }))
            }
            Err(e) => Err(e),
        }
    }
}

fn attempt_key(restart: u32, name: &str) -> String {
    format!("tessera/{restart}/{name}")
}

fn parse_number(v: &[u8]) -> Option<u64> {
    std::str::from_utf8(v).ok()?.parse().ok()
}

/// `ranks 0, 3-5, 9` (at most 20 runs, then how many more).
pub(crate) fn rank_ranges(ranks: &[u64]) -> String {
    let mut runs: Vec<String> = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let mut j = i;
        while j + 1 < ranks.len() && ranks[j + 1] == ranks[j] + 1 {
            j += 1;
        }
        runs.push(if i == j { ranks[i].to_string() } else { format!("{}-{}", ranks[i], ranks[j]) });
        i = j + 1;
    }
    let more = runs.len().saturating_sub(20);
    runs.truncate(20);
    let mut s = format!("{} {}", if ranks.len() == 1 { "rank" } else { "ranks" }, runs.join(", "));
    if more > 0 {
        s.push_str(&format!(" and {more} more runs"));
    }
    s
}

/// The address rank 0 binds for `master_addr` (see [`Rendezvous::join`]).
fn bind_ip(master_addr: &str, shown: &str) -> Result<IpAddr> {
    let host = master_addr.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(ip);
    }
    let lower = host.to_ascii_lowercase();
    if lower == "localhost" || lower.ends_with(".localhost") {
        return Ok(IpAddr::V4(Ipv4Addr::LOCALHOST));
    }
    let addrs: Vec<SocketAddr> = (host, 0)
        .to_socket_addrs()
        .map_err(|e| {
            Error::rendezvous(
                shown,
                format!(
                    "rank 0 cannot resolve MASTER_ADDR `{host}` ({e}); MASTER_ADDR must name rank 0's host: give its address, or a name every host resolves"
                ),
            )
        })?
        .collect();
    if addrs.iter().any(SocketAddr::is_ipv4) {
        Ok(IpAddr::V4(Ipv4Addr::UNSPECIFIED))
    } else if !addrs.is_empty() {
        Ok(IpAddr::V6(Ipv6Addr::UNSPECIFIED))
    } else {
        Err(Error::rendezvous(shown, format!("MASTER_ADDR `{host}` resolves to no address on rank 0's host; give rank 0's address instead")))
    }
}

/// Rank 0: binds the store's port, waiting for a previous attempt's rank 0
/// to release it.
fn serve(env: &ProcessEnv, shown: &str, deadline: &Deadline) -> Result<StoreServer> {
    let ip = bind_ip(&env.master_addr, shown)?;
    let port = env.master_port;
    let mut pause = Duration::from_millis(20);
    loop {
        let err = match StoreServer::bind_addr(SocketAddr::new(ip, port)) {
            Ok(server) => {
                server.preset(ATTEMPT_KEY, env.restart.to_string().as_bytes());
                server.preset(&attempt_key(env.restart, "rdzv/world_size"), env.world_size.to_string().as_bytes());
                return Ok(server);
            }
            Err(e) if e.kind() == io::ErrorKind::AddrInUse => e,
            Err(e) => return Err(bind_error(shown, port, e)),
        };
        // Who holds the port? Ask it, as a client.
        let probe_ip = match ip {
            IpAddr::V4(a) if a.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(a) if a.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
            a => a,
        };
        let holder = Store::connect(&probe_ip.to_string(), port, PROBE_TIMEOUT.min(deadline.left())).ok();
        let attempt = holder.as_ref().and_then(|s| s.try_get(ATTEMPT_KEY).ok().flatten()).and_then(|v| parse_number(&v));
        match attempt {
            Some(a) if a == env.restart as u64 => {
                return Err(Error::rendezvous(
                    shown,
                    format!("another process already serves the store of attempt {a} of this job on port {port}: rank 0 was started twice; stop the other one (if it belongs to another job, give this one another MASTER_PORT)"),
                ))
            }
            Some(a) if a > env.restart as u64 => {
                return Err(Error::rendezvous(
                    shown,
                    format!("port {port} is served by attempt {a} of the job, newer than this process's attempt {}: this process is left over from an earlier attempt; stop it", env.restart),
                ))
            }
            Some(a) if deadline.left().is_zero() => {
                return Err(Error::rendezvous(
                    shown,
                    format!("port {port} is still held by the store of attempt {a} of this job (this is attempt {}): the previous attempt's rank 0 has not exited; stop it, or give this attempt another MASTER_PORT", env.restart),
                ))
            }
            // The previous attempt's rank 0, on its way out: wait for the port.
            Some(_) => {}
            None => return Err(bind_error(shown, port, err)),
        }
        drop(holder);
        std::thread::sleep(pause.min(deadline.left()));
        pause = (pause * 2).min(Duration::from_millis(500));
    }
}

/// Connects to the store of this attempt, waiting out a previous
/// attempt's store.
fn connect(env: &ProcessEnv, shown: &str, deadline: &Deadline, server: Option<&StoreServer>) -> Result<Store> {
    let mut pause = Duration::from_millis(20);
    loop {
        let store = Store::connect(&env.master_addr, env.master_port, deadline.left())?;
        if let Some(server) = server {
            if store.server_id() != server.id() {
                return Err(Error::rendezvous(
                    shown,
                    format!(
                        "rank 0 serves the store on this host, but MASTER_ADDR `{}` leads to another store: MASTER_ADDR must name the host rank 0 runs on",
                        env.master_addr
                    ),
                ));
            }
        }
        let attempt = match store.get(ATTEMPT_KEY, deadline.left()) {
            Ok(v) => parse_number(&v),
            Err(Error::Timeout { .. }) => None,
            Err(e) => return Err(e),
        };
        let Some(attempt) = attempt else {
            return Err(Error::rendezvous(
                shown,
                "the store there is not a Tessera job's rendezvous store (it never said which attempt of the job it serves); check MASTER_PORT",
            ));
        };
        let mine = env.restart as u64;
        if attempt == mine {
            return Ok(store);
        }
        if attempt > mine {
            return Err(Error::rendezvous(
                shown,
                format!("the store serves attempt {attempt} of the job, but this process was started as attempt {mine}: it is left over from an earlier attempt; stop it"),
            ));
        }
        if deadline.left().is_zero() {
            return Err(Error::rendezvous(
                shown,
                format!("the store there still serves attempt {attempt} of the job, and this process is attempt {mine}: the previous attempt's rank 0 has not exited; stop it, or give this attempt another MASTER_PORT"),
            ));
        }
        drop(store);
        std::thread::sleep(pause.min(deadline.left()));
        pause = (pause * 2).min(Duration::from_millis(500));
    }
}
