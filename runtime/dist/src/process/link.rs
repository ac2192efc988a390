//! The connections of one rank to every other: a TCP stream per peer, a
//! thread per peer that reads its frames into mailboxes, and the failure
//! that stops them all.
//!
//! Reading on dedicated threads is what keeps the exchange free of
//! deadlock: a rank that sends a large tensor to a peer that is itself
//! sending never waits for that peer to read, because the peer's reader
//! always does. It is also how a lost peer is noticed at once: the kernel
//! closes a killed process's sockets, and the reader sees the end of its
//! stream without the goodbye a rank sends when it leaves normally.

use super::wire::{Channel, FrameKind, Header, MAGIC};
use parking_lot::{Condvar, Mutex};
use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, OnceLock};
use std::thread;
use std::time::{Duration, Instant};
use tessera_core::backend::{CpuDevice, CpuStorage, Storage};
use tessera_core::tensor::{with_elem, Tensor};
use tessera_core::{Error, Result};

/// A frame that arrived: its header, and its elements as a tensor on this
/// rank's device.
pub(super) struct Message {
    pub header: Header,
    pub tensor: Option<Tensor>,
}

/// Why the job stopped: the first failure known wins, since later ones are
/// usually its consequences.
#[derive(Debug)]
struct Failure {
    rank: usize,
    reason: String,
}

/// Messages waiting to be received, by (group, channel, sender).
type Queues = HashMap<(u64, Channel, usize), VecDeque<Message>>;

/// What the reader threads share with the ranks' calls.
struct State {
    me: usize,
    failure: OnceLock<Failure>,
    inbox: Mutex<Queues>,
    arrived: Condvar,
    /// Peers that said goodbye.
    departed: Vec<AtomicBool>,
    /// Set while this rank closes its own connections.
    closing: AtomicBool,
}

impl State {
    fn fail(&self, rank: usize, reason: String) {
        if self.failure.set(Failure { rank, reason }).is_ok() {
            // Taking the lock first: no waiter is between its check and its
            // wait, so none misses the wake-up.
            let _g = self.inbox.lock();
            self.arrived.notify_all();
        }
    }

    fn error(&self) -> Option<Error> {
        self.failure.get().map(|f| Error::PeerFailed { rank: f.rank, reason: f.reason.clone() })
    }
}

/// One rank's connections to the others.
pub(super) struct Links {
    size: usize,
    timeout: Duration,
    /// The writing half of each peer's stream (`None` at this rank's index).
    writers: Vec<Option<Mutex<TcpStream>>>,
    state: Arc<State>,
}

/// What the two ends of a new connection tell each other first.
#[derive(Debug, PartialEq)]
struct Hello {
    job: u64,
    rank: u64,
    size: u64,
}

impl Hello {
    fn write(&self, s: &mut TcpStream) -> io::Result<()> {
        let mut b = Vec::with_capacity(28);
        b.extend_from_slice(&MAGIC.to_le_bytes());
        for v in [self.job, self.rank, self.size] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        s.write_all(&b)
    }

    fn read(s: &mut TcpStream) -> io::Result<Hello> {
        let mut b = [0u8; 28];
        s.read_exact(&mut b)?;
        let word = |i: usize| u64::from_le_bytes(b[4 + 8 * i..12 + 8 * i].try_into().expect("8 bytes"));
        if u32::from_le_bytes(b[..4].try_into().expect("4 bytes")) != MAGIC {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "the peer is not a Tessera rank (wrong magic number, or a big-endian machine)"));
        }
        Ok(Hello { job: word(0), rank: word(1), size: word(2) })
    }
}

impl Links {
    /// Connects rank `me` of a job of `addrs.len()` ranks to every other:
    /// it dials the lower ranks' listeners at `addrs` and accepts the higher
    /// ranks on `listener`, each connection checked to belong to job `job`.
    pub(super) fn connect(me: usize, listener: TcpListener, addrs: &[SocketAddr], job: u64, device: CpuDevice, timeout: Duration) -> Result<Links> {
        let size = addrs.len();
        let deadline = Instant::now() + timeout;
        let mut streams: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
        let hello = Hello { job, rank: me as u64, size: size as u64 };
        for (peer, addr) in addrs.iter().enumerate().take(me) {
            let mut s = dial(*addr, deadline).map_err(|e| lost(peer, format!("could not connect to it at {addr}: {e}"), timeout))?;
            s.set_read_timeout(Some(remaining(deadline))).map_err(socket)?;
            hello.write(&mut s).map_err(|e| lost(peer, format!("the connection to {addr} failed: {e}"), timeout))?;
            let back = Hello::read(&mut s).map_err(|e| lost(peer, format!("it did not answer at {addr}: {e}"), timeout))?;
            if back != (Hello { job, rank: peer as u64, size: size as u64 }) {
                return Err(Error::topology(
                    "ProcessWorld::connect",
                    format!("{addr} answered as rank {} of a job of {} ranks (job id {:x}), not as rank {peer} of this job of {size} (job id {job:x}): a process of another job, or of an earlier attempt of this one, is listening there", back.rank, back.size, back.job),
                ));
            }
            streams[peer] = Some(s);
        }
        listener.set_nonblocking(true).map_err(socket)?;
        // Each accepted connection says who it is on its own thread, so a
        // stray that connects and stays silent (a port scanner) holds up
        // nobody.
        let (greeted, greetings) = mpsc::channel::<(TcpStream, Hello)>();
        let mut missing = size - me - 1;
        while missing > 0 {
            match listener.accept() {
                Ok((s, from)) => {
                    let greeted = greeted.clone();
                    let mine = Hello { job, rank: me as u64, size: size as u64 };
                    thread::spawn(move || {
                        if let Ok((s, h)) = greet(s, from, deadline, &mine) {
                            let _ = greeted.send((s, h));
                        }
                    });
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    while let Ok((s, h)) = greetings.try_recv() {
                        let peer = h.rank as usize;
                        if h.job != job || h.size != size as u64 || peer <= me || peer >= size || streams[peer].is_some() {
                            // Our own greeting told it whose port this is.
                            eprintln!("rank {me}: refused a connection that does not belong to this job ({h:?})");
                            continue;
                        }
                        streams[peer] = Some(s);
                        missing -= 1;
                    }
                    if missing == 0 {
                        break;
                    }
                    if Instant::now() >= deadline {
                        let absent: Vec<usize> = (me + 1..size).filter(|&p| streams[p].is_none()).collect();
                        return Err(Error::Timeout {
                            op: "ProcessWorld::connect",
                            waited: timeout,
                            detail: format!(
                                "rank {me} waited for ranks {absent:?} to connect: they did not start, crashed while starting, or cannot reach this host"
                            ),
                        });
                    }
                    thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(socket(e)),
            }
        }
        let state = Arc::new(State {
            me,
            failure: OnceLock::new(),
            inbox: Mutex::default(),
            arrived: Condvar::new(),
            departed: (0..size).map(|_| AtomicBool::new(false)).collect(),
            closing: AtomicBool::new(false),
        });
        let mut writers = Vec::with_capacity(size);
        for (peer, s) in streams.into_iter().enumerate() {
            let Some(s) = s else {
                writers.push(None);
                continue;
            };
            let setup = |s: &TcpStream| -> io::Result<TcpStream> {
                s.set_nodelay(true)?;
                s.set_read_timeout(None)?;
                // A peer that stops reading (stopped, or its machine hangs)
                // must not block a sender forever.
                s.set_write_timeout(Some(timeout))?;
                s.try_clone()
            };
            let reading = setup(&s).map_err(socket)?;
            let (state, device) = (state.clone(), device.clone());
            thread::Builder::new()
                .name(format!("tessera-recv-{me}-from-{peer}"))
                .spawn(move || read_frames(reading, peer, &state, &device))
                .map_err(|source| Error::Thread { what: "receiving from a peer", source })?;
            writers.push(Some(Mutex::new(s)));
        }
        Ok(Links { size, timeout, writers, state })
    }

    /// Number of ranks in the job.
    pub(super) fn size(&self) -> usize {
        self.size
    }

    /// This rank.
    pub(super) fn me(&self) -> usize {
        self.state.me
    }

    /// How long a wait lasts at most.
    pub(super) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The failure that stopped the job, if one has.
    pub(super) fn failure(&self) -> Option<Error> {
        self.state.error()
    }

    /// Declares world rank `rank` failed for `reason`, here and on every
    /// peer (best effort: a peer that cannot be told finds out on its own).
    pub(super) fn fail(&self, rank: usize, reason: String) {
        if self.state.failure.get().is_some() {
            return;
        }
        let frame = Header::abort(rank, &reason);
        self.state.fail(rank, reason);
        for w in self.writers.iter().flatten() {
            if let Some(mut s) = w.try_lock_for(Duration::from_millis(200)) {
                let _ = frame.write_to(&mut *s);
            }
        }
    }

    /// Sends `header` and then the elements `range` of each tensor of
    /// `pieces` (contiguous, all of the header's payload dtype) to world
    /// rank `to`.
    pub(super) fn send(&self, to: usize, header: &Header, pieces: &[(&Tensor, Range<usize>)]) -> Result<()> {
        if let Some(e) = self.failure() {
            return Err(e);
        }
        if self.state.departed[to].load(Ordering::Acquire) {
            return Err(left(to));
        }
        let writer = self.writers[to].as_ref().expect("no link to oneself");
        let mut s = writer.lock();
        let written = header.write_to(&mut *s).and_then(|()| pieces.iter().try_for_each(|(t, r)| write_elements(&mut *s, t, r.clone())));
        drop(s);
        written.map_err(|e| {
            let reason = match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                    format!("did not read what rank {} sent for {:?} (it hangs or is stopped)", self.me(), self.timeout)
                }
                _ => format!("its connection broke while rank {} sent to it: {e} (its process exited or was killed)", self.me()),
            };
            self.fail(to, reason.clone());
            self.failure().unwrap_or(Error::PeerFailed { rank: to, reason })
        })
    }

    /// The next message from world rank `from` on `group`'s `channel`,
    /// waiting for it at most the timeout; `op` names the wait in errors.
    pub(super) fn receive(&self, group: u64, channel: Channel, from: usize, op: &'static str) -> Result<Message> {
        let started = Instant::now();
        let deadline = started + self.timeout;
        let mut inbox = self.state.inbox.lock();
        loop {
            if let Some(e) = self.state.error() {
                return Err(e);
            }
            if let Some(m) = inbox.get_mut(&(group, channel, from)).and_then(VecDeque::pop_front) {
                return Ok(m);
            }
            if self.state.departed[from].load(Ordering::Acquire) {
                return Err(left(from));
            }
            if self.state.arrived.wait_until(&mut inbox, deadline).timed_out() && Instant::now() >= deadline {
                drop(inbox);
                let waited = started.elapsed();
                let me = self.me();
                self.fail(from, format!("sent nothing for {waited:?} while rank {me} waited for its {op}: it hangs, is stuck outside the collectives, or is far slower than its peers"));
                return Err(Error::Timeout {
                    op,
                    waited,
                    detail: format!("rank {me} waited for rank {from}, which sent nothing; declared it failed so that every rank stops"),
                });
            }
        }
    }

    /// Leaves the job: says goodbye to every peer and closes the writing
    /// half of each connection. Messages still on their way to this rank
    /// are dropped.
    ///
    /// A rank that leaves because the job failed (a failure it may have
    /// learned of from another peer, which the others have not heard yet)
    /// sends that failure ahead of its goodbye on every connection: each
    /// connection is read in order, so no peer takes the departure for the
    /// root cause.
    pub(super) fn close(&self) {
        self.state.closing.store(true, Ordering::Release);
        let bye = Header::bye();
        let why = self.state.failure.get().map(|f| Header::abort(f.rank, &f.reason));
        for w in self.writers.iter().flatten() {
            if let Some(mut s) = w.try_lock_for(self.timeout) {
                if let Some(abort) = &why {
                    let _ = abort.write_to(&mut *s);
                }
                let _ = bye.write_to(&mut *s);
                let _ = s.flush();
                // Only the writing half: closing both with unread data
                // would reset the connection, and the peer could lose the
                // goodbye. The reader goes on draining until the peer
                // closes its side.
                let _ = s.shutdown(Shutdown::Write);
            }
        }
        // The readers are left to end on their own, when each peer closes
        // its side (or the process exits): waiting here would hold this
        // rank's exit until its slowest peer finishes.
    }
}

impl Drop for Links {
    fn drop(&mut self) {
        self.close();
    }
}

fn left(rank: usize) -> Error {
    Error::PeerFailed { rank, reason: "it left the job (its process finished or closed its communicators) while this rank still needed it".into() }
}

fn lost(peer: usize, reason: String, timeout: Duration) -> Error {
    Error::PeerFailed { rank: peer, reason: format!("{reason} (gave up after {timeout:?}; check that every rank started and that this host can reach it)") }
}

/// Reads the greeting of a connection accepted from `from` and answers
/// with this rank's own, whoever it is from (a rank of another job learns
/// whose port it reached); a connection that is not a Tessera rank is
/// closed.
fn greet(mut s: TcpStream, from: SocketAddr, deadline: Instant, mine: &Hello) -> io::Result<(TcpStream, Hello)> {
    s.set_nonblocking(false)?;
    s.set_read_timeout(Some(remaining(deadline)))?;
    let h = Hello::read(&mut s).map_err(|e| io::Error::new(e.kind(), format!("{from}: {e}")))?;
    mine.write(&mut s)?;
    Ok((s, h))
}

/// A socket call failed (rare: setting options on a connected socket).
fn socket(e: io::Error) -> Error {
    Error::io(std::path::Path::new("TCP socket"), e)
}

fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))
}

/// Connects to `addr`, retrying while nobody listens there yet.
fn dial(addr: SocketAddr, deadline: Instant) -> io::Result<TcpStream> {
    let mut pause = Duration::from_millis(1);
    loop {
        match TcpStream::connect_timeout(&addr, remaining(deadline)) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => {
                thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(100));
            }
        }
    }
}

/// Writes the elements `range` of the contiguous host tensor `t`.
fn write_elements(w: &mut impl Write, t: &Tensor, range: Range<usize>) -> io::Result<()> {
    let base = t.layout().contiguous_range().expect("collectives send contiguous tensors").start;
    let guard = t.read();
    let Storage::Cpu(s) = &*guard else { unreachable!("host collectives send host tensors only") };
    with_elem!(t.dtype(), T => {
        let elems = &s.as_slice::<T>().expect("the tensor's own dtype")[base + range.start..base + range.end];
        w.write_all(bytemuck::cast_slice(elems))
    })
}

/// Reads a payload of `dtype` and `dims` into a new tensor on `dev`.
fn read_tensor(r: &mut impl Read, dtype: tessera_core::tensor::DType, dims: &[usize], dev: &CpuDevice) -> io::Result<Tensor> {
    let len: usize = dims.iter().product();
    let storage = with_elem!(dtype, T => {
        let mut buf = dev.buffer_zeros::<T>(len);
        r.read_exact(bytemuck::cast_slice_mut(&mut buf[..]))?;
        CpuStorage::from_buffer(buf)
    });
    Ok(Tensor::from_cpu(storage, dims.to_vec(), dev))
}

/// The reader thread of the connection to `peer`: files every message in
/// the inbox until the stream ends.
fn read_frames(stream: TcpStream, peer: usize, state: &State, dev: &CpuDevice) {
    let mut r = io::BufReader::with_capacity(1 << 16, stream);
    let ended = loop {
        let header = match Header::read_from(&mut r) {
            Ok(Some(h)) => h,
            Ok(None) => break None,
            Err(e) => break Some(e),
        };
        match header.kind {
            FrameKind::Bye => {
                state.departed[peer].store(true, Ordering::Release);
                let _g = state.inbox.lock();
                state.arrived.notify_all();
            }
            FrameKind::Abort => state.fail(header.failed as usize, header.text.clone()),
            FrameKind::Message => {
                let tensor = match &header.payload {
                    Some((dtype, dims)) => match read_tensor(&mut r, *dtype, dims, dev) {
                        Ok(t) => Some(t),
                        Err(e) => break Some(e),
                    },
                    None => None,
                };
                let key = (header.group, header.channel, peer);
                let mut inbox = state.inbox.lock();
                inbox.entry(key).or_default().push_back(Message { header, tensor });
                state.arrived.notify_all();
            }
        }
    };
    if state.closing.load(Ordering::Acquire) || state.departed[peer].load(Ordering::Acquire) {
        return;
    }
    let how = match ended {
        None => "its connection closed without a goodbye: its process exited or was killed".to_string(),
        Some(e) => format!("its connection failed ({e}): its process was killed, its machine is unreachable, or it sent a damaged frame"),
    };
    state.fail(peer, how);
}

#[cfg(test)]
mod tests {
    use super::{Channel, Links};
    use std::net::TcpListener;
    use std::time::Duration;
    use tessera_core::backend::cpu::CpuDevice;
    use tessera_core::Error;

    /// Rank 0 learned that rank 2 failed from rank 2 alone (as its reader
    /// of rank 2's connection does, without telling anyone) and leaves;
    /// rank 1, which never heard from rank 2, waits on rank 0: it is told
    /// rank 2's failure, not that rank 0 left.
    #[test]
    fn a_rank_leaving_for_a_failure_sends_the_failure_before_its_goodbye() {
        let listeners: Vec<TcpListener> = (0..3).map(|_| TcpListener::bind("127.0.0.1:0").unwrap()).collect();
        let addrs: Vec<_> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
        let timeout = Duration::from_secs(20);
        let links: Vec<Links> = std::thread::scope(|s| {
            let handles: Vec<_> = listeners
                .into_iter()
                .enumerate()
                .map(|(me, l)| {
                    let addrs = &addrs;
                    s.spawn(move || Links::connect(me, l, addrs, 7, CpuDevice::new(), timeout).unwrap())
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        links[0].state.fail(2, "it ran out of memory".into());
        links[0].close();
        let Err(e) = links[1].receive(0, Channel::PointToPoint, 0, "recv") else { panic!("rank 1 received a message rank 0 never sent") };
        assert!(matches!(e, Error::PeerFailed { rank: 2, .. }) && e.to_string().contains("out of memory"), "{e}");
    }
}
