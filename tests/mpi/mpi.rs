//! The MPI communicators (`tessera_dist::mpi`) against the in-process ones.
//!
//! Run by `cargo test -p tessera-mpi-tests --features mpi`, this program is
//! the driver: it starts itself as the ranks of MPI jobs with
//! `mpirun --oversubscribe -np N` and judges how each ends. Started by
//! `mpirun` (the launcher's variables are set), it is one rank, and its first
//! argument says what to do:
//!
//! - `suite`: every case below, in order, on every rank. Each rank computes
//!   the in-process communicator's result of the same calls itself (its own
//!   threads are the ranks of an in-process world) and compares: bit for bit
//!   with the exact reduction and for everything that only moves data, within
//!   the documented bound with MPI's native sums. Run on 4 ranks and on 3
//!   (chunks of unequal length).
//!   The last case profiles the job for the planner (`tessera profile
//!   --comm mpi`): MPI's all-reduce fitted inside a "node" and between them.
//! - `abort`, `kill`, `hang`, `panic`: one rank aborts, is killed, hangs past
//!   the timeout, or panics while the others wait in a collective; the driver
//!   checks that the whole job ends, soon, with a failure status and a message
//!   that names the cause.
//!
//! Without `mpirun` on the `PATH` the driver reports the test as skipped
//! (`TESSERA_SKIP_LOG`, as the GPU tests do) instead of passing it.

use std::io::{Read, Write};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};
use std::thread;
use std::time::{Duration, Instant};
use tessera_comm_harness::{
    assert_same_bits, execute, in_process, in_process_of_magnitudes, input, on_threads, start_in_opposite_orders, Call, Outcome, ProgramSpace,
};
use tessera_core::{DType, Device, Error, Init, RngKey, Tensor};
use tessera_dist::inproc::{self, InProcess};
use tessera_dist::mesh::Mesh;
use tessera_dist::mpi::{self, MpiOptions, MpiWorld, Reduction};
use tessera_dist::Communicator;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if launched_by_mpi() {
        return rank_main(args.first().map_or("suite", String::as_str));
    }
    driver()
}

/// Whether an MPI launcher started this process (Open MPI, or Hydra's PMI).
fn launched_by_mpi() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"].iter().any(|v| std::env::var_os(v).is_some())
}

// ---------------------------------------------------------------------------
// The driver
// ---------------------------------------------------------------------------

/// How a job is expected to end.
enum Expect {
    /// Status 0; rank 0 prints `ok: CASE` per case passed.
    Pass,
    /// A failure status within `within`, with every one of `says` in the
    /// output.
    Fail { within: Duration, says: &'static [&'static str] },
}

struct Job {
    name: &'static str,
    ranks: usize,
    scenario: &'static str,
    expect: Expect,
}

fn driver() -> ExitCode {
    let started = Instant::now();
    let Some(mpirun) = find_on_path("mpirun") else {
        report_skip("mpi", "no `mpirun` on the PATH: install Open MPI (openmpi-bin) or MPICH to run the MPI communicator tests");
        // Counted as passed by the harness line below and as skipped by CI,
        // which subtracts the skip log (as for the GPU tests).
        println!("test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.00s");
        return ExitCode::SUCCESS;
    };
    let exe = std::env::current_exe().expect("the test binary's path");
    let jobs = [
        Job { name: "np4", ranks: 4, scenario: "suite", expect: Expect::Pass },
        Job { name: "np3", ranks: 3, scenario: "suite", expect: Expect::Pass },
        Job {
            name: "abort_ends_every_rank",
            ranks: 3,
            scenario: "abort",
            expect: Expect::Fail { within: Duration::from_secs(30), says: &["rank 0 aborts the MPI job: aborted: the data loader found a corrupt shard"] },
        },
        Job { name: "a_killed_rank_ends_the_job", ranks: 3, scenario: "kill", expect: Expect::Fail { within: Duration::from_secs(30), says: &["rank 1"] } },
        Job {
            name: "a_hung_rank_is_aborted_after_the_timeout",
            ranks: 3,
            scenario: "hang",
            expect: Expect::Fail { within: Duration::from_secs(20), says: &["past the timeout", "all_reduce_sum"] },
        },
        Job {
            name: "a_panic_ends_the_job_with_its_message",
            ranks: 2,
            scenario: "panic",
            expect: Expect::Fail { within: Duration::from_secs(30), says: &["a bug on rank 0", "panicked"] },
        },
    ];
    let (mut passed, mut failed) = (0, 0);
    for job in &jobs {
        let t0 = Instant::now();
        let (status, output) = run_job(&mpirun, &exe, job);
        let took = t0.elapsed();
        match &job.expect {
            Expect::Pass => {
                let cases: Vec<&str> = output.lines().filter_map(|l| l.strip_prefix("ok: ")).collect();
                for c in &cases {
                    println!("test {}::{c} ... ok", job.name);
                }
                passed += cases.len();
                if status != Some(0) || cases.len() != CASES.len() {
                    println!("test {}::suite ... FAILED ({} of {} cases passed, exit status {status:?}, {took:.1?})", job.name, cases.len(), CASES.len());
                    println!("---- {} output ----\n{output}", job.name);
                    failed += 1;
                }
            }
            Expect::Fail { within, says } => {
                let missing: Vec<&&str> = says.iter().filter(|s| !output.contains(**s)).collect();
                if status.is_some_and(|s| s != 0) && took <= *within && missing.is_empty() {
                    println!("test {} ... ok ({took:.1?})", job.name);
                    passed += 1;
                } else {
                    println!("test {} ... FAILED: exit status {status:?} after {took:.1?} (expected a failure within {within:?}); missing from the output: {missing:?}", job.name);
                    println!("---- {} output ----\n{output}", job.name);
                    failed += 1;
                }
            }
        }
    }
    let verdict = if failed == 0 { "ok" } else { "FAILED" };
    println!(
        "\ntest result: {verdict}. {passed} passed; {failed} failed; 0 ignored; 0 measured; 0 filtered out; finished in {:.2}s",
        started.elapsed().as_secs_f64()
    );
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Runs `job` under `mpirun`; returns its exit status (`None`: killed by a
/// signal, or by the driver after five minutes) and everything it printed.
fn run_job(mpirun: &PathBuf, exe: &PathBuf, job: &Job) -> (Option<i32>, String) {
    let np = job.ranks.to_string();
    let args = ["--oversubscribe", "-np", np.as_str()];
    println!("running: mpirun {} {} {}", args.join(" "), exe.display(), job.scenario);
    let mut child = Command::new(mpirun)
        .args(args)
        .arg(exe)
        .arg(job.scenario)
        // Open MPI refuses to start as root without both; harmless otherwise.
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mpirun starts");
    let mut out = child.stdout.take().expect("piped");
    let mut err = child.stderr.take().expect("piped");
    let reader = thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err_reader = thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + Duration::from_secs(300);
    let status = loop {
        if let Some(s) = child.try_wait().expect("waiting for mpirun") {
            break s.code();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        thread::sleep(Duration::from_millis(50));
    };
    let output = reader.join().unwrap_or_default() + &err_reader.join().unwrap_or_default();
    (status, output)
}

fn find_on_path(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?).map(|d| d.join(name)).find(|p| p.is_file())
}

/// `skipped: REASON (TEST)` on stderr and in `$TESSERA_SKIP_LOG`.
fn report_skip(test: &str, reason: &str) {
    let line = format!("skipped: {reason} ({test})\n");
    let _ = std::io::stderr().write_all(line.as_bytes());
    if let Some(path) = std::env::var_os("TESSERA_SKIP_LOG") {
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
            let _ = f.write_all(line.as_bytes());
        }
    }
}

// ---------------------------------------------------------------------------
// A rank
// ---------------------------------------------------------------------------

fn rank_main(scenario: &str) -> ExitCode {
    let dev = Device::cpu();
    let timeout = if scenario == "hang" { Duration::from_secs(2) } else { Duration::from_secs(300) };
    let world = MpiWorld::init_with(&dev, MpiOptions { timeout: Some(timeout), ..MpiOptions::default() }).expect("MPI starts");
    let rank = world.rank();
    let x = Tensor::from_vec(vec![1.0f32; 1000], [1000], &dev).unwrap();
    match scenario {
        "suite" => return suite(&world),
        "abort" => {
            let comm = world.communicator().unwrap();
            if rank == 0 {
                thread::sleep(Duration::from_millis(300));
                comm.abort("the data loader found a corrupt shard");
            }
            let _ = comm.barrier();
        }
        "kill" => {
            let comm = world.communicator().unwrap();
            comm.barrier().unwrap();
            if rank == 1 {
                thread::sleep(Duration::from_millis(300));
                // SAFETY: sends this process SIGKILL, as a lost node would.
                unsafe { libc::raise(libc::SIGKILL) };
            }
            let _ = comm.all_reduce_sum(&x);
        }
        "hang" => {
            let comm = world.communicator().unwrap();
            comm.barrier().unwrap();
            if rank == 2 {
                // Alive, its connections open, but never joins the call.
                thread::sleep(Duration::from_secs(30));
            }
            let _ = comm.all_reduce_sum(&x);
        }
        "panic" => {
            let comm = world.communicator().unwrap();
            comm.barrier().unwrap();
            if rank == 0 {
                thread::sleep(Duration::from_millis(300));
                panic!("a bug on rank 0");
            }
            let _ = comm.barrier();
        }
        other => panic!("unknown scenario `{other}`"),
    }
    // Reaching this means the failure did not end the job.
    println!("rank {rank}: the job went on after the failure");
    ExitCode::FAILURE
}

/// What every case gets.
struct Ctx<'a> {
    world: &'a MpiWorld,
    n: usize,
    rank: usize,
    dev: Device,
}

type Case = (&'static str, fn(&Ctx));

const CASES: &[Case] = &[
    ("generated_programs_give_the_in_process_bits_with_exact_sums", generated_exact),
    ("generated_programs_with_native_sums_stay_within_the_bound_and_agree_across_ranks", generated_native),
    ("without_verification_results_are_the_same", generated_unverified),
    ("async_calls_run_in_program_order_and_groups_stay_independent", async_order),
    ("mesh_groups_give_the_in_process_mesh_results", mesh),
    ("messages_are_buffered_ordered_per_pair_and_keep_shape_and_dtype", send_recv),
    ("uneven_all_to_all_carries_shapes_and_dtypes", uneven_all_to_all),
    ("mismatched_calls_are_errors_on_every_rank_and_the_group_stays_usable", mismatches),
    ("large_tensors_give_the_in_process_bits", large),
    ("options_are_read_from_the_environment_and_bad_values_named", options),
    ("a_profile_of_the_job_fits_mpi_inside_and_between_nodes", profile),
];

fn suite(world: &MpiWorld) -> ExitCode {
    let ctx = Ctx { world, n: world.world_size(), rank: world.rank(), dev: Device::cpu() };
    let control = world.tagged_group("control", &(0..ctx.n).collect::<Vec<_>>()).unwrap();
    for (name, case) in CASES {
        if let Err(p) = catch_unwind(AssertUnwindSafe(|| case(&ctx))) {
            let msg = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
            world.abort(&format!("case {name} failed on rank {}: {msg}", ctx.rank));
        }
        control.barrier().unwrap();
        if ctx.rank == 0 {
            println!("ok: {name}");
        }
    }
    ExitCode::SUCCESS
}

/// The programs here: every dtype, all-gathers asynchronous too.
const PROGRAMS: ProgramSpace =
    ProgramSpace { dtypes: &[DType::F32, DType::BF16, DType::F16, DType::F64, DType::I32, DType::U32], async_all_gather: true, large_calls: false };

fn all_ranks(n: usize) -> Vec<usize> {
    (0..n).collect()
}

/// Runs generated programs on a communicator of `world` and checks each
/// call against the in-process result: bit for bit, or (for sums, when
/// `exact` is off) within the documented bound.
fn check_programs(cx: &Ctx, world: &MpiWorld, tag: &str, exact: bool) {
    let n = cx.n;
    for case in 0..3u64 {
        let seed = 0x9E37_79B9 + case * 101 + n as u64;
        let prog = PROGRAMS.generate(seed, n, 40);
        let comm = world.tagged_group(&format!("{tag}-{case}"), &all_ranks(n)).unwrap();
        let have = execute(&comm, &prog, cx.rank, n, &cx.dev);
        let want = in_process(&prog, n).swap_remove(cx.rank);
        let abs = (!exact).then(|| in_process_of_magnitudes(&prog, n).swap_remove(cx.rank));
        for (i, call) in prog.iter().enumerate() {
            let at = format!("program {case}, rank {}, call {i}: {call:?}", cx.rank);
            if exact || !call.sums() {
                assert_same_bits(&have[i], &want[i], &at);
                continue;
            }
            let (a, b, s) = (&have[i][0], &want[i][0], &abs.as_ref().expect("native")[i][0]);
            assert_eq!((&a.dims, a.dtype), (&b.dims, b.dtype), "{at}");
            within_bound(a, b, s, n, &at);
        }
        // The native sums must also be the same bits on every rank, or data
        // replicas would drift apart.
        if !exact {
            agree_across_ranks(cx, &prog, &have, &format!("{tag}-{case}"));
        }
    }
}

/// `|a − b| ≤ 2(n−1)·u·Σ|x| + one unit in the last place of a half-precision
/// result`, elementwise; integers exactly.
fn within_bound(a: &Outcome, b: &Outcome, sum_abs: &Outcome, n: usize, at: &str) {
    let (u, last_place) = match a.dtype {
        DType::I32 | DType::U32 => {
            assert_eq!(a.values(), b.values(), "{at}: integer sums are exact");
            return;
        }
        DType::F64 => (2f64.powi(-53), 0.0),
        DType::F32 => (2f64.powi(-24), 0.0),
        DType::BF16 => (2f64.powi(-24), 2f64.powi(-7)),
        DType::F16 => (2f64.powi(-24), 2f64.powi(-10)),
    };
    for (k, ((x, y), s)) in a.values().iter().zip(&b.values()).zip(&sum_abs.values()).enumerate() {
        // A little slack for Σ|x| itself being rounded to the dtype.
        let bound = 2.0 * (n - 1) as f64 * u * s * 1.01 + last_place * x.abs().max(y.abs());
        assert!((x - y).abs() <= bound, "{at}: element {k} is {x} natively but {y} in process, beyond the bound {bound} (Σ|x| = {s})");
    }
}

/// Every rank got the same bits from every all-reduce of a program.
fn agree_across_ranks(cx: &Ctx, program: &[Call], results: &[Vec<Outcome>], tag: &str) {
    let mine: Vec<u32> = program
        .iter()
        .zip(results)
        .filter(|(c, _)| matches!(c, Call::AllReduce { .. }))
        .flat_map(|(_, r)| &r[0].bits)
        .flat_map(|&b| [b as u32, (b >> 32) as u32])
        .collect();
    let len = mine.len();
    let comm = cx.world.with_reduction(Reduction::Exact).tagged_group(&format!("{tag}-agree"), &all_ranks(cx.n)).unwrap();
    let all = comm.all_gather(&Tensor::from_vec(mine.clone(), [len], &cx.dev).unwrap(), 0).unwrap().to_vec::<u32>().unwrap();
    for q in 0..cx.n {
        assert!(all[q * len..(q + 1) * len] == mine[..], "rank {q}'s native all-reduce results differ from rank {}'s", cx.rank);
    }
}

fn generated_exact(cx: &Ctx) {
    check_programs(cx, &cx.world.with_reduction(Reduction::Exact), "exact", true);
}

fn generated_native(cx: &Ctx) {
    check_programs(cx, &cx.world.with_reduction(Reduction::Native), "native", false);
}

fn generated_unverified(cx: &Ctx) {
    check_programs(cx, &cx.world.with_reduction(Reduction::Exact).with_verify(false), "unverified", true);
}

fn async_order(cx: &Ctx) {
    let (n, r, dev) = (cx.n, cx.rank, &cx.dev);
    let all = all_ranks(n);
    let a = cx.world.tagged_group("order-a", &all).unwrap();
    let b = cx.world.tagged_group("order-b", &all).unwrap();
    let x = Tensor::from_vec(vec![r as f32 + 1.0; 6], [6], dev).unwrap();
    let total = (n * (n + 1) / 2) as f32;
    // Queued behind each other on one communicator: an async all-reduce, an
    // async all-gather, then a synchronous broadcast that waits its turn.
    let p1 = a.all_reduce_sum_async(&x).unwrap();
    let p2 = a.all_gather_async(&x, 0).unwrap();
    let p3 = a.barrier_async().unwrap();
    let bc = a.broadcast(&x, n - 1).unwrap();
    assert_eq!(bc.to_vec::<f32>().unwrap(), vec![n as f32; 6]);
    assert!(p1.is_done() && p2.is_done(), "the synchronous call ran after the queued ones");
    assert_eq!(p1.wait().unwrap().to_vec::<f32>().unwrap(), vec![total; 6]);
    let g = p2.wait().unwrap().to_vec::<f32>().unwrap();
    assert_eq!(g, (0..n).flat_map(|q| vec![q as f32 + 1.0; 6]).collect::<Vec<_>>());
    p3.wait().unwrap();
    let (pa, pb) = start_in_opposite_orders(&a, &b, &x, r);
    // A group over some ranks works while the others do something else.
    let pair: Vec<usize> = if r / 2 * 2 + 1 < n { vec![r / 2 * 2, r / 2 * 2 + 1] } else { vec![r] };
    let p = cx.world.tagged_group("order-pair", &pair).unwrap();
    let s = p.all_reduce_sum(&x).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(s, vec![pair.iter().map(|&q| q as f32 + 1.0).sum::<f32>(); 6]);
    assert_eq!(pa.wait().unwrap().to_vec::<f32>().unwrap(), vec![total; 6]);
    assert_eq!(pb.wait().unwrap().dims(), &[6 * n]);
    // Async all-to-all and broadcast, and a pending result dropped unwaited.
    let parts: Vec<Tensor> = (0..n).map(|q| Tensor::from_vec(vec![(r * n + q) as i32; q + 1], [q + 1], dev).unwrap()).collect();
    let pt = a.all_to_all_async(parts).unwrap();
    drop(a.broadcast_async(&x, 0).unwrap());
    let got = pt.wait().unwrap();
    for (q, t) in got.iter().enumerate() {
        assert_eq!(t.to_vec::<i32>().unwrap(), vec![(q * n + r) as i32; r + 1]);
    }
    a.barrier().unwrap();
    assert!(cx.world.tagged_group("order-a", &all).is_err(), "a second communicator for the same group");
}

fn mesh(cx: &Ctx) {
    let n = cx.n;
    let spec = if n == 4 { "tp2,dp2" } else { "dp3" };
    let m = Mesh::parse(spec, n, n).unwrap();
    // Exact sums, so that every axis's result is the in-process one's bits.
    let groups = mpi::mesh_groups(&cx.world.with_reduction(Reduction::Exact), &m).unwrap();
    let x = |r: usize, dev: &Device| Tensor::rand(Init::Uniform { lo: -1.0, hi: 1.0 }, RngKey::new(5, r as u64), [4, 6], DType::F32, dev).unwrap();
    let world = InProcess::new(n).unwrap();
    let want = on_threads(n, |r| {
        let dev = Device::cpu();
        let g = inproc::mesh_groups(&world, &m, r, &dev).unwrap();
        g.all().map(|c| Outcome::of(&c.all_reduce_sum(&x(r, &dev)).unwrap()).bits)
    })
    .swap_remove(cx.rank);
    let have = groups.all().map(|c| Outcome::of(&c.all_reduce_sum(&x(cx.rank, &cx.dev)).unwrap()).bits);
    assert_eq!(have, want);
    assert_eq!(groups.tp.size() * groups.dp.size(), n);
    assert!(mpi::mesh_groups(cx.world, &Mesh::parse("dp1", 1, 1).unwrap()).is_err(), "a mesh of another size is refused");
}

fn send_recv(cx: &Ctx) {
    let (n, r, dev) = (cx.n, cx.rank, &cx.dev);
    let comm = cx.world.tagged_group("p2p", &all_ranks(n)).unwrap();
    let next = (r + 1) % n;
    let prev = (r + n - 1) % n;
    // Several messages to the same peer, of different dtypes and shapes (one
    // empty, one far above any eager limit), all sent before any is received.
    let msgs = |from: usize| -> Vec<Tensor> {
        vec![
            input(from, 1, &[3, 5], DType::F32, dev),
            input(from, 2, &[0, 4], DType::BF16, dev),
            input(from, 3, &[2_000_000], DType::F32, dev),
            Tensor::from_vec(vec![from as i32, -7], [2], dev).unwrap(),
            input(from, 4, &[3, 4], DType::F64, dev).t().unwrap(),
        ]
    };
    let mut mine = msgs(r);
    for m in &mine {
        comm.send(m, next).unwrap();
    }
    // The sender may change its tensors at once: the messages are copies.
    mine.clear();
    let want = msgs(prev);
    for w in &want {
        let m = comm.recv(prev).unwrap();
        assert_eq!(Outcome::of(&m).bits, Outcome::of(w).bits);
        assert_eq!((m.dims(), m.dtype()), (w.dims(), w.dtype()));
    }
    // Errors before anything is sent.
    assert!(matches!(comm.send(&want[0], r), Err(Error::NoSuchRank { .. })));
    assert!(matches!(comm.recv(n), Err(Error::NoSuchRank { .. })));
    comm.barrier().unwrap();
}

fn uneven_all_to_all(cx: &Ctx) {
    let (n, r, dev) = (cx.n, cx.rank, &cx.dev);
    let comm = cx.world.tagged_group("a2a", &all_ranks(n)).unwrap();
    let dtypes = [DType::F32, DType::BF16, DType::I32, DType::F64, DType::F16, DType::U32];
    // Part `to` of rank `from`: a dtype and shape of its own (some empty).
    let part = |from: usize, to: usize| {
        let rows = (from * 3 + to * 5) % 4;
        input(from * n + to, 9, &[rows, 1 + to], dtypes[(from + 2 * to) % dtypes.len()], dev)
    };
    let got_parts = comm.all_to_all((0..n).map(|to| part(r, to)).collect()).unwrap();
    assert_eq!(got_parts.len(), n);
    for (from, t) in got_parts.iter().enumerate() {
        let w = part(from, r);
        assert_eq!((t.dims(), t.dtype()), (w.dims(), w.dtype()), "part from rank {from}");
        assert_eq!(Outcome::of(t).bits, Outcome::of(&w).bits, "part from rank {from}");
    }
    // Non-contiguous parts are sent as their logical contents.
    let parts: Vec<Tensor> = (0..n).map(|to| input(r * n + to, 10, &[3, 2], DType::F32, dev).t().unwrap()).collect();
    let got_parts = comm.all_to_all(parts).unwrap();
    for (from, t) in got_parts.iter().enumerate() {
        let w = input(from * n + r, 10, &[3, 2], DType::F32, dev).t().unwrap();
        assert_eq!(Outcome::of(t), Outcome::of(&w));
    }
}

fn mismatches(cx: &Ctx) {
    let (n, rank, dev) = (cx.n, cx.rank, &cx.dev);
    let comm = cx.world.tagged_group("mismatch", &all_ranks(n)).unwrap();
    let x = input(rank, 0, &[6, 4], DType::F32, dev);
    let is_mismatch = |e: &Error| matches!(e, Error::CollectiveMismatch { .. });
    // Different collectives.
    let e = if rank == 0 { comm.all_reduce_sum(&x) } else { comm.all_gather(&x, 0) }.unwrap_err();
    assert!(is_mismatch(&e), "{e}");
    assert!(e.to_string().contains("all_reduce_sum") && e.to_string().contains("all_gather"), "{e}");
    // Different shapes.
    let y = input(rank, 0, &[6, 4 + rank], DType::F32, dev);
    assert!(matches!(comm.all_reduce_sum(&y), Err(e) if is_mismatch(&e)));
    // Different dtypes.
    let z = input(rank, 0, &[6, 4], if rank == 1 { DType::BF16 } else { DType::F32 }, dev);
    assert!(matches!(comm.all_reduce_sum(&z), Err(e) if is_mismatch(&e)));
    // Different roots (the calls differ, so that is what every rank hears
    // first), and a root that does not exist (each rank's own error).
    assert!(matches!(comm.broadcast(&x, rank), Err(e) if is_mismatch(&e)));
    assert!(matches!(comm.broadcast(&x, if rank == 0 { n } else { 0 }), Err(e) if is_mismatch(&e)));
    assert!(matches!(comm.broadcast(&x, n), Err(Error::NoSuchRank { .. })));
    // A shape one rank cannot split: its own error there, a mismatch elsewhere.
    let w = input(rank, 0, &[if rank == 0 { n + 1 } else { n }, 2], DType::F32, dev);
    match (rank, comm.reduce_scatter_sum(&w, 0)) {
        (0, Err(Error::Shape { .. })) => {}
        (r, Err(e)) if r > 0 && is_mismatch(&e) => {}
        (r, other) => panic!("rank {r}: unexpected {other:?}"),
    }
    // A wrong number of all-to-all parts on one rank.
    let parts: Vec<Tensor> = (0..if rank == 0 { n + 1 } else { n }).map(|_| x.clone()).collect();
    match (rank, comm.all_to_all(parts)) {
        (0, Err(Error::InvalidArgument { .. })) => {}
        (r, Err(e)) if r > 0 && is_mismatch(&e) => {}
        (r, other) => panic!("rank {r}: unexpected {other:?}"),
    }
    // The group is still usable, and its calls still correct.
    let s = comm.all_reduce_sum(&Tensor::from_vec(vec![1i32; 3], [3], dev).unwrap()).unwrap();
    assert_eq!(s.to_vec::<i32>().unwrap(), vec![n as i32; 3]);
}

fn large(cx: &Ctx) {
    let n = cx.n;
    // Above every eager and segmentation threshold; an odd length so the
    // chunks differ.
    let len = (1 << 20) + 7;
    let dims = [len];
    let exact = cx.world.with_reduction(Reduction::Exact).tagged_group("large", &all_ranks(n)).unwrap();
    for dtype in [DType::F32, DType::BF16] {
        let x = input(cx.rank, 11, &dims, dtype, &cx.dev);
        let have = Outcome::of(&exact.all_reduce_sum(&x).unwrap());
        let world = InProcess::new(n).unwrap();
        let want = on_threads(n, |r| {
            let dev = Device::cpu();
            Outcome::of(&world.communicator(r, &dev).unwrap().all_reduce_sum(&input(r, 11, &dims, dtype, &dev)).unwrap())
        })
        .swap_remove(cx.rank);
        assert!(have.bits == want.bits, "{dtype:?}: the exact all-reduce of {len} elements differs from the in-process one");
    }
}

fn options(_: &Ctx) {
    let vars = |pairs: &'static [(&'static str, &'static str)]| move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string());
    assert_eq!(MpiOptions::from_vars(vars(&[])).unwrap(), MpiOptions::default());
    let o = MpiOptions::from_vars(vars(&[("TESSERA_MPI_REDUCTION", "exact"), ("TESSERA_MPI_VERIFY", "0"), ("TESSERA_MPI_TIMEOUT_S", "0")])).unwrap();
    assert_eq!(o, MpiOptions { reduction: Reduction::Exact, verify: false, timeout: None });
    let o = MpiOptions::from_vars(vars(&[("TESSERA_MPI_TIMEOUT_S", "2.5")])).unwrap();
    assert_eq!(o.timeout, Some(Duration::from_millis(2500)));
    for (k, v) in [("TESSERA_MPI_REDUCTION", "fast"), ("TESSERA_MPI_VERIFY", "yes"), ("TESSERA_MPI_TIMEOUT_S", "-1")] {
        let pairs: &'static [(&'static str, &'static str)] = Box::leak(vec![(k, v)].into_boxed_slice());
        let e = MpiOptions::from_vars(vars(pairs)).unwrap_err().to_string();
        assert!(e.contains(k) && e.contains(v), "{e}");
    }
}

/// The planner's profile of this job (`tessera profile --comm mpi`): rank 0
/// measures the device for its node's ranks while the others wait, then MPI's
/// all-reduce is timed over groups of the first "node" and over one rank of
/// each "node" (nodes of two ranks where the job divides into them), and
/// fitted to a latency and bandwidth per group size. Rank 0 gets the
/// profile, every other rank none.
fn profile(cx: &Ctx) {
    use tessera_plan::job::{profile_job, JobRanks};
    use tessera_plan::measure::Budget;
    let per_node = if cx.n.is_multiple_of(2) { 2 } else { cx.n };
    let budget = Budget { per_figure: Duration::from_millis(10) };
    let profile = profile_job("mpi-job", JobRanks::Mpi(cx.world), per_node, budget).unwrap();
    if cx.rank != 0 {
        assert!(profile.is_none(), "rank {} got a profile", cx.rank);
        return;
    }
    let p = profile.expect("rank 0 gets the profile");
    assert_eq!(p.gpus_per_node, per_node);
    let sizes = |fits: &[tessera_plan::profile::GroupFit]| fits.iter().map(|f| f.size).collect::<Vec<_>>();
    assert_eq!(sizes(&p.intra_node.by_size), [2], "{p:?}");
    let nodes = cx.n / per_node;
    match &p.inter_node {
        Some(link) => assert_eq!((nodes, sizes(&link.by_size)), (2, vec![2]), "{p:?}"),
        None => assert_eq!(nodes, 1, "{p:?}"),
    }
    for fit in p.intra_node.by_size.iter().chain(p.inter_node.iter().flat_map(|l| &l.by_size)) {
        // Ranks of one machine: between a memory copy's speed and far below it, never free.
        assert!(fit.bandwidth > 1e6 && fit.bandwidth < 1e12 && fit.latency < 0.01, "{fit:?}");
    }
    assert!(p.device.peak_flops["f32"] > 0.0 && p.device.memory_bytes > 0);
}
