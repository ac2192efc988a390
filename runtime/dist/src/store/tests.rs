//! Tests of the store: its protocol under fuzzing, its operations under
//! concurrency, its failures, and the rendezvous of threads and of real
//! processes.

use super::proto::{self, Refusal, Request, Response, MAX_FRAME_BYTES};
use super::*;
use crate::env::{Launcher, ProcessEnv};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};
use tessera_core::Error;

/// SplitMix64: deterministic, so a failure reproduces.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }

    /// Up to `max - 1` random bytes.
    fn some_bytes(&mut self, max: u64) -> Vec<u8> {
        let n = self.below(max) as usize;
        self.bytes(n)
    }

    fn key(&mut self) -> String {
        let n = self.below(12) as usize;
        (0..n).map(|_| char::from(b'a' + self.below(26) as u8)).collect::<String>() + if self.below(8) == 0 { "/ü" } else { "" }
    }
}

const SHORT: Duration = Duration::from_millis(300);
const LONG: Duration = Duration::from_secs(10);

fn server() -> (StoreServer, Store) {
    let server = StoreServer::bind("127.0.0.1", 0).unwrap();
    let store = Store::connect("127.0.0.1", server.local_addr().port(), LONG).unwrap();
    (server, store)
}

/// A port nothing listens on now (the kernel's pick, released).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Waits until `f` holds, for at most `within`.
fn eventually(within: Duration, f: impl Fn() -> bool) -> bool {
    let t = Instant::now();
    while t.elapsed() < within {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    f()
}

fn random_request(rng: &mut Rng) -> Request {
    let keys = |rng: &mut Rng| (0..rng.below(5)).map(|_| rng.key()).collect::<Vec<_>>();
    match rng.below(8) {
        0 => Request::Hello { version: rng.next() as u32 },
        1 => Request::Set { key: rng.key(), value: rng.some_bytes(40) },
        2 => Request::Get { key: rng.key(), wait_ms: rng.next() },
        3 => Request::Add { key: rng.key(), delta: rng.next() as i64 },
        4 => Request::Wait { keys: keys(rng), wait_ms: rng.next(), any: rng.below(2) == 0 },
        5 => Request::Check { keys: keys(rng) },
        6 => Request::Delete { key: rng.key() },
        _ => Request::Set { key: String::new(), value: Vec::new() },
    }
}

fn random_response(rng: &mut Rng) -> Response {
    match rng.below(8) {
        0 => Response::Hello { version: rng.next() as u32, server_id: rng.next() },
        1 => Response::Ok,
        2 => Response::Value(rng.some_bytes(40)),
        3 => Response::NotFound,
        4 => Response::Int(rng.next() as i64),
        5 => Response::Ready(rng.next() as u32),
        6 => Response::Present((0..rng.below(9)).map(|_| rng.below(2) == 0).collect()),
        _ => Response::Refused([Refusal::Protocol, Refusal::Invalid, Refusal::ShuttingDown][rng.below(3) as usize], rng.key()),
    }
}

/// A copy of `frame` with a few random edits: bit flips, cut bytes,
/// inserted bytes, a changed length prefix, a truncation.
fn mutate(rng: &mut Rng, frame: &[u8]) -> Vec<u8> {
    let mut f = frame.to_vec();
    for _ in 0..1 + rng.below(3) {
        let at = rng.below(f.len() as u64 + 1) as usize;
        match rng.below(6) {
            0 if at < f.len() => f[at] ^= 1 << rng.below(8),
            1 if at < f.len() => {
                f.remove(at);
            }
            2 => f.insert(at, rng.next() as u8),
            3 if f.len() >= 4 => {
                let len = [0u32, 1, 3, u32::MAX, (MAX_FRAME_BYTES + 1) as u32, (MAX_FRAME_BYTES - 1) as u32, rng.next() as u32][rng.below(7) as usize];
                f[..4].copy_from_slice(&len.to_le_bytes());
            }
            4 => f.truncate(at),
            _ => {}
        }
    }
    f
}

#[test]
fn the_handles_cross_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Store>();
    send_sync::<StoreServer>();
    send_sync::<Rendezvous>();
}

#[test]
fn frames_round_trip() {
    let mut rng = Rng(11);
    for _ in 0..5000 {
        let req = random_request(&mut rng);
        let frame = req.encode();
        let body = proto::read_frame(&mut &frame[..], MAX_FRAME_BYTES).unwrap().unwrap();
        assert_eq!(Request::parse(&body), Ok(req));
        let resp = random_response(&mut rng);
        let frame = resp.encode();
        let body = proto::read_frame(&mut &frame[..], MAX_FRAME_BYTES).unwrap().unwrap();
        assert_eq!(Response::parse(&body), Ok(resp));
    }
}

/// The frame parsers over random bytes and mutated valid frames: never a
/// panic, never an allocation beyond the input, and whatever parses is
/// canonical (encodes back to the same bytes).
#[test]
fn frame_parsers_survive_fuzzing() {
    let mut rng = Rng(12);
    let mut parsed = 0;
    for i in 0..200_000 {
        let frame = if i % 3 == 0 {
            let n = rng.below(64) as usize;
            rng.bytes(n)
        } else if i % 3 == 1 {
            let f = random_request(&mut rng).encode();
            mutate(&mut rng, &f)
        } else {
            let f = random_response(&mut rng).encode();
            mutate(&mut rng, &f)
        };
        // As a stream: the length prefix, then the body.
        let mut reader = &frame[..];
        if let Ok(Some(body)) = proto::read_frame(&mut reader, MAX_FRAME_BYTES) {
            if let Ok(req) = Request::parse(&body) {
                parsed += 1;
                assert_eq!(req.encode()[4..], body[..], "{req:?}");
            }
            if let Ok(resp) = Response::parse(&body) {
                if !matches!(resp, Response::Refused(..) | Response::Present(_)) {
                    assert_eq!(resp.encode()[4..], body[..], "{resp:?}");
                }
            }
        }
        // As a bare body.
        let _ = Request::parse(&frame);
        let _ = Response::parse(&frame);
    }
    assert!(parsed > 1000, "the mutations never left a frame valid: the fuzzer explores too little");
    // Declared counts and lengths the frame cannot hold are refused before
    // anything is reserved for them.
    let mut huge = vec![4u8];
    huge.extend_from_slice(&(super::MAX_KEYS_PER_REQUEST as u32).to_le_bytes());
    assert!(Request::parse(&huge).is_err());
    let mut huge = vec![1u8];
    huge.extend_from_slice(&u32::MAX.to_le_bytes());
    assert!(Request::parse(&huge).is_err());
}

/// Hostile connections: random bytes, mutated frames, lengths beyond the
/// limit, truncated frames, frames before the greeting. Each closes only
/// its own connection; the server keeps serving, no handler panics, and
/// every hostile connection's thread ends.
#[test]
fn the_server_survives_hostile_clients() {
    let (server, store) = server();
    let addr = server.local_addr();
    let hello = Request::Hello { version: proto::VERSION }.encode();
    let mut rng = Rng(13);
    for i in 0..400 {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let greet = rng.below(3) != 0;
        if greet {
            s.write_all(&hello).unwrap();
            let body = proto::read_frame(&mut s, MAX_FRAME_BYTES).unwrap().unwrap();
            assert!(matches!(Response::parse(&body), Ok(Response::Hello { .. })));
        }
        let payload = match i % 4 {
            0 => {
                let n = rng.below(200) as usize;
                rng.bytes(n)
            }
            1 => {
                let f = random_request(&mut rng).encode();
                mutate(&mut rng, &f)
            }
            2 => {
                // A length the server must refuse to allocate for.
                let mut f = ((MAX_FRAME_BYTES + 1 + rng.below(1 << 30) as usize) as u32).to_le_bytes().to_vec();
                f.extend(rng.bytes(16));
                f
            }
            _ => {
                // A large, valid-looking frame cut short.
                let mut f = Request::Set { key: "k".into(), value: vec![7; 100_000] }.encode();
                f.truncate(rng.below(f.len() as u64) as usize);
                f
            }
        };
        let _ = s.write_all(&payload);
        if rng.below(2) == 0 {
            // Read whatever comes back (a refusal, an answer, or the end).
            let _ = s.shutdown(std::net::Shutdown::Write);
            let mut sink = Vec::new();
            let _ = s.read_to_end(&mut sink);
        }
        drop(s);
        if i % 50 == 0 {
            store.set("alive", &[i as u8]).unwrap();
            assert_eq!(store.get("alive", SHORT).unwrap(), [i as u8]);
        }
    }
    // Only the good client's pooled connection is left.
    assert!(eventually(Duration::from_secs(5), || server.connections() == 1), "{} connections still open", server.connections());
    assert_eq!(server.handler_panics(), 0);
    store.set("after", b"ok").unwrap();
    assert_eq!(store.get("after", SHORT).unwrap(), b"ok");
}

/// A client that goes away while its request waits frees its server
/// thread within a poll, not when the wait it asked for ends, even while
/// other keys keep changing.
#[test]
fn a_client_gone_while_waiting_frees_its_thread() {
    let (server, store) = server();
    let mut s = TcpStream::connect(server.local_addr()).unwrap();
    s.write_all(&Request::Hello { version: proto::VERSION }.encode()).unwrap();
    proto::read_frame(&mut s, MAX_FRAME_BYTES).unwrap().unwrap();
    s.write_all(&Request::Get { key: "never".into(), wait_ms: 3_600_000 }.encode()).unwrap();
    assert!(eventually(LONG, || server.connections() == 2));
    drop(s);
    let t = Instant::now();
    let i = AtomicUsize::new(0);
    assert!(
        eventually(Duration::from_secs(3), || store.set("churn", &[i.fetch_add(1, Ordering::Relaxed) as u8]).is_ok() && server.connections() == 1),
        "the waiting request's thread outlived its client"
    );
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
}

/// Run only as a child process of `a_client_killed_mid_frame`: connects,
/// sends half a frame, says so, and waits to be killed.
#[test]
fn child_half_frame() {
    let Ok(addr) = std::env::var("TESSERA_STORE_TEST_HALF_FRAME") else { return };
    let mut s = TcpStream::connect(addr.as_str()).unwrap();
    s.write_all(&Request::Hello { version: proto::VERSION }.encode()).unwrap();
    proto::read_frame(&mut s, MAX_FRAME_BYTES).unwrap().unwrap();
    let frame = Request::Set { key: "half".into(), value: vec![1; 1 << 20] }.encode();
    s.write_all(&frame[..frame.len() / 2]).unwrap();
    println!("HALF-FRAME-SENT");
    std::io::stdout().flush().unwrap();
    std::thread::sleep(Duration::from_secs(60));
}

#[test]
fn a_client_killed_mid_frame() {
    let (server, store) = server();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "store::tests::child_half_frame", "--nocapture", "--test-threads=1"])
        .env("TESSERA_STORE_TEST_HALF_FRAME", server.local_addr().to_string())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    assert!(lines.any(|l| l.map(|l| l.contains("HALF-FRAME-SENT")).unwrap_or(false)), "the child never sent its half frame");
    assert_eq!(server.connections(), 2);
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(eventually(Duration::from_secs(5), || server.connections() == 1), "the killed client's connection is still open");
    assert_eq!(store.try_get("half").unwrap(), None, "half a frame must not be applied");
    store.set("still", b"serving").unwrap();
    assert_eq!(store.get("still", SHORT).unwrap(), b"serving");
    assert_eq!(server.handler_panics(), 0);
}

#[test]
fn concurrent_adds_sum_exactly() {
    let (server, store) = server();
    let threads = 16;
    let per = 200;
    let seen: Vec<Vec<i64>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                // Half the threads share the first client, half open their own.
                let store = if t % 2 == 0 { store.clone() } else { Store::connect("127.0.0.1", server.local_addr().port(), LONG).unwrap() };
                s.spawn(move || {
                    let mut rng = Rng(100 + t);
                    let mut seen = Vec::new();
                    for _ in 0..per {
                        seen.push(store.add("ones", 1).unwrap());
                        store.add("mixed", rng.below(2001) as i64 - 1000).unwrap();
                    }
                    seen
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut all: Vec<i64> = seen.into_iter().flatten().collect();
    all.sort();
    // Every increment saw a distinct value: the adds were atomic.
    assert_eq!(all, (1..=(threads * per) as i64).collect::<Vec<_>>());
    let mut expected = 0i64;
    for t in 0..threads {
        let mut rng = Rng(100 + t);
        for _ in 0..per {
            expected += rng.below(2001) as i64 - 1000;
        }
    }
    assert_eq!(store.add("mixed", 0).unwrap(), expected);
    assert_eq!(store.get("ones", SHORT).unwrap(), (threads * per).to_string().as_bytes());
}

#[test]
fn add_semantics() {
    let (_server, store) = server();
    assert_eq!(store.add("c", -5).unwrap(), -5);
    store.set("d", b"41").unwrap();
    assert_eq!(store.add("d", 1).unwrap(), 42);
    store.set("text", b"hello").unwrap();
    assert!(matches!(store.add("text", 1), Err(Error::InvalidArgument { op: "store add", .. })));
    store.set("big", i64::MAX.to_string().as_bytes()).unwrap();
    let e = store.add("big", 1).unwrap_err();
    assert!(e.to_string().contains("overflows"), "{e}");
    // The client stays usable after a refusal.
    assert!(store.delete_key("big").unwrap());
    assert!(!store.delete_key("big").unwrap());
    assert_eq!(store.add("big", 1).unwrap(), 1);
}

#[test]
fn barriers_of_many_threads() {
    let (server, store) = server();
    let n = 12;
    let before = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for t in 0..n {
            let store = if t % 3 == 0 { store.clone() } else { Store::connect("127.0.0.1", server.local_addr().port(), LONG).unwrap() };
            let before = &before;
            s.spawn(move || {
                for round in 0..4 {
                    // Stagger arrivals so that early threads really wait.
                    std::thread::sleep(Duration::from_millis((t as u64 * 7 + round * 3) % 20));
                    before.fetch_add(1, Ordering::SeqCst);
                    store.barrier(&format!("round-{round}"), n, LONG).unwrap();
                    // Nobody leaves a barrier before everyone reached it.
                    assert!(before.load(Ordering::SeqCst) >= n * (round as usize + 1));
                }
            });
        }
    });
    // A used name is refused, not silently passed.
    let e = store.barrier("round-0", n, SHORT).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }) && e.to_string().contains("give every barrier its own name"), "{e}");
    // Too few ranks: a timeout that says how many arrived.
    let t = Instant::now();
    let e = store.barrier("short", 3, SHORT).unwrap_err();
    assert!(matches!(e, Error::Timeout { op: "store barrier", .. }) && e.to_string().contains("1 of 3 ranks arrived"), "{e}");
    // (The wait is counted from the call, the server's from the request.)
    assert!(t.elapsed() >= SHORT * 9 / 10 && t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    assert!(matches!(store.barrier("zero", 0, SHORT), Err(Error::InvalidArgument { .. })));
}

#[test]
fn waits_time_out_and_wake() {
    let (_server, store) = server();
    let t = Instant::now();
    let e = store.get("never", SHORT).unwrap_err();
    assert!(matches!(e, Error::Timeout { op: "store get", .. }) && e.to_string().contains("`never`"), "{e}");
    assert!(t.elapsed() >= SHORT && t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    store.set("a", b"1").unwrap();
    let e = store.wait(&["a", "b", "c"], SHORT).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("2 of 3 keys") && msg.contains("`b`") && msg.contains("`c`") && !msg.contains("`a`"), "{msg}");
    assert!(matches!(store.wait_any(&["x", "y"], SHORT), Err(Error::Timeout { op: "store wait_any", .. })));
    assert_eq!(store.wait_any(&["x", "a"], SHORT).unwrap(), 1);
    assert!(store.wait(&[], SHORT).is_ok());
    assert_eq!(store.try_get("b").unwrap(), None);
    assert_eq!(store.check(&["a", "b"]).unwrap(), [true, false]);
    // A waiter is woken by a set from another thread through the same
    // client: the pool gives the setter its own connection.
    std::thread::scope(|s| {
        let waiter = s.spawn(|| store.get("later", LONG));
        let any = s.spawn(|| store.wait_any(&["p", "q", "later"], LONG));
        let all = s.spawn(|| store.wait(&["later", "a"], LONG));
        std::thread::sleep(Duration::from_millis(100));
        let t = Instant::now();
        store.set("later", b"now").unwrap();
        assert_eq!(waiter.join().unwrap().unwrap(), b"now");
        assert_eq!(any.join().unwrap().unwrap(), 2);
        all.join().unwrap().unwrap();
        assert!(t.elapsed() < Duration::from_secs(2));
    });
    // More keys than one request carries are split.
    let many: Vec<String> = (0..MAX_KEYS_PER_REQUEST + 10).map(|i| format!("m{i}")).collect();
    let refs: Vec<&str> = many.iter().map(String::as_str).collect();
    for k in &refs[..refs.len() - 1] {
        store.set(k, b"").unwrap();
    }
    let present = store.check(&refs).unwrap();
    assert_eq!(present.iter().filter(|&&p| p).count(), refs.len() - 1);
    let e = store.wait(&refs, SHORT).unwrap_err();
    assert!(e.to_string().contains(&format!("`m{}`", MAX_KEYS_PER_REQUEST + 9)), "{e}");
    assert!(matches!(store.wait_any(&refs, SHORT), Err(Error::InvalidArgument { .. })));
}

#[test]
fn large_and_empty_values_and_keys() {
    let (_server, store) = server();
    store.set("empty", b"").unwrap();
    assert_eq!(store.get("empty", SHORT).unwrap(), b"");
    assert_eq!(store.try_get("empty").unwrap(), Some(vec![]));
    store.set("", b"empty key").unwrap();
    assert_eq!(store.get("", SHORT).unwrap(), b"empty key");
    let big: Vec<u8> = (0..MAX_VALUE_BYTES).map(|i| (i * 31 % 251) as u8).collect();
    store.set("big", &big).unwrap();
    assert!(store.get("big", LONG).unwrap() == big);
    let mut too_big = big;
    too_big.push(0);
    let e = store.set("big", &too_big).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { op: "store set", .. }) && e.to_string().contains("communicator"), "{e}");
    let long_key = "k".repeat(MAX_KEY_BYTES);
    store.set(&long_key, b"x").unwrap();
    assert_eq!(store.get(&long_key, SHORT).unwrap(), b"x");
    let too_long = "k".repeat(MAX_KEY_BYTES + 1);
    assert!(matches!(store.set(&too_long, b"x"), Err(Error::InvalidArgument { .. })));
    assert!(matches!(store.get(&too_long, SHORT), Err(Error::InvalidArgument { .. })));
    store.set("ключ/🔑", b"unicode").unwrap();
    assert_eq!(store.get("ключ/🔑", SHORT).unwrap(), b"unicode");
}

#[test]
fn a_vanished_server_is_an_error_naming_it_not_a_hang() {
    let (server, store) = server();
    let addr = store.addr().to_string();
    let t = Instant::now();
    std::thread::scope(|s| {
        let waiter = s.spawn(|| store.get("never", LONG));
        std::thread::sleep(Duration::from_millis(100));
        drop(server);
        let e = waiter.join().unwrap().unwrap_err();
        assert!(matches!(&e, Error::Rendezvous { addr: a, .. } if *a == addr), "{e}");
    });
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    // Later calls fail the same way, quickly.
    let e = store.set("k", b"v").unwrap_err();
    assert!(matches!(&e, Error::Rendezvous { addr: a, .. } if *a == addr) && e.to_string().contains("rank 0"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(6));
}

#[test]
fn dropping_the_server_frees_its_port() {
    let server = StoreServer::bind("127.0.0.1", 0).unwrap();
    let port = server.local_addr().port();
    let _client = Store::connect("127.0.0.1", port, LONG).unwrap();
    drop(server);
    let again = StoreServer::bind("127.0.0.1", port).unwrap();
    assert_eq!(again.local_addr().port(), port);
    let e = StoreServer::bind("127.0.0.1", port).err().unwrap();
    assert!(e.to_string().contains(&format!("port {port} is already in use")) && e.to_string().contains("MASTER_PORT"), "{e}");
}

#[test]
fn connect_waits_for_a_late_master_and_gives_up_in_time() {
    let port = free_port();
    let late = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        let server = StoreServer::bind("127.0.0.1", port).unwrap();
        std::thread::sleep(Duration::from_secs(2));
        drop(server);
    });
    let store = Store::connect("127.0.0.1", port, LONG).unwrap();
    assert_eq!(store.local_ip(), std::net::IpAddr::from([127, 0, 0, 1]));
    store.set("k", b"v").unwrap();
    late.join().unwrap();

    let port = free_port();
    let t = Instant::now();
    let e = Store::connect("127.0.0.1", port, SHORT).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(&e, Error::Rendezvous { addr, .. } if *addr == format!("127.0.0.1:{port}")), "{e}");
    assert!(msg.contains("MASTER_ADDR") && msg.contains("firewall") && msg.contains("rank 0"), "{msg}");
    assert!(t.elapsed() >= SHORT && t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    assert!(Store::connect("no-such-host.invalid", 1, Duration::ZERO).unwrap_err().to_string().contains("no-such-host.invalid"));
}

#[test]
fn something_else_on_the_port_is_named() {
    // A program that answers with something else.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let http = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut buf = [0u8; 64];
        let _ = s.read(&mut buf);
        let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n");
    });
    let t = Instant::now();
    let e = Store::connect("127.0.0.1", port, LONG).unwrap_err();
    assert!(e.to_string().contains("not a Tessera rendezvous store"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(3), "gave up only after {:?}", t.elapsed());
    http.join().unwrap();
    // A store of another protocol version.
    let (server, _store) = server();
    let mut s = TcpStream::connect(server.local_addr()).unwrap();
    s.write_all(&Request::Hello { version: proto::VERSION + 1 }.encode()).unwrap();
    let body = proto::read_frame(&mut s, MAX_FRAME_BYTES).unwrap().unwrap();
    assert!(matches!(Response::parse(&body), Ok(Response::Refused(Refusal::Protocol, m)) if m.contains("same Tessera build")));
}

// ---- rendezvous ----

fn env(rank: usize, world: usize, port: u16, restart: u32) -> ProcessEnv {
    ProcessEnv {
        rank,
        world_size: world,
        local_rank: rank,
        local_world_size: world,
        node_rank: 0,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        restart,
        launcher: Launcher::Torchrun,
    }
}

/// Joins every env on its own thread, all at once.
fn join_all(envs: Vec<ProcessEnv>, timeout: Duration) -> Vec<tessera_core::Result<Rendezvous>> {
    let go = Arc::new(Barrier::new(envs.len()));
    let handles: Vec<_> = envs
        .into_iter()
        .map(|e| {
            let go = go.clone();
            std::thread::spawn(move || {
                go.wait();
                Rendezvous::join(&e, timeout)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn ranks_on_threads_rendezvous() {
    for (world, master) in [(1, "127.0.0.1"), (6, "127.0.0.1"), (3, "localhost")] {
        let port = free_port();
        let envs = (0..world)
            .map(|r| {
                let mut e = env(r, world, port, 0);
                e.master_addr = master.into();
                e
            })
            .collect();
        let joined: Vec<Rendezvous> = join_all(envs, LONG).into_iter().map(Result::unwrap).collect();
        for (r, rdzv) in joined.iter().enumerate() {
            assert_eq!(rdzv.env().rank, r);
            assert_eq!(rdzv.server().is_some(), r == 0);
            assert_eq!(rdzv.key("x"), "tessera/0/x");
            assert!(rdzv.store().local_ip().is_loopback());
        }
        // Every rank had arrived when the first returned.
        let store = joined[world - 1].store();
        assert_eq!(store.add(&joined[0].key("rdzv/arrived"), 0).unwrap(), world as i64);
        // The store is shared: what one rank sets, every rank reads.
        joined[0].store().set(&joined[0].key("hello"), b"from 0").unwrap();
        for rdzv in &joined {
            assert_eq!(rdzv.store().get(&rdzv.key("hello"), SHORT).unwrap(), b"from 0");
        }
    }
}

#[test]
fn ranks_that_disagree_on_the_world_size() {
    let port = free_port();
    let results = join_all(vec![env(0, 2, port, 0), env(1, 3, port, 0)], LONG);
    let msgs: Vec<String> = results.into_iter().map(|r| r.err().expect("the rendezvous must fail").to_string()).collect();
    for m in &msgs {
        assert!(m.contains("disagree on the world size") && m.contains("a world of 3 (WORLD_SIZE)") && m.contains("rank 0 with a world of 2"), "{m}");
        assert!(m.contains(&format!("127.0.0.1:{port}")), "{m}");
    }
    assert!(msgs[0].contains("another rank stopped the rendezvous"), "{}", msgs[0]);
    // A rank outside rank 0's world says so too.
    let port = free_port();
    let results = join_all(vec![env(0, 2, port, 0), env(3, 4, port, 0)], LONG);
    let m = results[1].as_ref().err().unwrap().to_string();
    assert!(m.contains("rank 3 is not even in rank 0's world"), "{m}");
}

#[test]
fn a_rank_started_twice() {
    let port = free_port();
    let results = join_all(vec![env(0, 3, port, 0), env(1, 3, port, 0), env(1, 3, port, 0)], LONG);
    let msgs: Vec<String> = results.into_iter().map(|r| r.err().expect("the rendezvous must fail").to_string()).collect();
    assert!(msgs.iter().all(|m| m.contains("rank 1 joined twice")), "{msgs:?}");
    // Rank 0 twice: the second finds the first serving this attempt.
    let port = free_port();
    let first = Rendezvous::join(&env(0, 1, port, 0), LONG).unwrap();
    let t = Instant::now();
    let e = Rendezvous::join(&env(0, 1, port, 0), LONG).err().unwrap();
    assert!(e.to_string().contains("rank 0 was started twice"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(3));
    drop(first);
}

#[test]
fn a_rank_outside_the_world() {
    let e = Rendezvous::join(&env(2, 2, free_port(), 0), LONG).err().unwrap();
    assert!(e.to_string().contains("rank 2 is not below the world size 2") && e.to_string().contains("RANK"), "{e}");
}

#[test]
fn an_unreachable_master() {
    let port = free_port();
    let t = Instant::now();
    let e = Rendezvous::join(&env(1, 2, port, 0), SHORT).err().unwrap();
    let msg = e.to_string();
    assert!(matches!(&e, Error::Rendezvous { addr, .. } if *addr == format!("127.0.0.1:{port}")), "{e}");
    assert!(msg.contains("MASTER_ADDR and MASTER_PORT") && msg.contains("firewall") && msg.contains("rank 0 has started"), "{msg}");
    assert!(t.elapsed() < Duration::from_secs(3));
}

#[test]
fn a_port_in_use_on_rank_0() {
    // Another program holds the port: it neither is a store nor answers.
    let holder = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = holder.local_addr().unwrap().port();
    let t = Instant::now();
    let e = Rendezvous::join(&env(0, 2, port, 0), LONG).err().unwrap();
    let msg = e.to_string();
    assert!(msg.contains(&format!("port {port} is already in use")) && msg.contains("another MASTER_PORT"), "{msg}");
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    // A plain store (not a rendezvous) on the port: also in use.
    let plain = StoreServer::bind("127.0.0.1", 0).unwrap();
    let e = Rendezvous::join(&env(0, 2, plain.local_addr().port(), 0), LONG).err().unwrap();
    assert!(e.to_string().contains("already in use"), "{e}");
}

#[test]
fn a_timeout_names_the_missing_ranks() {
    let port = free_port();
    let timeout = Duration::from_millis(1500);
    let t = Instant::now();
    let results = join_all(vec![env(0, 5, port, 0), env(1, 5, port, 0), env(3, 5, port, 0)], timeout);
    for r in results {
        let m = r.err().expect("two ranks never came").to_string();
        assert!(m.contains("3 of 5 ranks arrived") && m.contains("missing: ranks 2, 4"), "{m}");
    }
    assert!(t.elapsed() < timeout + Duration::from_secs(3), "{:?}", t.elapsed());
    let mut many: Vec<u64> = (0..100).filter(|r| r % 2 == 0).collect();
    many.extend([101, 102, 103]);
    let text = rank_ranges_for_test(&many);
    assert!(text.starts_with("ranks 0, 2, 4") && text.ends_with("more runs"), "{text}");
    assert_eq!(rank_ranges_for_test(&[7]), "rank 7");
    assert_eq!(rank_ranges_for_test(&[1, 2, 3, 5]), "ranks 1-3, 5");
}

fn rank_ranges_for_test(r: &[u64]) -> String {
    super::rendezvous::rank_ranges(r)
}

#[test]
fn a_restarted_job_waits_out_the_previous_attempt() {
    let port = free_port();
    // Attempt 0's rank 0 is still up (a world of one, so it has joined).
    let old = Rendezvous::join(&env(0, 1, port, 0), LONG).unwrap();
    // Attempt 1 starts: its rank 1 reaches the old store, its rank 0 finds
    // the port held. Both wait, and join once the old rank 0 is gone.
    let new: Vec<_> = [env(0, 2, port, 1), env(1, 2, port, 1)].into_iter().map(|e| std::thread::spawn(move || Rendezvous::join(&e, LONG))).collect();
    std::thread::sleep(Duration::from_millis(400));
    drop(old);
    let joined: Vec<Rendezvous> = new.into_iter().map(|h| h.join().unwrap().unwrap()).collect();
    assert_eq!(joined[1].key("k"), "tessera/1/k");
    // A process of attempt 0 that reaches attempt 1's store stops.
    let e = Rendezvous::join(&env(1, 2, port, 0), LONG).err().unwrap();
    assert!(e.to_string().contains("left over from an earlier attempt"), "{e}");
    // And a rank 0 of attempt 0 finds the port held by a newer attempt.
    let e = Rendezvous::join(&env(0, 2, port, 0), LONG).err().unwrap();
    assert!(e.to_string().contains("left over from an earlier attempt"), "{e}");
}

/// Run only as a child of `ranks_as_processes_rendezvous`: one rank, its
/// place read from its real environment.
#[test]
fn child_rank() {
    if std::env::var("TESSERA_STORE_TEST_CHILD_RANK").is_err() {
        return;
    }
    let env = ProcessEnv::detect().unwrap().expect("the parent sets RANK and friends");
    let rdzv = Rendezvous::join(&env, LONG).unwrap();
    let store = rdzv.store();
    store.set(&rdzv.key(&format!("pid/{}", env.rank)), std::process::id().to_string().as_bytes()).unwrap();
    store.barrier(&rdzv.key("done"), env.world_size, LONG).unwrap();
    println!("CHILD-RANK-{}-OK", env.rank);
}

#[test]
fn ranks_as_processes_rendezvous() {
    let world = 4;
    let port = free_port();
    let children: Vec<_> = (1..world)
        .map(|rank| {
            std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "store::tests::child_rank", "--nocapture", "--test-threads=1"])
                .env("TESSERA_STORE_TEST_CHILD_RANK", "1")
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("LOCAL_WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env_remove("GROUP_RANK")
                .env_remove("TESSERA_RESTART_COUNT")
                .env_remove("TORCHELASTIC_RESTART_COUNT")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    // Rank 0 is this process, its place read from the same variables.
    let vars = [
        ("RANK", "0".to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_RANK", "0".into()),
        ("LOCAL_WORLD_SIZE", world.to_string()),
        ("MASTER_PORT", port.to_string()),
    ];
    let env = ProcessEnv::from_vars(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone())).unwrap().unwrap();
    let rdzv = Rendezvous::join(&env, LONG).unwrap();
    rdzv.store().barrier(&rdzv.key("done"), world, LONG).unwrap();
    for rank in 1..world {
        let pid = rdzv.store().get(&rdzv.key(&format!("pid/{rank}")), SHORT).unwrap();
        assert_ne!(pid, std::process::id().to_string().as_bytes(), "rank {rank} ran in this process");
    }
    for (i, child) in children.into_iter().enumerate() {
        let out = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains(&format!("CHILD-RANK-{}-OK", i + 1)),
            "rank {}: {stdout}\n{}",
            i + 1,
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
