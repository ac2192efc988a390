//! The store's server: one thread accepting connections, one thread per
//! connection, one map behind a mutex, and a condition variable that wakes
//! every waiting request when a key changes.
//!
//! One thread per connection keeps each request a plain blocking
//! read-handle-write loop, so a waiting `get` is a condition-variable wait
//! and nothing else; the store serves the ranks of one job, a few
//! connections each, and the threads run on small stacks. (A job of tens of
//! thousands of ranks would want an event loop instead; that is a change
//! inside this file only.)

use super::proto::{self, Refusal, Request, Response, MAX_FRAME_BYTES, VERSION};
use super::{addr_text, MAX_KEYS_PER_REQUEST};
use parking_lot::{Condvar, Mutex};
use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::io::{self, BufReader};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tessera_core::{Error, Result};

/// Stack size of a connection thread: it parses frames and copies values,
/// nothing recursive.
const CONN_STACK: usize = 256 * 1024;

/// How often a waiting request checks that its client is still connected:
/// a client that dies while its request waits frees its thread this soon,
/// not when the wait it asked for ends.
const LIVENESS_POLL: Duration = Duration::from_millis(200);

/// A TCP key-value store, served by background threads until dropped.
///
/// Rank 0 of a job serves one (see [`super::Rendezvous`]); every rank,
/// rank 0 too, talks to it through a [`super::Store`]. Dropping the server
/// closes every connection (their clients' calls fail with
/// [`Error::Rendezvous`] naming it), wakes every waiting request, stops
/// accepting, and waits for its threads, so that when `drop` returns the
/// port is free again.
///
/// The store has no authentication: anyone who can reach its port can
/// read and write it. Bind it to an address only the job's hosts reach.
pub struct StoreServer {
    shared: Arc<Shared>,
    addr: SocketAddr,
    acceptor: Option<JoinHandle<()>>,
}

/// What the server's threads share.
struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    conns: Mutex<Conns>,
    /// A random id, sent in every `Hello`: lets a client tell which server
    /// it reached (rank 0 checks that `MASTER_ADDR` leads to its own).
    id: u64,
    /// Connection handlers that panicked (a bug: they are written not to).
    panics: AtomicUsize,
    /// This host's address as seen by a connection from another host: what
    /// the other hosts reach it at.
    reachable: Mutex<Option<IpAddr>>,
}

struct State {
    map: HashMap<String, Vec<u8>>,
    closing: bool,
}

struct Conns {
    stopping: bool,
    next: u64,
    open: HashMap<u64, Conn>,
}

struct Conn {
    stream: TcpStream,
    handle: Option<JoinHandle<()>>,
}

impl StoreServer {
    /// Serves a new, empty store on `host:port`; port 0 takes any free
    /// port ([`StoreServer::local_addr`] says which). `host` is an address
    /// (`0.0.0.0` for every interface) or a name, bound at the first
    /// address it resolves to.
    pub fn bind(host: &str, port: u16) -> Result<StoreServer> {
        let shown = addr_text(host, port);
        let addrs: Vec<SocketAddr> = (host.trim_start_matches('[').trim_end_matches(']'), port)
            .to_socket_addrs()
            .map_err(|e| Error::rendezvous(&shown, format!("cannot resolve `{host}`: {e}; give an address, or a name this host can resolve")))?
            .collect();
        let Some(&addr) = addrs.first() else {
            return Err(Error::rendezvous(&shown, format!("`{host}` resolves to no address; give an address, or a name this host can resolve")));
        };
        Self::bind_addr(addr).map_err(|e| bind_error(&shown, port, e))
    }

    /// Serves a new, empty store on `addr`, returning the operating
    /// system's error as is (the caller knows what to advise).
    pub(crate) fn bind_addr(addr: SocketAddr) -> io::Result<StoreServer> {
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        // `RandomState` is seeded randomly per process; the pid, the time
        // and the address tell apart servers of one process too.
        let mut h = RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0));
        h.write(addr.to_string().as_bytes());
        let shared = Arc::new(Shared {
            state: Mutex::new(State { map: HashMap::new(), closing: false }),
            changed: Condvar::new(),
            conns: Mutex::new(Conns { stopping: false, next: 0, open: HashMap::new() }),
            id: h.finish(),
            panics: AtomicUsize::new(0),
            reachable: Mutex::new(None),
        });
        let s = shared.clone();
        let acceptor = std::thread::Builder::new().name("tessera-store-accept".into()).spawn(move || accept_loop(&s, listener))?;
        Ok(StoreServer { shared, addr, acceptor: Some(acceptor) })
    }

    /// The address the store listens on (with the port chosen when bound
    /// with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// How many client connections are open now.
    pub fn connections(&self) -> usize {
        self.shared.conns.lock().open.len()
    }

    /// The server's random id, which every client learns when it connects.
    pub(crate) fn id(&self) -> u64 {
        self.shared.id
    }

    /// Sets a key directly, before or while clients connect.
    pub(crate) fn preset(&self, key: &str, value: &[u8]) {
        self.shared.state.lock().map.insert(key.to_string(), value.to_vec());
        self.shared.changed.notify_all();
    }

    /// This host's address as the connections from other hosts arrived at
    /// it, once one has.
    pub(crate) fn reachable_ip(&self) -> Option<IpAddr> {
        *self.shared.reachable.lock()
    }

    /// Connection handlers that panicked: always 0 unless there is a bug.
    #[cfg(test)]
    pub(crate) fn handler_panics(&self) -> usize {
        self.shared.panics.load(Ordering::Relaxed)
    }
}

/// The advice for a failed bind of `shown`.
pub(crate) fn bind_error(shown: &str, port: u16, e: io::Error) -> Error {
    let detail = match e.kind() {
        io::ErrorKind::AddrInUse => {
            format!("port {port} is already in use on this host ({e}); choose another MASTER_PORT (the same for every rank), or stop the program that holds it")
        }
        io::ErrorKind::AddrNotAvailable => {
            format!("the address is not one of this host's ({e}); rank 0 serves the store, so MASTER_ADDR must name the host rank 0 runs on")
        }
        io::ErrorKind::PermissionDenied => {
            format!("not allowed to bind port {port} ({e}); ports below 1024 need privileges: choose a MASTER_PORT of 1024 or above")
        }
        _ => format!("cannot listen ({e})"),
    };
    Error::rendezvous(shown, detail)
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        // Refuse new connections first (under the lock the acceptor
        // registers them with), then wake the acceptor with a connection
        // of our own, so that its listener closes before we return.
        self.shared.conns.lock().stopping = true;
        let wake_ip = match self.addr.ip() {
            IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
            ip => ip,
        };
        let woke = TcpStream::connect_timeout(&SocketAddr::new(wake_ip, self.addr.port()), Duration::from_secs(2)).is_ok();
        if let Some(acceptor) = self.acceptor.take() {
            if woke {
                let _ = acceptor.join();
            }
        }
        // Wake every waiting request, then close every connection.
        self.shared.state.lock().closing = true;
        self.shared.changed.notify_all();
        let open = std::mem::take(&mut self.shared.conns.lock().open);
        for c in open.values() {
            let _ = c.stream.shutdown(Shutdown::Both);
        }
        for (_, c) in open {
            if let Some(h) = c.handle {
                let _ = h.join();
            }
        }
    }
}

fn accept_loop(shared: &Arc<Shared>, listener: TcpListener) {
    for stream in listener.incoming() {
        let stream = match stream {
            Ok(s) => s,
            Err(_) => {
                // Out of file descriptors, or a connection reset before it
                // was accepted: nothing to serve; do not spin.
                if shared.conns.lock().stopping {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        if let (Ok(local), Ok(peer)) = (stream.local_addr(), stream.peer_addr()) {
            if !peer.ip().is_loopback() && !local.ip().is_loopback() {
                shared.reachable.lock().get_or_insert(local.ip());
            }
        }
        let mut conns = shared.conns.lock();
        if conns.stopping {
            return;
        }
        let Ok(registered) = stream.try_clone() else { continue };
        let id = conns.next;
        conns.next += 1;
        conns.open.insert(id, Conn { stream: registered, handle: None });
        let s = shared.clone();
        let spawned = std::thread::Builder::new().name("tessera-store-conn".into()).stack_size(CONN_STACK).spawn(move || {
            if catch_unwind(AssertUnwindSafe(|| serve(&s, stream))).is_err() {
                s.panics.fetch_add(1, Ordering::Relaxed);
            }
            s.conns.lock().open.remove(&id);
        });
        match spawned {
            Ok(h) => {
                if let Some(c) = conns.open.get_mut(&id) {
                    c.handle = Some(h);
                }
            }
            // No thread for it: close it; its client sees the connection end.
            Err(_) => {
                conns.open.remove(&id);
            }
        }
    }
}

/// Serves one connection until its client closes it, it breaks the
/// protocol, or the server stops.
fn serve(shared: &Shared, stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let Ok(mut writer) = stream.try_clone() else { return };
    let mut reader = BufReader::new(stream);
    let mut greeted = false;
    loop {
        let body = match proto::read_frame(&mut reader, MAX_FRAME_BYTES) {
            Ok(Some(b)) => b,
            // The client closed, or sent a length beyond the limit, or the
            // connection broke: nothing more to do for it.
            Ok(None) | Err(_) => return,
        };
        let request = match Request::parse(&body) {
            Ok(r) => r,
            Err(proto::Malformed(why)) => {
                let _ = proto::write_frame(&mut writer, &Response::Refused(Refusal::Protocol, why).encode());
                return;
            }
        };
        let response = match (greeted, request) {
            (false, Request::Hello { version }) if version == VERSION => {
                greeted = true;
                Response::Hello { version: VERSION, server_id: shared.id }
            }
            (false, Request::Hello { version }) => {
                let why = format!("the client speaks store protocol {version}, this store speaks {VERSION}: every rank must run the same Tessera build");
                let _ = proto::write_frame(&mut writer, &Response::Refused(Refusal::Protocol, why).encode());
                return;
            }
            (false, _) | (true, Request::Hello { .. }) => {
                let why = "a connection must greet once, first".to_string();
                let _ = proto::write_frame(&mut writer, &Response::Refused(Refusal::Protocol, why).encode());
                return;
            }
            (true, request) => match shared.handle(request, &|| connected(&writer)) {
                Some(r) => r,
                None => return,
            },
        };
        if proto::write_frame(&mut writer, &response.encode()).is_err() {
            return;
        }
    }
}

/// Whether the client of `stream` is still connected, while its request
/// waits (it sends nothing then: an end of stream means it is gone).
fn connected(stream: &TcpStream) -> bool {
    if stream.set_nonblocking(true).is_err() {
        return false;
    }
    let alive = match stream.peek(&mut [0u8; 1]) {
        Ok(0) => false,
        Ok(_) => true,
        Err(e) => e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted,
    };
    stream.set_nonblocking(false).is_ok() && alive
}

/// `now + ms`, or `None` for a wait too long to represent (forever).
fn deadline(ms: u64) -> Option<Instant> {
    Instant::now().checked_add(Duration::from_millis(ms))
}

impl Shared {
    /// The answer to `request`; `None` when its client went away while it
    /// waited (`alive` says whether it is still there).
    fn handle(&self, request: Request, alive: &dyn Fn() -> bool) -> Option<Response> {
        let shutting_down = || Response::Refused(Refusal::ShuttingDown, "the store is shutting down: rank 0, which serves it, is exiting".into());
        match request {
            Request::Hello { .. } => unreachable!("greetings are handled by `serve`"),
            Request::Set { key, value } => {
                self.state.lock().map.insert(key, value);
                self.changed.notify_all();
                Some(Response::Ok)
            }
            Request::Get { key, wait_ms } => {
                let until = deadline(wait_ms);
                let mut checked = Instant::now();
                let mut st = self.state.lock();
                loop {
                    if let Some(v) = st.map.get(&key) {
                        return Some(Response::Value(v.clone()));
                    }
                    if st.closing {
                        return Some(shutting_down());
                    }
                    if !self.wait(&mut st, until, alive, &mut checked)? {
                        return Some(Response::NotFound);
                    }
                }
            }
            Request::Add { key, delta } => {
                let mut st = self.state.lock();
                let current = match st.map.get(&key) {
                    None => 0,
                    Some(v) => match std::str::from_utf8(v).ok().and_then(|s| s.parse::<i64>().ok()) {
                        Some(x) => x,
                        None => {
                            return Some(Response::Refused(
                                Refusal::Invalid,
                                format!("key `{key}` holds a value that is not a decimal integer, so nothing can be added to it"),
                            ))
                        }
                    },
                };
                let Some(next) = current.checked_add(delta) else {
                    return Some(Response::Refused(Refusal::Invalid, format!("adding {delta} to {current} under key `{key}` overflows a 64-bit integer")));
                };
                st.map.insert(key, next.to_string().into_bytes());
                drop(st);
                self.changed.notify_all();
                Some(Response::Int(next))
            }
            Request::Wait { keys, wait_ms, any } => {
                let until = deadline(wait_ms);
                let mut checked = Instant::now();
                let mut st = self.state.lock();
                loop {
                    let present: Vec<bool> = keys.iter().map(|k| st.map.contains_key(k)).collect();
                    if any {
                        if let Some(i) = present.iter().position(|&p| p) {
                            return Some(Response::Ready(i as u32));
                        }
                    } else if present.iter().all(|&p| p) {
                        return Some(Response::Ready(0));
                    }
                    if st.closing {
                        return Some(shutting_down());
                    }
                    if !self.wait(&mut st, until, alive, &mut checked)? {
                        return Some(Response::Present(present));
                    }
                }
            }
            Request::Check { keys } => {
                debug_assert!(keys.len() <= MAX_KEYS_PER_REQUEST);
                let st = self.state.lock();
                Some(Response::Present(keys.iter().map(|k| st.map.contains_key(k)).collect()))
            }
            Request::Delete { key } => {
                let removed = self.state.lock().map.remove(&key).is_some();
                self.changed.notify_all();
                Some(Response::Int(removed as i64))
            }
        }
    }

    /// Waits for a change until `until` (forever when `None`): `Some(false)`
    /// when the time is up, `None` when the client went away meanwhile.
    /// Whether woken or timed out, the caller looks at the map once more.
    /// `checked` is when the client was last seen connected.
    fn wait(&self, st: &mut parking_lot::MutexGuard<'_, State>, until: Option<Instant>, alive: &dyn Fn() -> bool, checked: &mut Instant) -> Option<bool> {
        let now = Instant::now();
        if until.is_some_and(|t| now >= t) {
            return Some(false);
        }
        let next_check = *checked + LIVENESS_POLL;
        self.changed.wait_until(st, until.map_or(next_check, |t| t.min(next_check)));
        // However busy the store (a wake-up for every change), a client
        // that went away is noticed within a poll.
        if Instant::now() >= next_check {
            if !parking_lot::MutexGuard::unlocked(st, alive) {
                return None;
            }
            *checked = Instant::now();
        }
        Some(true)
    }
}
