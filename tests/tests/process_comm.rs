//! Communicators between processes (TCP): generated programs of collectives
//! give every rank the same bits as the in-process communicator; mismatched
//! calls, a rank that leaves, hangs, aborts or panics turn into errors that
//! name it on every rank, within the timeout; stray connections are refused.
//!
//! Each rank here is a thread with its own [`ProcessWorld`], connected to
//! the others over loopback TCP exactly as separate processes are (the
//! connections, reader threads and frames are the same); tests with real
//! processes are in the launcher's and the trainer's tests.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Barrier;
use std::thread;
use std::time::{Duration, Instant};
use tessera::dist::inproc::InProcess;
use tessera::dist::process::ProcessWorld;
use tessera::dist::Communicator;
use tessera::prelude::*;
use tessera::Error;

/// Connects `n` ranks of job `job` (each a [`ProcessWorld`] made on its own
/// thread, as processes would) and returns them in rank order.
fn connect(n: usize, job: u64, timeout: Duration) -> Vec<ProcessWorld> {
    let listeners: Vec<TcpListener> = (0..n).map(|_| TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    thread::scope(|s| {
        let handles: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(r, l)| {
                let addrs = &addrs;
                s.spawn(move || ProcessWorld::connect(r, l, addrs, job, &Device::cpu(), timeout).unwrap())
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Runs `f(rank)` for every rank on its own thread; results in rank order.
fn run<R: Send>(n: usize, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
    thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = (0..n).map(|r| s.spawn(move || f(r))).collect();
        handles.into_iter().map(|h| h.join().expect("rank thread panicked")).collect()
    })
}

/// A deterministic generator of test cases.
struct Gen(u64);

impl Gen {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// One call of a generated program, the same on every rank.
#[derive(Clone, Debug)]
enum Call {
    AllReduce { dims: Vec<usize>, dtype: DType, asynchronous: bool },
    AllGather { dims: Vec<usize>, dim: usize, dtype: DType },
    ReduceScatter { dims: Vec<usize>, dim: usize, dtype: DType, asynchronous: bool },
    Broadcast { dims: Vec<usize>, root: usize, dtype: DType },
    AllToAll { rows: Vec<Vec<usize>> },
    SendRecv { len: usize },
    Barrier,
}

fn program(seed: u64, n: usize, calls: usize) -> Vec<Call> {
    let mut g = Gen(seed);
    let dtypes = [DType::F32, DType::BF16, DType::F16, DType::F64, DType::I32];
    (0..calls)
        .map(|_| {
            let dtype = dtypes[g.below(dtypes.len())];
            let rank_count = 1 + g.below(3);
            let mut dims: Vec<usize> = (0..rank_count).map(|_| 1 + g.below(9)).collect();
            match g.below(7) {
                0 => Call::AllReduce { dims, dtype, asynchronous: g.below(2) == 0 },
                1 => {
                    let dim = g.below(dims.len());
                    Call::AllGather { dims, dim, dtype }
                }
                2 => {
                    let dim = g.below(dims.len());
                    dims[dim] *= n;
                    Call::ReduceScatter { dims, dim, dtype, asynchronous: g.below(2) == 0 }
                }
                3 => Call::Broadcast { dims, root: g.below(n), dtype },
                4 => Call::AllToAll { rows: (0..n).map(|_| (0..n).map(|_| g.below(5)).collect()).collect() },
                5 => Call::SendRecv { len: 1 + g.below(300) },
                _ => Call::Barrier,
            }
        })
        .collect()
}

/// Rank `rank`'s input of call `i`.
fn input(rank: usize, i: usize, dims: &[usize], dtype: DType, dev: &Device) -> Tensor {
    let key = RngKey::new(77 + rank as u64, i as u64);
    match dtype {
        DType::I32 => {
            let len: usize = dims.iter().product();
            let v: Vec<i32> = (0..len).map(|j| (j as i32 * 7919 + rank as i32 * 31 + i as i32) % 1000 - 500).collect();
            Tensor::from_vec(v, dims, dev).unwrap()
        }
        _ => Tensor::rand(Init::Uniform { lo: -3.0, hi: 3.0 }, key, dims, dtype, dev).unwrap(),
    }
}

/// A result's shape, dtype and the bits of every element.
type Fingerprint = (Vec<usize>, DType, Vec<u64>);

/// The bits of every element (and the shape) of `t`.
fn fingerprint(t: &Tensor) -> Fingerprint {
    (t.dims().to_vec(), t.dtype(), t.to_f64_vec().unwrap().iter().map(|v| v.to_bits()).collect())
}

/// Runs `program` on `comm` as rank `rank` of `n` and returns what every
/// call gave this rank.
fn execute(comm: &dyn Communicator, program: &[Call], rank: usize, n: usize, dev: &Device) -> Vec<Vec<Fingerprint>> {
    program
        .iter()
        .enumerate()
        .map(|(i, call)| match call {
            Call::AllReduce { dims, dtype, asynchronous } => {
                let x = input(rank, i, dims, *dtype, dev);
                let y = if *asynchronous { comm.all_reduce_sum_async(&x).unwrap().wait() } else { comm.all_reduce_sum(&x) };
                vec![fingerprint(&y.unwrap())]
            }
            Call::AllGather { dims, dim, dtype } => vec![fingerprint(&comm.all_gather(&input(rank, i, dims, *dtype, dev), *dim).unwrap())],
            Call::ReduceScatter { dims, dim, dtype, asynchronous } => {
                let x = input(rank, i, dims, *dtype, dev);
                let y = if *asynchronous { comm.reduce_scatter_sum_async(&x, *dim).unwrap().wait() } else { comm.reduce_scatter_sum(&x, *dim) };
                vec![fingerprint(&y.unwrap())]
            }
            Call::Broadcast { dims, root, dtype } => vec![fingerprint(&comm.broadcast(&input(rank, i, dims, *dtype, dev), *root).unwrap())],
            Call::AllToAll { rows } => {
                let parts: Vec<Tensor> = (0..n).map(|to| input(rank * n + to, i, &[rows[rank][to], 2], DType::F32, dev)).collect();
                comm.all_to_all(parts).unwrap().iter().map(fingerprint).collect()
            }
            Call::SendRecv { len } => {
                // A ring: everyone sends first (sends never wait), then receives.
                let x = input(rank, i, &[*len], DType::BF16, dev);
                comm.send(&x, (rank + 1) % n).unwrap();
                vec![fingerprint(&comm.recv((rank + n - 1) % n).unwrap())]
            }
            Call::Barrier => {
                comm.barrier().unwrap();
                Vec::new()
            }
        })
        .collect()
}

#[test]
fn generated_programs_give_the_in_process_bits_on_every_rank() {
    for (case, n) in [2usize, 3, 4, 2, 3].into_iter().enumerate() {
        let seed = 0x9E37_79B9 + case as u64;
        let prog = program(seed, n, 40);
        let inproc = InProcess::new(n).unwrap();
        let want = run(n, |r| {
            let dev = Device::cpu();
            let comm = inproc.communicator(r, &dev).unwrap();
            execute(&comm, &prog, r, n, &dev)
        });
        let worlds = connect(n, seed, Duration::from_secs(30));
        let got = run(n, |r| {
            let comm = worlds[r].communicator().unwrap();
            execute(&comm, &prog, r, n, &Device::cpu())
        });
        for r in 0..n {
            for (i, call) in prog.iter().enumerate() {
                assert_eq!(got[r][i], want[r][i], "case {case} (world {n}), rank {r}, call {i}: {call:?}");
            }
        }
    }
}

/// Sub-groups of a mesh share the connections but not their order: two
/// groups with the same members run independent sequences of collectives,
/// and a group over some ranks works while the others do something else.
#[test]
fn groups_with_the_same_members_stay_independent() {
    let worlds = connect(4, 1, Duration::from_secs(30));
    run(4, |r| {
        let dev = Device::cpu();
        let a = worlds[r].tagged_group("a", &[0, 1, 2, 3]).unwrap();
        let b = worlds[r].tagged_group("b", &[0, 1, 2, 3]).unwrap();
        let pair = worlds[r].tagged_group("pair", &[r / 2 * 2, r / 2 * 2 + 1]).unwrap();
        let x = Tensor::from_vec(vec![r as f32; 4], [4], &dev).unwrap();
        // Issued in opposite orders on even and odd ranks: each group's own
        // order is what matters.
        let (pa, pb) = if r % 2 == 0 {
            let pa = a.all_reduce_sum_async(&x).unwrap();
            (pa, b.all_gather_async(&x, 0).unwrap())
        } else {
            let pb = b.all_gather_async(&x, 0).unwrap();
            (a.all_reduce_sum_async(&x).unwrap(), pb)
        };
        let s = pair.all_reduce_sum(&x).unwrap().to_vec::<f32>().unwrap();
        assert_eq!(s, vec![(r / 2 * 4 + 1) as f32; 4]);
        assert_eq!(pa.wait().unwrap().to_vec::<f32>().unwrap(), vec![6.0; 4]);
        assert_eq!(pb.wait().unwrap().dims(), &[16]);
        assert!(worlds[r].tagged_group("a", &[0, 1, 2, 3]).is_err(), "a second communicator for the same group");
    });
}

#[test]
fn mismatched_calls_are_errors_on_every_rank_and_the_group_stays_usable() {
    let worlds = connect(3, 2, Duration::from_secs(30));
    let start = Instant::now();
    run(3, |rank| {
        let dev = Device::cpu();
        let comm = worlds[rank].communicator().unwrap();
        let x = input(rank, 0, &[6, 4], DType::F32, &dev);
        let e = if rank == 0 { comm.all_reduce_sum(&x) } else { comm.all_gather(&x, 0) }.unwrap_err();
        assert!(matches!(e, Error::CollectiveMismatch { .. }), "{e}");
        assert!(e.to_string().contains("all_reduce_sum") && e.to_string().contains("all_gather"), "{e}");
        let y = input(rank, 0, &[6, 4 + rank], DType::F32, &dev);
        assert!(matches!(comm.all_reduce_sum(&y), Err(Error::CollectiveMismatch { .. })));
        assert!(matches!(comm.broadcast(&x, rank), Err(Error::CollectiveMismatch { .. })));
        let w = input(rank, 0, &[if rank == 0 { 4 } else { 3 }, 2], DType::F32, &dev);
        match (rank, comm.reduce_scatter_sum(&w, 0)) {
            (0, Err(Error::Shape { .. })) | (1 | 2, Err(Error::CollectiveMismatch { .. })) => {}
            (r, other) => panic!("rank {r}: unexpected {other:?}"),
        }
        let s = comm.all_reduce_sum(&x).unwrap();
        assert_eq!(s.dims(), &[6, 4]);
    });
    assert!(start.elapsed() < Duration::from_secs(10));
}

/// The error a rank's pending call returns when a peer is lost names that
/// peer, whoever noticed it first.
fn names_rank(e: &Error, lost: usize) -> bool {
    match e {
        Error::PeerFailed { rank, .. } => *rank == lost,
        Error::Timeout { detail, .. } => detail.contains(&format!("rank {lost}")),
        _ => false,
    }
}

#[test]
fn a_rank_that_never_calls_is_named_by_every_rank_within_the_timeout() {
    let timeout = Duration::from_millis(1500);
    let worlds = connect(4, 3, timeout);
    let start = Instant::now();
    let errors = run(4, |rank| {
        if rank == 2 {
            // Stays alive (its connections open) but never joins the call.
            thread::sleep(timeout * 3);
            return None;
        }
        let dev = Device::cpu();
        let comm = worlds[rank].communicator().unwrap();
        let x = input(rank, 0, &[100], DType::F32, &dev);
        let e = comm.all_reduce_sum(&x).unwrap_err();
        Some((e, start.elapsed()))
    });
    for (rank, got) in errors.into_iter().enumerate() {
        let Some((e, at)) = got else { continue };
        assert!(names_rank(&e, 2), "rank {rank}: {e}");
        assert!(at < timeout * 2 + Duration::from_millis(500), "rank {rank} stopped after {at:?}");
    }
}

#[test]
fn a_rank_that_leaves_fails_the_peers_waiting_for_it() {
    let mut worlds: Vec<Option<ProcessWorld>> = connect(3, 4, Duration::from_secs(30)).into_iter().map(Some).collect();
    let leaver = worlds[1].take().unwrap();
    let start = Instant::now();
    let ready = Barrier::new(3);
    let results = thread::scope(|s| {
        let ready = &ready;
        let h = s.spawn(move || {
            ready.wait();
            thread::sleep(Duration::from_millis(200));
            drop(leaver);
        });
        let handles: Vec<_> = [0usize, 2]
            .into_iter()
            .map(|r| {
                let w = worlds[r].as_ref().unwrap();
                s.spawn(move || {
                    let comm = w.communicator().unwrap();
                    ready.wait();
                    comm.barrier().unwrap_err()
                })
            })
            .collect();
        h.join().unwrap();
        handles.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
    });
    for e in results {
        assert!(names_rank(&e, 1), "{e}");
        assert!(e.to_string().contains("left the job"), "{e}");
    }
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[test]
fn abort_and_panics_stop_every_rank_with_the_root_cause() {
    let worlds = connect(3, 5, Duration::from_secs(30));
    let errors = run(3, |rank| {
        let comm = worlds[rank].communicator().unwrap();
        if rank == 0 {
            thread::sleep(Duration::from_millis(100));
            comm.abort("the data loader found a corrupt shard");
        }
        comm.barrier().unwrap_err()
    });
    for e in &errors {
        assert!(names_rank(e, 0) && e.to_string().contains("corrupt shard"), "{e}");
    }
    // A rank whose thread panics while holding a communicator stops the job too.
    let worlds = connect(2, 6, Duration::from_secs(30));
    let results = thread::scope(|s| {
        let w0 = &worlds[0];
        let w1 = &worlds[1];
        let p = s.spawn(move || {
            let _comm = w0.communicator().unwrap();
            thread::sleep(Duration::from_millis(100));
            panic!("a bug on rank 0");
        });
        let e = s.spawn(move || w1.communicator().unwrap().barrier().unwrap_err());
        (p.join().is_err(), e.join().unwrap())
    });
    assert!(results.0);
    assert!(names_rank(&results.1, 0) && results.1.to_string().contains("panicked"), "{}", results.1);
}

#[test]
fn a_stray_connection_is_refused_and_the_job_still_forms() {
    let listeners: Vec<TcpListener> = (0..2).map(|_| TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    // Garbage first, on rank 0's port: a port scanner, or a process that is
    // not a Tessera rank.
    let mut stray = TcpStream::connect(addrs[0]).unwrap();
    std::io::Write::write_all(&mut stray, b"GET / HTTP/1.1\r\n\r\n").unwrap();
    let worlds = thread::scope(|s| {
        let handles: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(r, l)| {
                let addrs = &addrs;
                s.spawn(move || ProcessWorld::connect(r, l, addrs, 7, &Device::cpu(), Duration::from_secs(10)).unwrap())
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
    });
    run(2, |r| worlds[r].communicator().unwrap().barrier().unwrap());
    // A rank of another job (a different job id) is not accepted either.
    let l0 = TcpListener::bind("127.0.0.1:0").unwrap();
    let l1 = TcpListener::bind("127.0.0.1:0").unwrap();
    let addrs = [l0.local_addr().unwrap(), l1.local_addr().unwrap()];
    let started = Instant::now();
    let (a, b) = thread::scope(|s| {
        let a = s.spawn(|| ProcessWorld::connect(0, l0, &addrs, 1, &Device::cpu(), Duration::from_millis(800)));
        let b = s.spawn(|| ProcessWorld::connect(1, l1, &addrs, 2, &Device::cpu(), Duration::from_millis(800)));
        (a.join().unwrap(), b.join().unwrap())
    });
    assert!(a.is_err() && b.is_err(), "ranks of different jobs must not form one");
    assert!(b.unwrap_err().to_string().contains("another job"));
    assert!(started.elapsed() < Duration::from_secs(5));
}
