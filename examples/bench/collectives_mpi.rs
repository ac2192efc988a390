//! `bench collectives --backend mpi`: Tessera's MPI communicators against a
//! plain MPI call on the same buffer, timed in the same run.
//!
//! Every process of the job runs this (`mpirun -np N target/release/examples/bench
//! collectives --backend mpi`); the number of ranks is the job's. For each
//! collective and size it times the communicator (native sums, and for the
//! reductions also the exact ones) and the plain MPI collective it stands
//! for (`MPI_Allreduce`, `MPI_Allgather`, `MPI_Reduce_scatter_block` with
//! preallocated buffers), and reports both with their ratio, next to the
//! single-thread memcpy rate measured first on rank 0 while the others wait
//! without spinning.

#[cfg(not(feature = "mpi"))]
pub fn run(_args: &super::CollectivesArgs) -> anyhow::Result<()> {
    anyhow::bail!("`--backend mpi` needs a build with MPI: `cargo build --release --example bench --features mpi`, run under `mpirun -np N`")
}

#[cfg(feature = "mpi")]
pub use imp::run;

#[cfg(feature = "mpi")]
mod imp {
    use super::super::{human, time_per_call, Coll, CollectivesArgs};
    use anyhow::{ensure, Result};
    use mpi::collective::SystemOperation;
    use mpi::topology::SimpleCommunicator;
    use mpi::traits::{Communicator as _, CommunicatorCollectives, Root};
    use std::hint::black_box;
    use std::time::{Duration, Instant};
    use tessera::dist::mpi::{MpiComm, MpiWorld, Reduction};
    use tessera::dist::Communicator;
    use tessera::{Device, Tensor};

    /// What a row of the report times.
    #[derive(Clone, Copy)]
    enum Subject {
        Tessera(Reduction),
        Plain,
    }

    /// Single-threaded copy of `bytes` between two warm buffers (the speed one
    /// core moves memory at), and into a fresh allocation each time, as a
    /// collective's result must be: above the allocator's mmap threshold
    /// (32 MiB) every fresh buffer is new pages the kernel faults in and zeroes.
    fn memcpy_rates(bytes: usize, args: &CollectivesArgs) -> (f64, f64) {
        let src = vec![1u8; bytes];
        let mut dst = vec![0u8; bytes];
        let warm = time_per_call(args.min_time, args.reps, || {
            dst.copy_from_slice(black_box(&src));
            black_box(&mut dst);
        });
        let fresh = time_per_call(args.min_time, args.reps, || {
            let mut v = Vec::with_capacity(bytes);
            v.extend_from_slice(black_box(&src));
            black_box(v);
        });
        (bytes as f64 / warm / 1e9, bytes as f64 / fresh / 1e9)
    }

    /// Waits for every rank without spinning a core (a blocking MPI call
    /// polls), so that rank 0's memcpy runs on a quiet machine.
    fn quiet_barrier(world: &SimpleCommunicator) {
        let mut req = world.immediate_barrier();
        loop {
            match req.test() {
                Ok(_) => return,
                Err(r) => req = r,
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Seconds per call of `call`, timed on rank 0 between barriers (so it
    /// covers the slowest rank), fastest of `reps` repetitions; rank 0
    /// decides the calls per repetition and tells the others.
    fn time(world: &SimpleCommunicator, args: &CollectivesArgs, mut call: impl FnMut() -> Result<()>) -> Result<f64> {
        world.barrier();
        let t0 = Instant::now();
        call()?;
        world.barrier();
        let once = t0.elapsed().as_secs_f64().max(1e-7);
        let mut iters = ((args.min_time / once).ceil()).clamp(1.0, 100_000.0) as u64;
        world.process_at_rank(0).broadcast_into(&mut iters);
        let mut best = f64::INFINITY;
        for _ in 0..args.reps {
            world.barrier();
            let t = Instant::now();
            for _ in 0..iters {
                call()?;
            }
            world.barrier();
            best = best.min(t.elapsed().as_secs_f64() / iters as f64);
        }
        Ok(best)
    }

    fn time_subject(
        world: &SimpleCommunicator,
        comms: &[(Reduction, MpiComm)],
        op: Coll,
        subject: Subject,
        bytes: usize,
        args: &CollectivesArgs,
    ) -> Result<f64> {
        let n = world.size() as usize;
        let len = if op == Coll::Allgather { bytes / 4 / n } else { bytes / 4 };
        let rank = world.rank() as f32;
        match subject {
            Subject::Tessera(reduction) => {
                let comm = &comms.iter().find(|(r, _)| *r == reduction).expect("a communicator per reduction").1;
                let x = Tensor::from_vec(vec![rank + 1.0; len], [len], &Device::cpu())?;
                time(world, args, || {
                    drop(black_box(match op {
                        Coll::Allreduce => comm.all_reduce_sum(&x)?,
                        Coll::Allgather => comm.all_gather(&x, 0)?,
                        Coll::Reducescatter => comm.reduce_scatter_sum(&x, 0)?,
                    }));
                    Ok(())
                })
            }
            Subject::Plain => {
                let x = vec![rank + 1.0; len];
                let mut out = vec![
                    0f32;
                    if op == Coll::Allgather {
                        len * n
                    } else if op == Coll::Reducescatter {
                        len / n
                    } else {
                        len
                    }
                ];
                time(world, args, || {
                    match op {
                        Coll::Allreduce => world.all_reduce_into(&x[..], &mut out[..], SystemOperation::sum()),
                        Coll::Allgather => world.all_gather_into(&x[..], &mut out[..]),
                        Coll::Reducescatter => world.reduce_scatter_block_into(&x[..], &mut out[..], SystemOperation::sum()),
                    }
                    black_box(&mut out);
                    Ok(())
                })
            }
        }
    }

    pub fn run(args: &CollectivesArgs) -> Result<()> {
        ensure!(args.reps > 0, "--reps must be positive");
        let world = MpiWorld::init()?;
        let comm_world = SimpleCommunicator::world();
        let (rank, n) = (world.rank(), world.world_size());
        ensure!(n >= 2, "run under `mpirun -np N` with N of at least 2 (this job has {n} process)");
        let comms = [Reduction::Native, Reduction::Exact]
            .into_iter()
            .map(|r| Ok((r, world.with_reduction(r).tagged_group(&format!("bench-{}", r.name()), &(0..n).collect::<Vec<_>>())?)))
            .collect::<Result<Vec<_>>>()?;
        let mut sizes = Vec::new();
        let mut b = args.min_bytes;
        while b <= args.max_bytes {
            sizes.push(b);
            b *= 4;
        }
        let memcpy: Vec<(f64, f64)> = if rank == 0 { sizes.iter().map(|&b| memcpy_rates(b, args)).collect() } else { Vec::new() };
        quiet_barrier(&comm_world);
        if rank == 0 {
            eprintln!("{} ranks, MPI: {}", n, MpiWorld::library_version().lines().next().unwrap_or_default());
            eprintln!(
                "{:<14} {:<7} {:>5} {:>6} {:>10} {:>11} {:>11} {:>11} {:>8} {:>12} {:>8}",
                "collective", "sums", "ranks", "bytes", "time_us", "algbw_GB/s", "busbw_GB/s", "memcpy_GB/s", "bus/mcp", "mpi_time_us", "vs_mpi"
            );
        }
        let mut lines = Vec::new();
        for &op in &args.ops {
            let reductions: &[Reduction] = if op == Coll::Allgather { &[Reduction::Native] } else { &[Reduction::Native, Reduction::Exact] };
            for (i, &bytes) in sizes.iter().enumerate() {
                // Every rank's share must be a whole number of f32 elements.
                let bytes = bytes / (4 * n) * (4 * n);
                if bytes == 0 {
                    continue;
                }
                let plain = time_subject(&comm_world, &comms, op, Subject::Plain, bytes, args)?;
                for &reduction in reductions {
                    let t = time_subject(&comm_world, &comms, op, Subject::Tessera(reduction), bytes, args)?;
                    if rank != 0 {
                        continue;
                    }
                    let (mcp, fresh) = memcpy[i];
                    let algbw = bytes as f64 / t / 1e9;
                    let factor = match op {
                        Coll::Allreduce => 2.0 * (n - 1) as f64 / n as f64,
                        Coll::Allgather | Coll::Reducescatter => (n - 1) as f64 / n as f64,
                    };
                    let busbw = algbw * factor;
                    let mpi_busbw = bytes as f64 / plain / 1e9 * factor;
                    let sums = if op == Coll::Allgather { "-" } else { reduction.name() };
                    eprintln!(
                        "{:<14} {:<7} {:>5} {:>6} {:>10.1} {:>11.2} {:>11.2} {:>11.2} {:>8.2} {:>12.1} {:>8.2}",
                        op.to_string(),
                        sums,
                        n,
                        human(bytes),
                        t * 1e6,
                        algbw,
                        busbw,
                        mcp,
                        busbw / mcp,
                        plain * 1e6,
                        plain / t
                    );
                    let r3 = |x: f64| (x * 1000.0).round() / 1000.0;
                    lines.push(serde_json::json!({
                        "bench": op.to_string(),
                        "backend": "mpi",
                        "sums": sums,
                        "ranks": n,
                        "bytes": bytes,
                        "time_us": (t * 1e7).round() / 10.0,
                        "algbw_gbs": r3(algbw),
                        "busbw_gbs": r3(busbw),
                        "memcpy_gbs": r3(mcp),
                        "busbw_over_memcpy": r3(busbw / mcp),
                        "memcpy_fresh_gbs": r3(fresh),
                        "mpi_time_us": (plain * 1e7).round() / 10.0,
                        "mpi_busbw_gbs": r3(mpi_busbw),
                        "over_mpi": r3(plain / t),
                    }));
                }
            }
        }
        for l in lines {
            println!("{l}");
        }
        Ok(())
    }
}
