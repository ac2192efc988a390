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
use tessera::dist::process::ProcessWorld;
use tessera::dist::Communicator;
use tessera::prelude::*;
use tessera_comm_harness::{
    assert_in_process_bits, assert_mismatched_calls_are_errors, execute, input, names_lost_rank, on_threads, start_in_opposite_orders, ProgramSpace,
};

/// A listener on a free loopback port for each of `n` ranks, and their addresses.
fn bind_listeners(n: usize) -> (Vec<TcpListener>, Vec<SocketAddr>) {
    let listeners: Vec<TcpListener> = (0..n).map(|_| TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    let addrs = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    (listeners, addrs)
}

/// Forms job `job` of the ranks that listen on `listeners` at `addrs` (each
/// a [`ProcessWorld`] made on its own thread, as processes would) and
/// returns them in rank order.
fn form(listeners: Vec<TcpListener>, addrs: &[SocketAddr], job: u64, timeout: Duration) -> Vec<ProcessWorld> {
    thread::scope(|s| {
        let handles: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(r, l)| s.spawn(move || ProcessWorld::connect(r, l, addrs, job, &Device::cpu(), timeout).unwrap()))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Connects `n` ranks of job `job` and returns them in rank order.
fn connect(n: usize, job: u64, timeout: Duration) -> Vec<ProcessWorld> {
    let (listeners, addrs) = bind_listeners(n);
    form(listeners, &addrs, job, timeout)
}

/// The programs here: small tensors, synchronous all-gathers.
const PROGRAMS: ProgramSpace =
    ProgramSpace { dtypes: &[DType::F32, DType::BF16, DType::F16, DType::F64, DType::I32], async_all_gather: false, large_calls: false };

#[test]
fn generated_programs_give_the_in_process_bits_on_every_rank() {
    for (case, n) in [2usize, 3, 4, 2, 3].into_iter().enumerate() {
        let seed = 0x9E37_79B9 + case as u64;
        let prog = PROGRAMS.generate(seed, n, 40);
        let worlds = connect(n, seed, Duration::from_secs(30));
        let got = on_threads(n, |r| {
            let comm = worlds[r].communicator().unwrap();
            execute(&comm, &prog, r, n, &Device::cpu())
        });
        assert_in_process_bits(&prog, &got, &format!("case {case} (world {n})"));
    }
}

/// Sub-groups of a mesh share the connections but not their order: two
/// groups with the same members run independent sequences of collectives,
/// and a group over some ranks works while the others do something else.
#[test]
fn groups_with_the_same_members_stay_independent() {
    let worlds = connect(4, 1, Duration::from_secs(30));
    on_threads(4, |r| {
        let dev = Device::cpu();
        let a = worlds[r].tagged_group("a", &[0, 1, 2, 3]).unwrap();
        let b = worlds[r].tagged_group("b", &[0, 1, 2, 3]).unwrap();
        let pair = worlds[r].tagged_group("pair", &[r / 2 * 2, r / 2 * 2 + 1]).unwrap();
        let x = Tensor::from_vec(vec![r as f32; 4], [4], &dev).unwrap();
        let (pa, pb) = start_in_opposite_orders(&a, &b, &x, r);
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
    on_threads(3, |rank| assert_mismatched_calls_are_errors(&worlds[rank].communicator().unwrap(), rank, 3, &Device::cpu()));
    assert!(start.elapsed() < Duration::from_secs(10));
}

#[test]
fn a_rank_that_never_calls_is_named_by_every_rank_within_the_timeout() {
    let timeout = Duration::from_millis(1500);
    let worlds = connect(4, 3, timeout);
    let start = Instant::now();
    let errors = on_threads(4, |rank| {
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
        assert!(names_lost_rank(&e, 2), "rank {rank}: {e}");
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
        assert!(names_lost_rank(&e, 1), "{e}");
        assert!(e.to_string().contains("left the job"), "{e}");
    }
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[test]
fn abort_and_panics_stop_every_rank_with_the_root_cause() {
    let worlds = connect(3, 5, Duration::from_secs(30));
    let errors = on_threads(3, |rank| {
        let comm = worlds[rank].communicator().unwrap();
        if rank == 0 {
            thread::sleep(Duration::from_millis(100));
            comm.abort("the data loader found a corrupt shard");
        }
        comm.barrier().unwrap_err()
    });
    for e in &errors {
        assert!(names_lost_rank(e, 0) && e.to_string().contains("corrupt shard"), "{e}");
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
    assert!(names_lost_rank(&results.1, 0) && results.1.to_string().contains("panicked"), "{}", results.1);
}

#[test]
fn a_stray_connection_is_refused_and_the_job_still_forms() {
    let (listeners, addrs) = bind_listeners(2);
    // Garbage first, on rank 0's port: a port scanner, or a process that is
    // not a Tessera rank.
    let mut stray = TcpStream::connect(addrs[0]).unwrap();
    std::io::Write::write_all(&mut stray, b"GET / HTTP/1.1\r\n\r\n").unwrap();
    let worlds = form(listeners, &addrs, 7, Duration::from_secs(10));
    on_threads(2, |r| worlds[r].communicator().unwrap().barrier().unwrap());
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
