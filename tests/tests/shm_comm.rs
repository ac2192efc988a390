//! Communicators through shared memory: generated programs of collectives
//! give every rank the in-process communicator's bits, with ranks as
//! threads and as real processes; mismatched calls, aborts, a rank that
//! leaves, hangs or is killed turn into errors that name it on every rank,
//! within the timeout; no segment outlives its job, and the files a killed
//! job left behind are removed by the next one.
//!
//! Processes are this test binary run again with `SHM_TEST_ROLE` set, which
//! makes [`rank_process`] play one rank of a job (started with the
//! launcher's variables, as `tessera launch` starts ranks).

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Barrier};
use std::thread;
use std::time::{Duration, Instant};
use tessera::dist::env::{Launcher, ProcessEnv};
use tessera::dist::mesh::Mesh;
use tessera::dist::process::{mesh_groups, ProcessWorld, Transport};
use tessera::dist::shm::ShmWorld;
use tessera::dist::store::Rendezvous;
use tessera::dist::Communicator;
use tessera::prelude::*;
use tessera::Error;
use tessera_comm_harness::{
    assert_in_process_bits, assert_mismatched_calls_are_errors, assert_same_results, execute, in_process, input, names_lost_rank, on_threads,
    start_in_opposite_orders, Call, Outcome, ProgramSpace,
};

const LONG: Duration = Duration::from_secs(30);

/// The variable that makes this binary play a rank (see [`rank_process`]).
const ROLE: &str = "SHM_TEST_ROLE";

/// A port nothing listens on now (the kernel's pick, released).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Rank `rank` of a job of `n` ranks, `per_node` to a node (as a launcher
/// numbers them), whose store rank 0 serves on `port`.
fn process_env(rank: usize, n: usize, per_node: usize, port: u16) -> ProcessEnv {
    ProcessEnv {
        rank,
        world_size: n,
        local_rank: rank % per_node,
        local_world_size: per_node,
        node_rank: rank / per_node,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        restart: 0,
        launcher: Launcher::Torchrun,
    }
}

/// Runs `f(rank, rendezvous)` for every rank of a job of `n` ranks, each a
/// thread that joined the job's rendezvous as a process would; results in
/// rank order. Every rank keeps its rendezvous (rank 0 serves the store)
/// until all are done.
fn job<R: Send>(n: usize, f: impl Fn(usize, &Rendezvous) -> R + Sync) -> Vec<R> {
    job_on_nodes(n, n, f)
}

/// [`job`] with the ranks on nodes of `per_node` ranks each (as two
/// launchers on one machine place them).
fn job_on_nodes<R: Send>(n: usize, per_node: usize, f: impl Fn(usize, &Rendezvous) -> R + Sync) -> Vec<R> {
    let port = free_port();
    let done = Barrier::new(n);
    on_threads(n, |r| {
        // A rank that fails still meets the others at the end, so the test
        // fails with its message instead of the others waiting forever. The
        // rendezvous (rank 0's serves the store) lives until every rank is
        // done: a rank that finishes first must not close the store on the
        // others still reading it.
        let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let rdzv = Rendezvous::join(&process_env(r, n, per_node, port), LONG).unwrap();
            (f(r, &rdzv), rdzv)
        }));
        done.wait();
        out.map(|(result, _rdzv)| result).unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

/// The programs here: one call in eight large, all-gathers synchronous.
const PROGRAMS: ProgramSpace =
    ProgramSpace { dtypes: &[DType::F32, DType::BF16, DType::F16, DType::F64, DType::I32], async_all_gather: false, large_calls: true };

/// A digest of what every call of a program gave a rank, which a rank
/// process prints for the test to compare.
fn digest(results: &[Vec<Outcome>]) -> u64 {
    let mut h = DefaultHasher::new();
    results.hash(&mut h);
    h.finish()
}

#[test]
fn generated_programs_give_the_in_process_bits_with_ranks_as_threads() {
    for (case, n) in [2usize, 3, 4, 2].into_iter().enumerate() {
        let seed = 0x5EED_0000 + case as u64;
        let prog = PROGRAMS.generate(seed, n, 32);
        let got = job(n, |r, rdzv| {
            let dev = Device::cpu();
            let world = ShmWorld::join(rdzv, &dev, LONG).unwrap();
            assert_eq!(world.local_ranks(), (0..n).collect::<Vec<_>>());
            execute(&world.communicator().unwrap(), &prog, r, n, &dev)
        });
        assert_in_process_bits(&prog, &got, &format!("case {case} (world {n})"));
    }
}

/// Sums depend on the order of the additions: every element must be the
/// rank-order sum, whichever member computed it and however many rounds the
/// tensor took.
#[test]
fn sums_are_the_in_process_bits_for_every_dtype_size_and_world() {
    let cases: Vec<(DType, usize)> = [DType::F32, DType::F64, DType::BF16].into_iter().flat_map(|d| [1, 17, 1000, 300_001].map(|l| (d, l))).collect();
    for n in [3, 4] {
        let prog: Vec<Call> = cases
            .iter()
            .flat_map(|&(dtype, len)| {
                [
                    Call::AllReduce { dims: vec![len], dtype, asynchronous: false },
                    Call::ReduceScatter { dims: vec![len.div_ceil(n) * n], dim: 0, dtype, asynchronous: true },
                ]
            })
            .collect();
        let got = job(n, |r, rdzv| {
            let dev = Device::cpu();
            let world = ShmWorld::join(rdzv, &dev, LONG).unwrap();
            execute(&world.communicator().unwrap(), &prog, r, n, &dev)
        });
        assert_in_process_bits(&prog, &got, &format!("world {n}"));
    }
}

/// A copy of `x` in a vector of the process's heap, outside any arena.
fn on_heap(x: &Tensor) -> Tensor {
    tessera::tensor::with_elem!(x.dtype(), T => Tensor::from_vec(x.to_vec::<T>().unwrap(), x.shape().clone(), x.device()).unwrap())
}

/// Large tensors a rank's device allocates live in its shared-memory arena,
/// and the all-reduce, all-gather and reduce-scatter work on them in place;
/// a tensor outside the arena on any rank (built from a `Vec`) makes the
/// whole group stage instead. Every mix gives the exact results, in every
/// float dtype, for lengths on both sides of the arena's threshold, of one
/// round and of several.
#[test]
fn collectives_in_place_and_staged_mix_on_any_rank_with_exact_results() {
    // Small integers: every partial sum is exact in every dtype, whatever the order.
    let value = |r: usize, j: usize| ((j * 7 + r * 3) % 16) as f64;
    let cases: [(usize, DType); 7] = [
        (16_383, DType::F32),
        (16_384, DType::F32),
        (300_001, DType::F32),
        (1 << 20, DType::F32),
        (300_001, DType::BF16),
        (40_000, DType::F16),
        (300_001, DType::F64),
    ];
    for n in [2usize, 3, 4] {
        let got = job(n, |r, rdzv| {
            let dev = Device::cpu();
            let world = ShmWorld::join(rdzv, &dev, LONG).unwrap();
            let comm = world.communicator().unwrap();
            let mut results = Vec::new();
            let mut done = 0;
            for (case, &(len, dtype)) in cases.iter().enumerate() {
                let len = len.div_ceil(n) * n;
                let v: Vec<f64> = (0..len).map(|j| value(r, j)).collect();
                let x = Tensor::from_slice(&v, [len], &dev).unwrap().to_dtype(dtype).unwrap();
                // Outside the arena: nowhere, on one rank (which one turns
                // with the case), or everywhere.
                for heap_on in [None, Some(case % n), Some(usize::MAX)] {
                    let x = if heap_on == Some(r) || heap_on == Some(usize::MAX) { on_heap(&x) } else { x.clone() };
                    let sum = comm.all_reduce_sum(&x).unwrap().to_f64_vec().unwrap();
                    let gathered = comm.all_gather(&x, 0).unwrap().to_f64_vec().unwrap();
                    let part = comm.reduce_scatter_sum(&x, 0).unwrap().to_f64_vec().unwrap();
                    results.push((len, dtype, heap_on, [sum, gathered, part]));
                    // In place exactly when every rank's input lies in its
                    // arena (large enough, and not built from a `Vec`).
                    let in_arena = heap_on.is_none() && len * dtype.size_in_bytes() >= 64 << 10;
                    assert_eq!(comm.in_place_collectives() - done, if in_arena { 3 } else { 0 }, "world {n}, rank {r}: {len} {dtype}, heap on {heap_on:?}");
                    done = comm.in_place_collectives();
                }
            }
            results
        });
        for (r, results) in got.iter().enumerate() {
            for (len, dtype, heap_on, [sum, gathered, part]) in results {
                let what = format!("world {n}, rank {r}: {len} {dtype}, heap on {heap_on:?}");
                let total = |j: usize| (0..n).map(|q| value(q, j)).sum::<f64>();
                assert_eq!((0..*len).find(|&j| sum[j] != total(j)), None, "all-reduce, {what}");
                assert_eq!((0..n * len).find(|&g| gathered[g] != value(g / len, g % len)), None, "all-gather, {what}");
                let share = len / n;
                assert_eq!((0..share).find(|&j| part[j] != total(r * share + j)), None, "reduce-scatter, {what}");
            }
        }
    }
}

/// Within one node, a process world gives every group of a mesh shared
/// memory; `tcp` keeps them all on TCP; groups with the same members stay
/// independent either way.
#[test]
fn a_process_world_chooses_shared_memory_for_groups_within_the_node() {
    for transport in [Transport::Auto, Transport::Shm, Transport::Tcp] {
        let kinds = job(4, |r, rdzv| {
            let dev = Device::cpu();
            let world = ProcessWorld::join_with(rdzv, &dev, LONG, transport).unwrap();
            assert_eq!(world.transport(), transport);
            let a = world.tagged_group("a", &[0, 1, 2, 3]).unwrap();
            let b = world.tagged_group("b", &[0, 1, 2, 3]).unwrap();
            let x = Tensor::from_vec(vec![r as f32; 4], [4], &dev).unwrap();
            let (pa, pb) = start_in_opposite_orders(&a, &b, &x, r);
            assert_eq!(pa.wait().unwrap().to_vec::<f32>().unwrap(), vec![6.0; 4]);
            assert_eq!(pb.wait().unwrap().dims(), &[16]);
            assert!(world.tagged_group("a", &[0, 1, 2, 3]).is_err(), "a second communicator for the same group");
            let mesh = Mesh::parse("dp2,tp2", 4, 4).unwrap();
            let groups = mesh_groups(&world, &mesh).unwrap();
            let y = groups.tp.all_reduce_sum(&x).unwrap().to_vec::<f32>().unwrap();
            assert_eq!(y, vec![(r / 2 * 4 + 1) as f32; 4]);
            (a.transport(), b.transport())
        });
        let want = if transport == Transport::Tcp { Transport::Tcp } else { Transport::Shm };
        assert!(kinds.iter().all(|&(a, b)| a == want && b == want), "{transport}: {kinds:?}");
    }
}

/// With two ranks to a node, a mesh's tensor-parallel groups (within a
/// node) get shared memory and the data-parallel ones (across) TCP; both
/// give the in-process bits, and a failure seen by either transport stops
/// the waits of the other.
#[test]
fn groups_within_a_node_use_shared_memory_and_the_others_tcp() {
    let prog = PROGRAMS.generate(0xAB, 2, 16);
    let want = in_process(&prog, 2);
    let kinds = job_on_nodes(4, 2, |r, rdzv| {
        let dev = Device::cpu();
        let world = ProcessWorld::join_with(rdzv, &dev, LONG, Transport::Auto).unwrap();
        assert_eq!((world.is_local(r ^ 1), world.is_local(r ^ 2)), (true, false));
        let groups = mesh_groups(&world, &Mesh::parse("dp2,tp2", 4, 2).unwrap()).unwrap();
        let (tp, dp) = (&groups.tp, &groups.dp);
        assert_same_results(&prog, &execute(tp.as_ref(), &prog, r % 2, 2, &dev), &want[r % 2], &format!("rank {r}: the shared-memory group"));
        assert_same_results(&prog, &execute(dp.as_ref(), &prog, r / 2, 2, &dev), &want[r / 2], &format!("rank {r}: the TCP group"));
        let all = world.communicator().unwrap();
        let e = world.tagged_group("forced", &[r % 2, r % 2 + 2]).map(drop);
        // An abort through shared memory on node 1 reaches node 0's ranks
        // waiting over TCP, and node 0's ranks waiting in shared memory.
        all.barrier().unwrap();
        if r == 3 {
            thread::sleep(Duration::from_millis(100));
            tp.abort("a rank of node 1 gave up");
        }
        let stopped = if r % 2 == 0 { all.barrier().unwrap_err() } else { tp.barrier().unwrap_err() };
        assert!(names_rank(&stopped, 3) && stopped.to_string().contains("gave up"), "rank {r}: {stopped}");
        (all.transport(), e.is_ok())
    });
    assert!(kinds.iter().all(|&(t, ok)| t == Transport::Tcp && ok), "{kinds:?}");
    // Forcing shared memory refuses a group that spans the nodes.
    let refused =
        job_on_nodes(4, 2, |_, rdzv| ProcessWorld::join_with(rdzv, &Device::cpu(), LONG, Transport::Shm).unwrap().communicator().map(drop).unwrap_err());
    for e in refused {
        assert!(e.to_string().contains("another node") && e.to_string().contains("auto"), "{e}");
    }
}

#[test]
fn the_transport_variable_is_parsed_with_a_clear_error() {
    assert_eq!(Transport::parse("SHM").unwrap(), Transport::Shm);
    assert_eq!(Transport::parse("tcp").unwrap(), Transport::Tcp);
    assert_eq!(Transport::parse("auto").unwrap(), Transport::Auto);
    let e = Transport::parse("infiniband").unwrap_err();
    assert!(e.to_string().contains("TESSERA_TRANSPORT") && e.to_string().contains("tcp, shm"), "{e}");
}

#[test]
fn mismatched_calls_are_errors_on_every_rank_and_the_group_stays_usable() {
    let start = Instant::now();
    job(3, |rank, rdzv| {
        let dev = Device::cpu();
        let world = ShmWorld::join(rdzv, &dev, LONG).unwrap();
        let comm = world.communicator().unwrap();
        assert_mismatched_calls_are_errors(&comm, rank, 3, &dev);
        let x = input(rank, 0, &[6, 4], DType::F32, &dev);
        assert!(comm.send(&x, rank).is_err() && comm.recv(7).is_err(), "no message to oneself or to a rank outside the group");
    });
    assert!(start.elapsed() < Duration::from_secs(10));
}

/// Whether `e` names the lost rank `lost`: as [`names_lost_rank`], or in a
/// timeout's list of the ranks that did not arrive (`[2]`), as the
/// shared-memory waits name them.
fn names_rank(e: &Error, lost: usize) -> bool {
    names_lost_rank(e, lost) || matches!(e, Error::Timeout { detail, .. } if detail.contains(&format!("[{lost}]")))
}

#[test]
fn a_rank_that_never_calls_is_named_by_every_rank_within_the_timeout() {
    let timeout = Duration::from_millis(1500);
    let start = Instant::now();
    let errors = job(4, |rank, rdzv| {
        let dev = Device::cpu();
        let world = ShmWorld::join(rdzv, &dev, timeout).unwrap();
        let comm = world.communicator().unwrap();
        comm.barrier().unwrap();
        let t0 = Instant::now();
        if rank == 2 {
            // Stays alive but never joins the call.
            thread::sleep(timeout * 3);
            return None;
        }
        let x = input(rank, 0, &[100], DType::F32, &dev);
        let e = comm.all_reduce_sum(&x).unwrap_err();
        Some((e, t0.elapsed()))
    });
    for (rank, got) in errors.into_iter().enumerate() {
        let Some((e, at)) = got else { continue };
        assert!(names_rank(&e, 2), "rank {rank}: {e}");
        assert!(at < timeout * 2 + Duration::from_millis(500), "rank {rank} stopped after {at:?}");
    }
    assert!(start.elapsed() < Duration::from_secs(15));
}

#[test]
fn abort_leaving_and_silence_stop_the_ranks_that_wait() {
    // An abort reaches every rank with its reason.
    let errors = job(3, |rank, rdzv| {
        let world = ShmWorld::join(rdzv, &Device::cpu(), LONG).unwrap();
        let comm = world.communicator().unwrap();
        comm.barrier().unwrap();
        if rank == 0 {
            thread::sleep(Duration::from_millis(100));
            comm.abort("the data loader found a corrupt shard");
        }
        let e = comm.barrier().unwrap_err();
        assert!(world.check().is_err() && comm.failure().is_some());
        e
    });
    for e in &errors {
        assert!(names_rank(e, 0) && e.to_string().contains("corrupt shard"), "{e}");
    }
    // A rank that drops its communicator leaves the group: the others'
    // waits for it fail, while messages it sent before leaving still arrive.
    let start = Instant::now();
    let results = job(3, |rank, rdzv| {
        let dev = Device::cpu();
        let world = ShmWorld::join(rdzv, &dev, LONG).unwrap();
        let comm = world.communicator().unwrap();
        comm.barrier().unwrap();
        if rank == 1 {
            comm.send(&Tensor::from_vec(vec![7i32; 3], [3], &dev).unwrap(), 0).unwrap();
            thread::sleep(Duration::from_millis(200));
            drop(comm);
            return None;
        }
        let e = comm.barrier().unwrap_err();
        let got = if rank == 0 { Some(comm.recv(1).unwrap().to_vec::<i32>().unwrap()) } else { None };
        let again = comm.recv(1).unwrap_err();
        Some((e, got, again))
    });
    for (rank, r) in results.into_iter().enumerate() {
        let Some((e, got, again)) = r else { continue };
        assert!(names_rank(&e, 1) && e.to_string().contains("left"), "rank {rank}: {e}");
        assert!(names_rank(&again, 1), "rank {rank}: {again}");
        if rank == 0 {
            assert_eq!(got, Some(vec![7; 3]), "a message sent before leaving is still delivered");
        }
    }
    assert!(start.elapsed() < Duration::from_secs(5));
    // A silent sender is named by its receiver after the timeout.
    let timeout = Duration::from_millis(800);
    let errors = job(2, |rank, rdzv| {
        let world = ShmWorld::join(rdzv, &Device::cpu(), timeout).unwrap();
        let comm = world.communicator().unwrap();
        comm.barrier().unwrap();
        if rank == 0 {
            thread::sleep(timeout * 2);
            return None;
        }
        Some(comm.recv(0).unwrap_err())
    });
    assert!(names_rank(errors[1].as_ref().unwrap(), 0), "{:?}", errors[1]);
}

#[test]
fn messages_are_buffered_in_order_whatever_their_size() {
    let sizes = [1usize, 3, 700_000, 5, 300_000, 2, 1 << 20, 9];
    job(2, |rank, rdzv| {
        let dev = Device::cpu();
        let world = ShmWorld::join(rdzv, &dev, LONG).unwrap();
        let comm = world.communicator().unwrap();
        let peer = 1 - rank;
        // Both send everything before receiving anything: sends never wait
        // for the receiver, however large (the ring overflows into files).
        let sent: Vec<Tensor> = sizes.iter().enumerate().map(|(i, &n)| input(rank, i, &[n], if i % 2 == 0 { DType::BF16 } else { DType::F32 }, &dev)).collect();
        for t in &sent {
            comm.send(t, peer).unwrap();
        }
        for (i, &n) in sizes.iter().enumerate() {
            let got = comm.recv(peer).unwrap();
            let want = input(peer, i, &[n], if i % 2 == 0 { DType::BF16 } else { DType::F32 }, &dev);
            assert_eq!((got.dims(), got.dtype()), (want.dims(), want.dtype()));
            assert!(Outcome::of(&got) == Outcome::of(&want), "message {i} of {n} elements");
        }
    });
}

// ---------------------------------------------------------------------------
// Ranks as processes.

/// A directory of its own for one test's segments, under the shared-memory
/// directory; removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let d = Path::new("/dev/shm").join(format!("shm-test-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Scratch(d)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The rank processes of a job; those still running when it is dropped (a
/// failed test) are killed.
struct Ranks(Vec<Child>);

impl Drop for Ranks {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Ranks {
    /// Waits for every rank to exit, which must be successfully.
    fn finish(mut self) {
        for (r, c) in self.0.iter_mut().enumerate() {
            let status = c.wait().unwrap();
            assert!(status.success(), "rank process {r} failed: {status:?}");
        }
    }
}

fn files_in(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

/// A rank process of a job of `n`: this binary running [`rank_process`]
/// as `role`, with the launcher's variables and its segments in `dir`.
fn spawn_rank(rank: usize, n: usize, port: u16, role: &str, dir: &Path) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["rank_process", "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", n.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("LOCAL_WORLD_SIZE", n.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("TESSERA_SHM_DIR", dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

/// What starts a report of a rank process on its standard output.
const MARK: &str = "@shm-test@ ";

/// The reports each rank prints, as they come.
fn reports(ranks: &mut Ranks) -> mpsc::Receiver<(usize, String, Instant)> {
    let (tx, rx) = mpsc::channel();
    for (rank, c) in ranks.0.iter_mut().enumerate() {
        let out = BufReader::new(c.stdout.take().unwrap());
        let tx = tx.clone();
        thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                // The harness may print its own words before ours on a line.
                if let Some((_, l)) = line.split_once(MARK) {
                    let _ = tx.send((rank, l.to_string(), Instant::now()));
                }
            }
        });
    }
    rx
}

/// Waits for one report from each of `ranks` (and returns them by rank).
fn expect(rx: &mpsc::Receiver<(usize, String, Instant)>, ranks: &[usize], within: Duration) -> Vec<(usize, String, Instant)> {
    let deadline = Instant::now() + within;
    let mut got = Vec::new();
    while got.len() < ranks.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        let (r, l, at) = rx.recv_timeout(left).unwrap_or_else(|_| panic!("no report from ranks {ranks:?} within {within:?}; got {got:?}"));
        assert!(ranks.contains(&r), "unexpected report from rank {r}: {l}");
        got.push((r, l, at));
    }
    got.sort_by_key(|g| g.0);
    got
}

/// One rank of a job of processes, when this binary is run with
/// `SHM_TEST_ROLE` (by the tests below); nothing otherwise. Reports go to
/// standard output after [`MARK`].
#[test]
fn rank_process() {
    let Ok(role) = std::env::var(ROLE) else { return };
    let env = ProcessEnv::detect().unwrap().expect("started with the launcher's variables");
    let (rank, n) = (env.rank, env.world_size);
    let rdzv = Rendezvous::join(&env, LONG).unwrap();
    let dev = Device::cpu();
    let mut words = role.split(':');
    match words.next().unwrap() {
        // A generated program through a process world forced to shared memory.
        "program" => {
            let seed: u64 = words.next().unwrap().parse().unwrap();
            let calls: usize = words.next().unwrap().parse().unwrap();
            let world = ProcessWorld::join_with(&rdzv, &dev, LONG, Transport::Shm).unwrap();
            let comm = world.communicator().unwrap();
            assert_eq!(comm.transport(), Transport::Shm);
            let out = execute(&comm, &PROGRAMS.generate(seed, n, calls), rank, n, &dev);
            println!("{MARK}{}", digest(&out));
            comm.barrier().unwrap();
        }
        // Waits in an all-reduce that rank 1 never joins; the test kills
        // rank 1. Shared memory alone (no TCP connection to notice the
        // death), with a timeout far longer than the test waits.
        "killed" => {
            let world = ShmWorld::join(&rdzv, &dev, Duration::from_secs(60)).unwrap();
            let comm = world.communicator().unwrap();
            comm.barrier().unwrap();
            println!("{MARK}ready");
            if rank == 1 {
                thread::sleep(Duration::from_secs(60));
                unreachable!("the test kills this rank");
            }
            let e = comm.all_reduce_sum(&Tensor::from_vec(vec![1.0f32; 1000], [1000], &dev).unwrap()).unwrap_err();
            println!("{MARK}{e}");
            assert!(names_rank(&e, 1), "{e}");
        }
        // Leaves files behind when killed: rank 0 makes a group that rank 1
        // never joins, and sends it a message too large for the ring.
        "litter" => {
            let world = ShmWorld::join(&rdzv, &dev, LONG).unwrap();
            world.communicator().unwrap().barrier().unwrap();
            if rank == 0 {
                let pair = world.tagged_group("pair", &[0, 1]).unwrap();
                pair.send(&Tensor::zeros([1 << 20], DType::F32, &dev).unwrap(), 1).unwrap();
            }
            println!("{MARK}ready");
            thread::sleep(Duration::from_secs(60));
            unreachable!("the test kills this rank");
        }
        other => panic!("unknown role {other}"),
    }
}

#[test]
fn generated_programs_give_the_in_process_bits_with_ranks_as_processes() {
    let scratch = Scratch::new("program");
    let dir = &scratch.0;
    for (case, n) in [(0u64, 3usize), (1, 2)] {
        let seed = 0xC0FFEE + case;
        let prog = PROGRAMS.generate(seed, n, 24);
        let want: Vec<u64> = in_process(&prog, n).iter().map(|out| digest(out)).collect();
        let port = free_port();
        let mut ranks = Ranks((0..n).map(|r| spawn_rank(r, n, port, &format!("program:{seed}:24"), dir)).collect());
        let rx = reports(&mut ranks);
        let got = expect(&rx, &(0..n).collect::<Vec<_>>(), Duration::from_secs(120));
        ranks.finish();
        for (r, line, _) in got {
            assert_eq!(line, want[r].to_string(), "case {case}: rank {r}'s results differ from the in-process run's");
        }
        assert_eq!(files_in(dir), Vec::<String>::new(), "a finished job leaves no segment behind");
    }
}

#[test]
fn a_killed_peer_process_is_named_by_every_waiting_rank_within_two_seconds() {
    let scratch = Scratch::new("killed");
    let dir = &scratch.0;
    let n = 3;
    let port = free_port();
    let mut ranks = Ranks((0..n).map(|r| spawn_rank(r, n, port, "killed", dir)).collect());
    let rx = reports(&mut ranks);
    expect(&rx, &[0, 1, 2], Duration::from_secs(60));
    // Let ranks 0 and 2 fall asleep in the all-reduce.
    thread::sleep(Duration::from_millis(300));
    let killed = Instant::now();
    ranks.0[1].kill().unwrap();
    let got = expect(&rx, &[0, 2], Duration::from_secs(10));
    for (r, line, at) in &got {
        assert!(line.contains("rank 1") || line.contains("PeerFailed"), "rank {r}: {line}");
        assert!(line.contains("killed") || line.contains("exited"), "rank {r} says why: {line}");
        assert!(*at - killed < Duration::from_secs(2), "rank {r} noticed after {:?}", *at - killed);
    }
    let _ = ranks.0[1].wait();
    let killed = ranks.0.remove(1);
    ranks.finish();
    drop(killed);
    assert_eq!(files_in(dir), Vec::<String>::new(), "no segment outlives its job, even one with a killed rank");
}

#[test]
fn the_next_job_removes_what_a_killed_job_left_behind() {
    let scratch = Scratch::new("litter");
    let dir = &scratch.0;
    let port = free_port();
    let mut ranks = Ranks((0..2).map(|r| spawn_rank(r, 2, port, "litter", dir)).collect());
    let rx = reports(&mut ranks);
    expect(&rx, &[0, 1], Duration::from_secs(60));
    drop(ranks);
    let left = files_in(dir);
    assert!(left.iter().any(|f| f.contains("-g")) && left.iter().any(|f| f.contains("-m")), "the killed job left a group and a message: {left:?}");
    // The next job on the node removes them when it starts, and leaves
    // nothing of its own.
    let port = free_port();
    let mut ranks = Ranks((0..2).map(|r| spawn_rank(r, 2, port, "program:7:4", dir)).collect());
    let rx = reports(&mut ranks);
    expect(&rx, &[0, 1], Duration::from_secs(60));
    ranks.finish();
    assert_eq!(files_in(dir), Vec::<String>::new(), "the dead job's files are gone and the new job's too");
}
