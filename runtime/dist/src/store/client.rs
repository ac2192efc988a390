//! The store's client: a pool of connections to one server.

use super::proto::{self, Refusal, Request, Response, MAX_FRAME_BYTES, VERSION};
use super::{addr_text, MAX_KEYS_PER_REQUEST, MAX_KEY_BYTES, MAX_VALUE_BYTES};
use parking_lot::Mutex;
use std::io;
use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tessera_core::{Error, Result};

/// How long one connection attempt may take.
const CONNECT_ATTEMPT: Duration = Duration::from_secs(2);

/// How long the server may take to answer beyond the wait a request asks
/// for (and to take a request's bytes): far more than a live server needs,
/// short enough that a host that vanished without closing its connections
/// is noticed.
const IO_SLACK: Duration = Duration::from_secs(30);

/// Idle connections a client keeps for reuse.
const MAX_IDLE: usize = 16;

/// The longest pause between connection attempts.
const MAX_BACKOFF: Duration = Duration::from_millis(500);

/// A client of a [`super::StoreServer`].
///
/// `Store` is cheap to clone and safe to share between threads: clones
/// share one pool of connections, and each call takes a connection of its
/// own from it (opening one when none is idle), so a thread waiting in
/// [`Store::get`] never holds up another thread's [`Store::set`].
#[derive(Clone)]
pub struct Store {
    inner: Arc<Client>,
}

struct Client {
    /// `host:port`, as errors show it.
    addr: String,
    /// The address the first connection reached: later ones go there too.
    target: SocketAddr,
    /// The id of the server the first connection reached.
    server_id: u64,
    idle: Mutex<Vec<TcpStream>>,
    local_ip: Mutex<IpAddr>,
}

/// Why one attempt to open a connection failed.
enum OpenError {
    /// Worth retrying: nothing listens yet, the network is not ready.
    Retry(String),
    /// Something answered that is not a store of this protocol.
    NotAStore(String),
}

/// Opens a connection to `target` and exchanges greetings; the server's id.
fn open(target: SocketAddr, connect_within: Duration, answer_within: Duration) -> std::result::Result<(TcpStream, u64), OpenError> {
    let retry = |e: io::Error| OpenError::Retry(format!("{target}: {e}"));
    let mut s = TcpStream::connect_timeout(&target, connect_within).map_err(retry)?;
    s.set_nodelay(true).map_err(retry)?;
    s.set_read_timeout(Some(answer_within)).map_err(retry)?;
    s.set_write_timeout(Some(IO_SLACK)).map_err(retry)?;
    proto::write_frame(&mut s, &Request::Hello { version: VERSION }.encode()).map_err(retry)?;
    match proto::read_frame(&mut s, MAX_FRAME_BYTES) {
        Ok(Some(body)) => match Response::parse(&body) {
            Ok(Response::Hello { version: VERSION, server_id }) => Ok((s, server_id)),
            Ok(Response::Hello { version, .. }) => Err(OpenError::NotAStore(format!(
                "it is a Tessera store of protocol {version}, this build speaks {VERSION}: every rank must run the same Tessera build"
            ))),
            Ok(Response::Refused(_, why)) => Err(OpenError::NotAStore(why)),
            Ok(_) | Err(_) => Err(OpenError::NotAStore("its answer to the greeting is not a Tessera store's".into())),
        },
        Ok(None) => Err(OpenError::Retry(format!("{target}: the connection was closed before the greeting was answered"))),
        // A length beyond the limit: whatever this is, it is no store.
        Err(e) if e.kind() == io::ErrorKind::InvalidData => Err(OpenError::NotAStore("its answer to the greeting is not a Tessera store's".into())),
        Err(e) => Err(OpenError::Retry(format!("{target}: connected, but the greeting was not answered ({e})"))),
    }
}

/// A duration as whole milliseconds, saturating.
fn millis(d: Duration) -> u64 {
    d.as_millis().min(u64::MAX as u128) as u64
}

/// Keys as a short list for messages: the first few, and how many more.
fn key_list<'a>(keys: impl IntoIterator<Item = &'a str>) -> String {
    let keys: Vec<&str> = keys.into_iter().collect();
    let mut s = keys.iter().take(8).map(|k| format!("`{k}`")).collect::<Vec<_>>().join(", ");
    if keys.len() > 8 {
        s.push_str(&format!(" and {} more", keys.len() - 8));
    }
    s
}

impl Store {
    /// Connects to the store at `host:port`, retrying (with a growing
    /// pause) until one answers or `timeout` has passed: the master may
    /// start after this process. `host` is a name or an address (an IPv6
    /// address with or without brackets).
    ///
    /// Fails with [`Error::Rendezvous`] when nothing answers in time (the
    /// message names the address, the last error, and what to check), or
    /// at once when something answers that is not a store of this build.
    pub fn connect(host: &str, port: u16, timeout: Duration) -> Result<Store> {
        let shown = addr_text(host, port);
        let name = host.trim_start_matches('[').trim_end_matches(']');
        let start = Instant::now();
        let deadline = start.checked_add(timeout);
        let left = || deadline.map_or(Duration::MAX, |d| d.saturating_duration_since(Instant::now()));
        let mut pause = Duration::from_millis(10);
        let mut last = String::from("no attempt finished");
        loop {
            match (name, port).to_socket_addrs() {
                Ok(targets) => {
                    for target in targets {
                        // Every attempt gets a moment, even at the deadline.
                        let within = left().clamp(Duration::from_millis(50), CONNECT_ATTEMPT);
                        match open(target, within, within.max(Duration::from_millis(500))) {
                            Ok((stream, server_id)) => {
                                let local_ip = stream.local_addr().map(|a| a.ip()).unwrap_or(target.ip());
                                let client = Client { addr: shown, target, server_id, idle: Mutex::new(vec![stream]), local_ip: Mutex::new(local_ip) };
                                return Ok(Store { inner: Arc::new(client) });
                            }
                            Err(OpenError::NotAStore(why)) => {
                                return Err(Error::rendezvous(
                                    shown,
                                    format!("something answers there, but it is not a Tessera rendezvous store: {why}; check MASTER_PORT: it must be the port rank 0 serves the store on"),
                                ));
                            }
                            Err(OpenError::Retry(why)) => last = why,
                        }
                    }
                }
                Err(e) => last = format!("cannot resolve `{name}`: {e}"),
            }
            if left().is_zero() {
                return Err(Error::rendezvous(
                    shown,
                    format!(
                        "no store answered within {:?} (last error: {last}); check that rank 0 has started (it serves the store), that MASTER_ADDR and MASTER_PORT name rank 0's host and port on every rank, and that no firewall blocks the port",
                        start.elapsed()
                    ),
                ));
            }
            std::thread::sleep(pause.min(left()));
            pause = (pause * 2).min(MAX_BACKOFF);
        }
    }

    /// The store's address, `host:port`, as given to [`Store::connect`].
    pub fn addr(&self) -> &str {
        &self.inner.addr
    }

    /// This side's address of the connection to the store: the address of
    /// the interface through which this host reaches the master, which is
    /// the one other hosts can reach this host on.
    ///
    /// On rank 0 of a [`super::Rendezvous`] that reached its own store over
    /// loopback (a master name that this host resolves to `127.0.1.1`, as
    /// Debian's `/etc/hosts` does for a host's own name), this is instead
    /// the address the other hosts' connections arrived at, once the
    /// rendezvous has completed.
    pub fn local_ip(&self) -> IpAddr {
        *self.inner.local_ip.lock()
    }

    pub(crate) fn set_local_ip(&self, ip: IpAddr) {
        *self.inner.local_ip.lock() = ip;
    }

    /// The id of the server this client reached.
    pub(crate) fn server_id(&self) -> u64 {
        self.inner.server_id
    }

    /// Stores `value` under `key`, replacing any value, and wakes everyone
    /// waiting for it.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        check_key("store set", key)?;
        if value.len() > MAX_VALUE_BYTES {
            return Err(Error::invalid(
                "store set",
                format!("a value of {} bytes under key `{key}` is larger than the store's limit of {MAX_VALUE_BYTES} bytes; the store is for addresses and small metadata: send tensors through a communicator", value.len()),
            ));
        }
        self.call("store set", || format!("setting key `{key}`"), &Request::Set { key: key.into(), value: value.to_vec() }, None).map(drop)
    }

    /// The value of `key`, waiting up to `timeout` for some rank to set it;
    /// [`Error::Timeout`] if none does.
    pub fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        check_key("store get", key)?;
        match self.call("store get", || format!("waiting for key `{key}`"), &Request::Get { key: key.into(), wait_ms: millis(timeout) }, Some(timeout))? {
            Response::Value(v) => Ok(v),
            Response::NotFound => {
                Err(Error::Timeout { op: "store get", waited: timeout, detail: format!("no rank set key `{key}` in the store at {}", self.addr()) })
            }
            other => Err(self.unexpected(other)),
        }
    }

    /// The value of `key`, or `None` when it is not set; does not wait.
    pub fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        check_key("store try_get", key)?;
        match self.call("store try_get", || format!("reading key `{key}`"), &Request::Get { key: key.into(), wait_ms: 0 }, None)? {
            Response::Value(v) => Ok(Some(v)),
            Response::NotFound => Ok(None),
            other => Err(self.unexpected(other)),
        }
    }

    /// Waits up to `timeout` until every key of `keys` is set;
    /// [`Error::Timeout`] naming the keys still missing if they are not.
    pub fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        for k in keys {
            check_key("store wait", k)?;
        }
        let deadline = Instant::now().checked_add(timeout);
        for chunk in keys.chunks(MAX_KEYS_PER_REQUEST) {
            let left = deadline.map_or(Duration::MAX, |d| d.saturating_duration_since(Instant::now()));
            let req = Request::Wait { keys: chunk.iter().map(|k| k.to_string()).collect(), wait_ms: millis(left), any: false };
            match self.call("store wait", || format!("waiting for {}", key_list(chunk.iter().copied())), &req, Some(left))? {
                Response::Ready(_) => {}
                Response::Present(present) => {
                    let missing: Vec<&str> = chunk.iter().zip(present.iter().chain(std::iter::repeat(&false))).filter(|(_, &p)| !p).map(|(k, _)| *k).collect();
                    return Err(Error::Timeout {
                        op: "store wait",
                        waited: timeout,
                        detail: format!("{} of {} keys are not set in the store at {}: {}", missing.len(), keys.len(), self.addr(), key_list(missing)),
                    });
                }
                other => return Err(self.unexpected(other)),
            }
        }
        Ok(())
    }

    /// Waits up to `timeout` until one of `keys` is set, and returns the
    /// index of one that is (the first in `keys` when several are);
    /// [`Error::Timeout`] if none is. At most [`MAX_KEYS_PER_REQUEST`] keys.
    pub fn wait_any(&self, keys: &[&str], timeout: Duration) -> Result<usize> {
        for k in keys {
            check_key("store wait_any", k)?;
        }
        if keys.is_empty() || keys.len() > MAX_KEYS_PER_REQUEST {
            return Err(Error::invalid("store wait_any", format!("{} keys: wait for 1 to {MAX_KEYS_PER_REQUEST} keys", keys.len())));
        }
        let req = Request::Wait { keys: keys.iter().map(|k| k.to_string()).collect(), wait_ms: millis(timeout), any: true };
        match self.call("store wait_any", || format!("waiting for one of {}", key_list(keys.iter().copied())), &req, Some(timeout))? {
            Response::Ready(i) if (i as usize) < keys.len() => Ok(i as usize),
            Response::Present(_) => Err(Error::Timeout {
                op: "store wait_any",
                waited: timeout,
                detail: format!("none of {} was set in the store at {}", key_list(keys.iter().copied()), self.addr()),
            }),
            other => Err(self.unexpected(other)),
        }
    }

    /// Which of `keys` are set now; does not wait.
    pub fn check(&self, keys: &[&str]) -> Result<Vec<bool>> {
        for k in keys {
            check_key("store check", k)?;
        }
        let mut out = Vec::with_capacity(keys.len());
        for chunk in keys.chunks(MAX_KEYS_PER_REQUEST) {
            let req = Request::Check { keys: chunk.iter().map(|k| k.to_string()).collect() };
            match self.call("store check", || format!("checking {}", key_list(chunk.iter().copied())), &req, None)? {
                Response::Present(p) if p.len() == chunk.len() => out.extend(p),
                other => return Err(self.unexpected(other)),
            }
        }
        Ok(out)
    }

    /// Atomically adds `delta` to the integer under `key` (a missing key
    /// counts as 0) and returns the new value. The value is kept as decimal
    /// text; adding to a value that is not one is an
    /// [`Error::InvalidArgument`], as is an overflow.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        check_key("store add", key)?;
        match self.call("store add", || format!("adding to key `{key}`"), &Request::Add { key: key.into(), delta }, None)? {
            Response::Int(x) => Ok(x),
            other => Err(self.unexpected(other)),
        }
    }

    /// Removes `key`; whether it was set.
    pub fn delete_key(&self, key: &str) -> Result<bool> {
        check_key("store delete_key", key)?;
        match self.call("store delete_key", || format!("deleting key `{key}`"), &Request::Delete { key: key.into() }, None)? {
            Response::Int(x) => Ok(x != 0),
            other => Err(self.unexpected(other)),
        }
    }

    /// Waits until `world_size` callers (one per rank) have reached the
    /// barrier called `name`, or `timeout` has passed ([`Error::Timeout`]
    /// saying how many arrived).
    ///
    /// Each barrier needs a name of its own (`"init"`, `"epoch-3"`): a name
    /// stays used once passed, and reaching a used barrier again is an
    /// [`Error::InvalidArgument`], as is a barrier more ranks reach than
    /// `world_size` (ranks that disagree on the world size). It uses the
    /// keys `barrier/<name>/arrived` and `barrier/<name>/done`.
    pub fn barrier(&self, name: &str, world_size: usize, timeout: Duration) -> Result<()> {
        if world_size == 0 {
            return Err(Error::invalid("store barrier", format!("barrier `{name}` for a world of 0 ranks: the world size is at least 1")));
        }
        let deadline = Instant::now().checked_add(timeout);
        let arrived_key = format!("barrier/{name}/arrived");
        let done_key = format!("barrier/{name}/done");
        let n = self.add(&arrived_key, 1)?;
        if n as u64 > world_size as u64 {
            return Err(Error::invalid(
                "store barrier",
                format!("barrier `{name}` was reached {n} times for a world of {world_size}: the name was used by an earlier barrier (give every barrier its own name), or the ranks disagree on the world size"),
            ));
        }
        if n as u64 == world_size as u64 {
            self.set(&done_key, b"")?;
        }
        let left = deadline.map_or(Duration::MAX, |d| d.saturating_duration_since(Instant::now()));
        match self.wait(&[&done_key], left) {
            Err(Error::Timeout { .. }) => {
                let arrived = self.add(&arrived_key, 0)?;
                Err(Error::Timeout {
                    op: "store barrier",
                    waited: timeout,
                    detail: format!("barrier `{name}`: {arrived} of {world_size} ranks arrived at the store at {}", self.addr()),
                })
            }
            other => other,
        }
    }

    /// Sends `request` on a connection of the pool and returns the answer;
    /// `wait` is how long the server may wait before answering. `op` names
    /// the operation and `doing` says what it was doing, for errors.
    fn call(&self, op: &'static str, doing: impl Fn() -> String, request: &Request, wait: Option<Duration>) -> Result<Response> {
        let popped = self.inner.idle.lock().pop();
        let mut stream = match popped {
            Some(s) => s,
            None => self.reopen(&doing)?,
        };
        let answer_within = wait.map_or(Some(IO_SLACK), |w| w.checked_add(IO_SLACK));
        let lost = |e: &dyn std::fmt::Display| {
            Error::rendezvous(
                self.addr(),
                format!("the connection to the store broke while {} ({e}); rank 0, which serves the store, has probably exited or crashed: its own output has the cause", doing()),
            )
        };
        // `None` (a wait too long to represent) blocks until the server
        // answers or the connection breaks.
        stream.set_read_timeout(answer_within).map_err(|e| lost(&e))?;
        proto::write_frame(&mut stream, &request.encode()).map_err(|e| lost(&e))?;
        let body = match proto::read_frame(&mut stream, MAX_FRAME_BYTES) {
            Ok(Some(b)) => b,
            Ok(None) => return Err(lost(&"the store closed the connection")),
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                return Err(lost(&format!("no answer within {:?} of the time the request allowed", IO_SLACK)));
            }
            Err(e) => return Err(lost(&e)),
        };
        let response = Response::parse(&body).map_err(|proto::Malformed(why)| lost(&format!("an answer that does not parse: {why}")))?;
        match response {
            Response::Refused(Refusal::ShuttingDown, why) => Err(Error::rendezvous(self.addr(), format!("{} failed: {why}", doing()))),
            Response::Refused(Refusal::Protocol, why) => Err(Error::rendezvous(self.addr(), format!("the store refused the request while {}: {why}", doing()))),
            Response::Refused(Refusal::Invalid, why) => {
                self.give_back(stream);
                Err(Error::InvalidArgument { op, detail: why })
            }
            r => {
                self.give_back(stream);
                Ok(r)
            }
        }
    }

    fn give_back(&self, stream: TcpStream) {
        let mut idle = self.inner.idle.lock();
        if idle.len() < MAX_IDLE {
            idle.push(stream);
        }
    }

    /// A new connection to the server the first one reached.
    fn reopen(&self, doing: &dyn Fn() -> String) -> Result<TcpStream> {
        let fail = |why: String| {
            Error::rendezvous(
                self.addr(),
                format!(
                    "cannot reach the store any more while {} ({why}); rank 0, which serves it, has probably exited or crashed: its own output has the cause",
                    doing()
                ),
            )
        };
        match open(self.inner.target, CONNECT_ATTEMPT, IO_SLACK) {
            Ok((stream, id)) if id == self.inner.server_id => Ok(stream),
            Ok(_) => Err(fail("another store now answers at its address: rank 0 was restarted, and this process belongs to the job's previous attempt".into())),
            Err(OpenError::Retry(why) | OpenError::NotAStore(why)) => Err(fail(why)),
        }
    }

    fn unexpected(&self, r: Response) -> Error {
        Error::rendezvous(self.addr(), format!("the store answered out of protocol ({r:?}); every rank must run the same Tessera build"))
    }
}

fn check_key(op: &'static str, key: &str) -> Result<()> {
    if key.len() > MAX_KEY_BYTES {
        return Err(Error::invalid(op, format!("a key of {} bytes is longer than the store's limit of {MAX_KEY_BYTES} bytes; use shorter keys", key.len())));
    }
    Ok(())
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("addr", &self.inner.addr).field("local_ip", &self.local_ip()).finish()
    }
}
