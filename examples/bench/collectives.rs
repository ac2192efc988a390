//! `bench collectives` for the backends built into the runtime: ranks as
//! threads (`inproc`), or as processes of this program through shared
//! memory (`shm`) or TCP (`tcp`).
//!
//! For processes the bench starts the ranks itself (this program again, with
//! the launcher's variables), or runs as one rank when a launcher started it
//! (`tessera launch --nproc-per-node 4 -- bench collectives --backend shm`).
//!
//! Every case is timed on the ranks themselves, alternating with its two
//! memory-copy references so that all three see the same load:
//!
//! - **memcpy**: rank 0 alone copies `S` bytes between two warm buffers of
//!   its own while the others wait: one core's copy rate;
//! - **memcpy_concurrent**: every rank copies `S` bytes between its own warm
//!   buffers at the same time, and the rate is `S` over the time until all
//!   are done: what each rank's share of the machine moves when all ranks
//!   move data at once, the per-rank "link" that busbw is defined against.
//!
//! Output: a table on standard error, then one JSON line per case, e.g.
//! `{"bench":"allreduce","backend":"shm","ranks":2,"bytes":16777216,"busbw_gbs":8.1,...}`.

use super::{human, Backend, Coll, CollectivesArgs};
use anyhow::{anyhow, bail, ensure, Context, Result};
use std::hint::black_box;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tessera::dist::env::ProcessEnv;
use tessera::dist::inproc::InProcess;
use tessera::dist::process::{ProcessWorld, Transport};
use tessera::dist::store::Rendezvous;
use tessera::dist::Communicator;
use tessera::{Device, Tensor};

/// What marks a result line a rank process sends to the process that
/// started it.
const MARK: &str = "@collectives@ ";

/// How long the ranks of a process job wait for one another.
const TIMEOUT: Duration = Duration::from_secs(120);

/// One measured case.
struct Record {
    op: Coll,
    ranks: usize,
    bytes: usize,
    /// Seconds per call of the collective, of a copy by rank 0 alone, and
    /// of a copy by every rank at once (the slowest rank's).
    coll: f64,
    memcpy: f64,
    concurrent: f64,
}

impl Record {
    fn json(&self, backend: Backend) -> serde_json::Value {
        let s = self.bytes as f64;
        let algbw = s / self.coll / 1e9;
        let busbw = algbw * bus_factor(self.op, self.ranks);
        let (mcp, conc) = (s / self.memcpy / 1e9, s / self.concurrent / 1e9);
        let r3 = |x: f64| (x * 1000.0).round() / 1000.0;
        serde_json::json!({
            "bench": self.op.to_string(),
            "backend": backend.to_string(),
            "ranks": self.ranks,
            "bytes": self.bytes,
            "time_us": (self.coll * 1e7).round() / 10.0,
            "algbw_gbs": r3(algbw),
            "busbw_gbs": r3(busbw),
            "memcpy_gbs": r3(mcp),
            "memcpy_concurrent_gbs": r3(conc),
            "busbw_over_memcpy": r3(busbw / mcp),
            "busbw_over_concurrent": r3(busbw / conc),
        })
    }
}

/// nccl-tests' busbw factor: the share of the message each rank's link
/// carries in a ring algorithm.
fn bus_factor(op: Coll, n: usize) -> f64 {
    match op {
        Coll::Allreduce => 2.0 * (n - 1) as f64 / n as f64,
        Coll::Allgather | Coll::Reducescatter => (n - 1) as f64 / n as f64,
    }
}

fn header() {
    eprintln!(
        "{:<14} {:>7} {:>5} {:>6} {:>10} {:>10} {:>10} {:>10} {:>10} {:>8} {:>8}",
        "collective", "backend", "ranks", "bytes", "time_us", "algbw", "busbw", "memcpy", "mcp_conc", "bus/mcp", "bus/conc"
    );
}

fn row(json: &serde_json::Value) {
    let f = |k: &str| json[k].as_f64().unwrap_or(f64::NAN);
    eprintln!(
        "{:<14} {:>7} {:>5} {:>6} {:>10.1} {:>10.2} {:>10.2} {:>10.2} {:>10.2} {:>8.2} {:>8.2}",
        json["bench"].as_str().unwrap_or("?"),
        json["backend"].as_str().unwrap_or("?"),
        f("ranks"),
        human(f("bytes") as usize),
        f("time_us"),
        f("algbw_gbs"),
        f("busbw_gbs"),
        f("memcpy_gbs"),
        f("memcpy_concurrent_gbs"),
        f("busbw_over_memcpy"),
        f("busbw_over_concurrent"),
    );
}

/// The message sizes of the run: from `--min-bytes` to `--max-bytes` by 4×.
fn sizes(args: &CollectivesArgs) -> Vec<usize> {
    std::iter::successors(Some(args.min_bytes), |&b| Some(b * 4)).take_while(|&b| b <= args.max_bytes).collect()
}

/// Runs `bench collectives` for `inproc`, `shm` and `tcp`.
pub fn run(args: &CollectivesArgs) -> Result<()> {
    ensure!(args.reps > 0, "--reps must be positive");
    ensure!(args.ranks.iter().all(|&n| n >= 2), "--ranks: every count must be at least 2");
    ensure!(args.min_bytes >= 4 && args.min_bytes <= args.max_bytes, "--min-bytes must be at least 4 and at most --max-bytes");
    if let Some(env) = ProcessEnv::detect()? {
        ensure!(args.backend != Backend::Inproc, "started by a launcher ({}): use --backend shm or tcp, or run without the launcher", env.launcher);
        return rank_process(args, &env);
    }
    header();
    let mut lines = Vec::new();
    for &n in &args.ranks {
        // Each shows its rows as they come.
        lines.extend(match args.backend {
            Backend::Inproc => threads(args, n)?,
            Backend::Shm | Backend::Tcp => processes(args, n)?,
            Backend::Mpi => bail!("`--backend mpi` is measured by the MPI bench, not here"),
        });
    }
    for l in lines {
        println!("{l}");
    }
    Ok(())
}

/// Every case on `n` rank threads; the records as JSON.
fn threads(args: &CollectivesArgs, n: usize) -> Result<Vec<serde_json::Value>> {
    let world = InProcess::with_timeout(n, TIMEOUT)?;
    let results = std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let world = world.clone();
                s.spawn(move || -> Result<Vec<Record>> {
                    let dev = Device::cpu();
                    let comm = world.communicator(rank, &dev)?;
                    measure_all(&comm, args, &dev)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().map_err(|_| anyhow!("a rank thread panicked"))?).collect::<Result<Vec<_>>>()
    })?;
    let records: Vec<_> = results.into_iter().next().unwrap_or_default().iter().map(|r| r.json(args.backend)).collect();
    records.iter().for_each(row);
    Ok(records)
}

/// Every case on `n` rank processes (this program again); the records rank
/// 0 reports, as JSON.
fn processes(args: &CollectivesArgs, n: usize) -> Result<Vec<serde_json::Value>> {
    let exe = std::env::current_exe().context("finding this program to start its ranks")?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let ops: Vec<String> = args.ops.iter().map(Coll::to_string).collect();
    let mut children = Vec::new();
    for rank in 0..n {
        let child = Command::new(&exe)
            .arg("collectives")
            .args(["--backend", &args.backend.to_string(), "--ranks", &n.to_string()])
            .args(["--min-bytes", &args.min_bytes.to_string(), "--max-bytes", &args.max_bytes.to_string()])
            .args(["--ops", &ops.join(","), "--min-time", &args.min_time.to_string(), "--reps", &args.reps.to_string()])
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env(MARK_VAR, "1")
            .stdout(if rank == 0 { Stdio::piped() } else { Stdio::null() })
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting rank {rank} of {n}"))?;
        children.push(child);
    }
    let out = children[0].stdout.take().expect("rank 0's output is piped");
    let mut records = Vec::new();
    for line in BufReader::new(out).lines() {
        if let Some(json) = line?.strip_prefix(MARK) {
            let json: serde_json::Value = serde_json::from_str(json)?;
            row(&json);
            records.push(json);
        }
    }
    for (rank, mut c) in children.into_iter().enumerate() {
        let status = c.wait()?;
        if !status.success() {
            bail!("rank {rank} of {n} failed ({status})");
        }
    }
    Ok(records)
}

/// Set in the ranks this program starts itself: rank 0 sends its results to
/// the starter instead of printing the report.
const MARK_VAR: &str = "TESSERA_BENCH_REPORT_TO_PARENT";

/// One rank of a job of processes: every case, reported by rank 0.
fn rank_process(args: &CollectivesArgs, env: &ProcessEnv) -> Result<()> {
    let transport = match args.backend {
        Backend::Shm => Transport::Shm,
        _ => Transport::Tcp,
    };
    let rdzv = Rendezvous::join(env, TIMEOUT)?;
    let dev = Device::cpu();
    let world = ProcessWorld::join_with(&rdzv, &dev, TIMEOUT, transport)?;
    let comm = world.communicator()?;
    ensure!(comm.transport() == transport, "the world communicator uses {} instead of {transport}", comm.transport());
    let to_parent = std::env::var_os(MARK_VAR).is_some();
    if env.rank == 0 && !to_parent {
        header();
    }
    let records = measure_all(&comm, args, &dev)?;
    if env.rank == 0 {
        let lines: Vec<_> = records.iter().map(|r| r.json(args.backend)).collect();
        for l in &lines {
            if to_parent {
                println!("{MARK}{l}");
            } else {
                row(l);
            }
        }
        if !to_parent {
            for l in lines {
                println!("{l}");
            }
        }
    }
    // Nobody leaves while another rank may still wait for it.
    comm.barrier()?;
    Ok(())
}

/// Every case of the run on this rank's communicator (every rank calls it),
/// with tensors on `dev`, the rank's device; rank 0's records, empty
/// elsewhere.
fn measure_all(comm: &dyn Communicator, args: &CollectivesArgs, dev: &Device) -> Result<Vec<Record>> {
    let n = comm.size();
    let mut out = Vec::new();
    for &op in &args.ops {
        for &bytes in &sizes(args) {
            // Every rank's share must be a whole number of f32 elements.
            let bytes = bytes / (4 * n) * (4 * n);
            if bytes == 0 {
                continue;
            }
            // The rank's device, as in a training step (a rank of processes
            // keeps its tensors in its shared-memory arena), with its cache
            // of freed buffers emptied: it then holds the previous call's
            // result, which a training step asks for again every time, and
            // not the results of the smaller cases, which would leave no
            // room under the device's high-water mark (every call would
            // fault in fresh pages).
            if let Device::Cpu(d) = dev {
                d.empty_cache();
            }
            if let Some(r) = measure(comm, op, bytes, args, dev)? {
                out.push(r);
            }
        }
    }
    Ok(out)
}

/// Times `op` on a message of `bytes` (nccl-tests' convention: the
/// all-reduce buffer, the all-gather output, the reduce-scatter input) and
/// the two copy references, alternating, best of `--reps` each. Every rank
/// calls it; rank 0 gets the record.
fn measure(comm: &dyn Communicator, op: Coll, bytes: usize, args: &CollectivesArgs, dev: &Device) -> Result<Option<Record>> {
    let (n, rank) = (comm.size(), comm.rank());
    let elems = bytes / 4;
    let len = if op == Coll::Allgather { elems / n } else { elems };
    // Allocated by the device, as an op's output is (a rank of processes
    // keeps it in its shared-memory arena).
    let x = Tensor::from_slice(&vec![rank as f32 + 1.0; len], [len], dev)?;
    let call = || -> Result<Tensor> {
        Ok(match op {
            Coll::Allreduce => comm.all_reduce_sum(&x)?,
            Coll::Allgather => comm.all_gather(&x, 0)?,
            Coll::Reducescatter => comm.reduce_scatter_sum(&x, 0)?,
        })
    };
    // Warm buffers of this rank's own for the copies.
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let mut copy = || {
        dst.copy_from_slice(black_box(&src));
        black_box(&mut dst);
    };
    // Warm-up and calibration: rank 0 decides the call counts, since every
    // rank must issue the same calls.
    comm.barrier()?;
    let t0 = Instant::now();
    drop(black_box(call()?));
    comm.barrier()?;
    let once = t0.elapsed().as_secs_f64().max(1e-7);
    let t0 = Instant::now();
    copy();
    let copy_once = t0.elapsed().as_secs_f64().max(1e-8);
    let count = |once: f64| (args.min_time / once).ceil().clamp(1.0, 100_000.0) as i32;
    let mine = Tensor::from_vec(vec![count(once), count(copy_once)], [2], dev)?;
    let iters = comm.broadcast(&mine, 0)?.to_vec::<i32>()?;
    let (iters, copies) = (iters[0] as usize, iters[1] as usize);
    let (mut coll, mut memcpy, mut concurrent) = (f64::INFINITY, f64::INFINITY, f64::INFINITY);
    for _ in 0..args.reps {
        // Rank 0 copies alone.
        comm.barrier()?;
        if rank == 0 {
            let t = Instant::now();
            for _ in 0..copies {
                copy();
            }
            memcpy = memcpy.min(t.elapsed().as_secs_f64() / copies as f64);
        }
        // Every rank copies at once, timed on rank 0 between barriers, so
        // it covers the slowest rank (and ranks that share a core take
        // turns, as they do in the collective).
        comm.barrier()?;
        let t = Instant::now();
        for _ in 0..copies {
            copy();
        }
        comm.barrier()?;
        concurrent = concurrent.min(t.elapsed().as_secs_f64() / copies as f64);
        // The collective, timed on rank 0 between barriers, so it covers
        // the slowest rank.
        comm.barrier()?;
        let t = Instant::now();
        for _ in 0..iters {
            drop(black_box(call()?));
        }
        comm.barrier()?;
        coll = coll.min(t.elapsed().as_secs_f64() / iters as f64);
    }
    Ok((rank == 0).then_some(Record { op, ranks: n, bytes, coll, memcpy, concurrent }))
}
