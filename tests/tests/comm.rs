//! The in-process communicator: every collective against a reference
//! computed directly, bit-identical results on every rank, sub-groups,
//! asynchronous calls, point-to-point messages, memory accounting, and
//! failures (panics, aborts, timeouts, mismatched calls) that turn into
//! errors instead of hangs.

use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};
use tessera::dist::inproc::{InProcess, InProcessComm};
use tessera::dist::{Communicator, SingleRank};
use tessera::prelude::*;
use tessera::Error;
use tessera_comm_harness::on_threads;

const DTYPES: [DType; 3] = [DType::F32, DType::F64, DType::BF16];
const LENS: [usize; 4] = [1, 3, 17, 129];
const WORLDS: [usize; 4] = [2, 3, 4, 8];

/// Runs `f(rank, communicator, device)` for every rank of `world`, each on
/// its own thread with its own CPU device, and returns the results in rank
/// order; a panicking rank fails the test.
fn on_every_rank<R: Send>(world: &InProcess, f: impl Fn(usize, InProcessComm, &Device) -> R + Sync) -> Vec<R> {
    on_threads(world.world_size(), |rank| {
        let dev = Device::cpu();
        f(rank, world.communicator(rank, &dev).unwrap(), &dev)
    })
}

/// Rank `rank`'s deterministic input for case `case`.
fn input(rank: usize, case: u64, dims: &[usize], dtype: DType, dev: &Device) -> Tensor {
    let key = RngKey::new(1000 + rank as u64, case);
    Tensor::rand(Init::Uniform { lo: -1.0, hi: 1.0 }, key, dims, dtype, dev).unwrap()
}

/// The elementwise sum in rank order, computed in f32 (f64 for f64) and
/// rounded once to `dtype`: what every rank must receive, bit for bit.
fn sum_ref(inputs: &[Tensor]) -> Vec<f64> {
    let dtype = inputs[0].dtype();
    let vals: Vec<Vec<f64>> = inputs.iter().map(|t| t.to_f64_vec().unwrap()).collect();
    let n = vals[0].len();
    let dev = Device::cpu();
    if dtype == DType::F64 {
        return (0..n).map(|i| vals.iter().skip(1).fold(vals[0][i], |a, v| a + v[i])).collect();
    }
    let acc: Vec<f32> = (0..n).map(|i| vals.iter().skip(1).fold(vals[0][i] as f32, |a, v| a + v[i] as f32)).collect();
    Tensor::from_vec(acc, inputs[0].dims(), &dev).unwrap().to_dtype(dtype).unwrap().to_f64_vec().unwrap()
}

fn bits(t: &Tensor) -> Vec<u64> {
    t.to_f64_vec().unwrap().iter().map(|v| v.to_bits()).collect()
}

#[track_caller]
fn assert_bits(got: &Tensor, expected: &[f64], what: &str) {
    let want: Vec<u64> = expected.iter().map(|v| v.to_bits()).collect();
    assert_eq!(bits(got), want, "{what}");
}

/// Concatenation of row-major `parts` (all of shape `dims`) along `dim`.
fn concat_ref(parts: &[Vec<f64>], dims: &[usize], dim: usize) -> Vec<f64> {
    let outer: usize = dims[..dim].iter().product();
    let block: usize = dims[dim..].iter().product();
    (0..outer).flat_map(|o| parts.iter().flat_map(move |p| p[o * block..(o + 1) * block].iter().copied())).collect()
}

#[test]
fn all_reduce_matches_the_rank_order_sum_bit_for_bit() {
    for n in WORLDS {
        let world = InProcess::new(n).unwrap();
        let outs = on_every_rank(&world, |rank, comm, dev| {
            assert_eq!((comm.rank(), comm.size()), (rank, n));
            let mut outs = Vec::new();
            for (c, (dtype, len)) in DTYPES.iter().flat_map(|&d| LENS.iter().map(move |&l| (d, l))).enumerate() {
                let x = input(rank, c as u64, &[len], dtype, dev);
                let y = comm.all_reduce_sum(&x).unwrap();
                assert_eq!((y.dtype(), y.dims()), (dtype, &[len][..]));
                assert!(y.device().same(dev), "the result lives on the rank's own device");
                outs.push(y);
            }
            outs
        });
        let dev = Device::cpu();
        for (c, (dtype, len)) in DTYPES.iter().flat_map(|&d| LENS.iter().map(move |&l| (d, l))).enumerate() {
            let inputs: Vec<Tensor> = (0..n).map(|r| input(r, c as u64, &[len], dtype, &dev)).collect();
            let want = sum_ref(&inputs);
            for (r, o) in outs.iter().enumerate() {
                assert_bits(&o[c], &want, &format!("all_reduce n={n} {dtype} len={len} rank {r}"));
            }
        }
    }
}

#[test]
fn all_reduce_of_a_strided_view_and_of_integers() {
    let world = InProcess::new(3).unwrap();
    let outs = on_every_rank(&world, |rank, comm, dev| {
        let x = input(rank, 7, &[5, 4], DType::F32, dev).t().unwrap();
        let ids = Tensor::from_vec(vec![rank as i32 - 1, 7, i32::MAX], [3], dev).unwrap();
        (comm.all_reduce_sum(&x).unwrap(), comm.all_reduce_sum(&ids).unwrap().to_vec::<i32>().unwrap())
    });
    let dev = Device::cpu();
    let inputs: Vec<Tensor> = (0..3).map(|r| input(r, 7, &[5, 4], DType::F32, &dev).t().unwrap().contiguous().unwrap()).collect();
    let want = sum_ref(&inputs);
    for (y, ids) in &outs {
        assert_eq!(y.dims(), &[4, 5]);
        assert_bits(y, &want, "all_reduce of a transposed view");
        assert_eq!(ids, &vec![0, 21, i32::MAX.wrapping_mul(3)], "integers sum exactly and wrap");
    }
}

/// What every rank gets, in rank order, from `op` on its input of each case
/// `(dtype, dims, dim)` (case `c`'s input is `input(rank, c, dims, dtype)`).
fn on_every_case(
    world: &InProcess,
    cases: &[(DType, Vec<usize>, usize)],
    op: impl Fn(&InProcessComm, &Tensor, usize) -> tessera::Result<Tensor> + Sync,
) -> Vec<Vec<Tensor>> {
    on_every_rank(world, |rank, comm, dev| {
        cases.iter().enumerate().map(|(c, (dtype, dims, dim))| op(&comm, &input(rank, c as u64, dims, *dtype, dev), *dim).unwrap()).collect()
    })
}

#[test]
fn all_gather_concatenates_in_rank_order() {
    for n in WORLDS {
        let world = InProcess::new(n).unwrap();
        let cases: Vec<(DType, Vec<usize>, usize)> =
            DTYPES.iter().flat_map(|&d| [(d, vec![1], 0), (d, vec![3, 17], 0), (d, vec![3, 17], 1), (d, vec![2, 3, 5], 1), (d, vec![129], 0)]).collect();
        let outs = on_every_case(&world, &cases, |comm, x, dim| comm.all_gather(x, dim));
        let dev = Device::cpu();
        for (c, (dtype, dims, dim)) in cases.iter().enumerate() {
            let parts: Vec<Vec<f64>> = (0..n).map(|r| input(r, c as u64, dims, *dtype, &dev).to_f64_vec().unwrap()).collect();
            let want = concat_ref(&parts, dims, *dim);
            let mut want_dims = dims.clone();
            want_dims[*dim] *= n;
            for o in &outs {
                assert_eq!(o[c].dims(), &want_dims[..]);
                assert_eq!(o[c].dtype(), *dtype);
                assert_bits(&o[c], &want, &format!("all_gather n={n} {dtype} {dims:?} dim {dim}"));
            }
        }
    }
}

#[test]
fn reduce_scatter_gives_each_rank_its_part_of_the_sum() {
    for n in WORLDS {
        let world = InProcess::new(n).unwrap();
        // (dtype, dims, dim): parts of 1, 3 and 17 rows, and splits of an inner dimension.
        let cases: Vec<(DType, Vec<usize>, usize)> =
            DTYPES.iter().flat_map(|&d| [(d, vec![n], 0), (d, vec![3 * n, 3], 0), (d, vec![17 * n], 0), (d, vec![3, 2 * n, 5], 1)]).collect();
        let outs = on_every_case(&world, &cases, |comm, x, dim| comm.reduce_scatter_sum(x, dim));
        let dev = Device::cpu();
        for (c, (dtype, dims, dim)) in cases.iter().enumerate() {
            let inputs: Vec<Tensor> = (0..n).map(|r| input(r, c as u64, dims, *dtype, &dev)).collect();
            let full = Tensor::from_vec(sum_ref(&inputs), &dims[..], &dev).unwrap();
            let part = dims[*dim] / n;
            for (r, o) in outs.iter().enumerate() {
                let want = full.narrow(*dim, r * part, part).unwrap().to_f64_vec().unwrap();
                assert_eq!(o[c].dtype(), *dtype);
                assert_eq!(o[c].dims()[*dim], part);
                assert_bits(&o[c], &want, &format!("reduce_scatter n={n} {dtype} {dims:?} dim {dim} rank {r}"));
            }
        }
    }
}

#[test]
fn broadcast_copies_the_roots_tensor_to_every_rank() {
    for n in WORLDS {
        let world = InProcess::new(n).unwrap();
        let outs = on_every_rank(&world, |rank, comm, dev| {
            let mut outs = Vec::new();
            for (c, &dtype) in DTYPES.iter().enumerate() {
                for root in [0, n - 1] {
                    let y = comm.broadcast(&input(rank, c as u64, &[17, 3], dtype, dev), root).unwrap();
                    assert!(y.device().same(dev));
                    outs.push(y);
                }
            }
            outs
        });
        let dev = Device::cpu();
        for (c, &dtype) in DTYPES.iter().enumerate() {
            for (k, root) in [0, n - 1].into_iter().enumerate() {
                let want = input(root, c as u64, &[17, 3], dtype, &dev).to_f64_vec().unwrap();
                for o in &outs {
                    assert_bits(&o[2 * c + k], &want, &format!("broadcast n={n} {dtype} root {root}"));
                }
            }
        }
    }
}

/// What rank `from` sends rank `to` in the uneven all-to-all: `(from + 2·to) % 4`
/// rows (possibly none) of 3 values that name both ends.
fn a2a_part(from: usize, to: usize, dev: &Device) -> Tensor {
    let rows = (from + 2 * to) % 4;
    let vals: Vec<f32> = (0..rows * 3).map(|i| (100 * from + 10 * to + i) as f32).collect();
    Tensor::from_vec(vals, [rows, 3], dev).unwrap()
}

#[test]
fn uneven_all_to_all_delivers_every_part_with_its_shape() {
    for n in WORLDS {
        let world = InProcess::new(n).unwrap();
        on_every_rank(&world, |rank, comm, dev| {
            let parts: Vec<Tensor> = (0..n).map(|to| a2a_part(rank, to, dev)).collect();
            let got = comm.all_to_all(parts.clone()).unwrap();
            assert_eq!(got.len(), n);
            for (from, t) in got.iter().enumerate() {
                let want = a2a_part(from, rank, dev);
                assert_eq!(t.dims(), want.dims(), "n={n}: part from {from} to {rank}");
                assert_eq!(t.to_vec::<f32>().unwrap(), want.to_vec::<f32>().unwrap());
                assert!(t.device().same(dev));
            }
            // The async form agrees.
            let again = comm.all_to_all_async(parts).unwrap().wait().unwrap();
            for (a, b) in got.iter().zip(&again) {
                assert_eq!(a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
            }
        });
    }
}

#[test]
fn send_and_recv_ping_pong_with_shape_and_dtype() {
    let world = InProcess::new(2).unwrap();
    on_every_rank(&world, |rank, comm, dev| {
        let peer = 1 - rank;
        // Both send before receiving: sends are buffered, nothing deadlocks.
        let mine = Tensor::from_vec(vec![rank as u32; 7], [7], dev).unwrap();
        comm.send(&mine, peer).unwrap();
        let theirs = comm.recv(peer).unwrap();
        assert_eq!((theirs.dtype(), theirs.dims()), (DType::U32, &[7][..]));
        assert_eq!(theirs.to_vec::<u32>().unwrap(), vec![peer as u32; 7]);
        assert!(theirs.device().same(dev), "received on the receiver's device");
        // Ping-pong: rank 0 serves a bf16 matrix, rank 1 adds one and returns it.
        let mut x = Tensor::full(0.0, [3, 5], DType::BF16, dev).unwrap();
        for round in 0..50 {
            if rank == 0 {
                comm.send(&x, 1).unwrap();
                x = comm.recv(1).unwrap();
                assert_eq!((x.dtype(), x.dims()), (DType::BF16, &[3, 5][..]));
                assert_eq!(x.to_f64_vec().unwrap(), vec![round as f64 + 1.0; 15]);
            } else {
                let y = comm.recv(0).unwrap();
                let one = Tensor::full(1.0, [3, 5], DType::BF16, dev).unwrap();
                comm.send(&tessera::ops::add(&y, &one).unwrap(), 0).unwrap();
            }
        }
        // Messages keep their order per pair, and a strided tensor travels as its values.
        if rank == 0 {
            let m = Tensor::from_vec((0..6).map(|v| v as f64).collect(), [2, 3], dev).unwrap();
            comm.send(&m.t().unwrap(), 1).unwrap();
            comm.send(&Tensor::from_vec(vec![9.0f32], [1], dev).unwrap(), 1).unwrap();
        } else {
            let a = comm.recv(0).unwrap();
            assert_eq!(a.dims(), &[3, 2]);
            assert_eq!(a.to_vec::<f64>().unwrap(), vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
            assert_eq!(comm.recv(0).unwrap().to_vec::<f32>().unwrap(), vec![9.0]);
        }
        assert!(matches!(comm.send(&mine, rank), Err(Error::NoSuchRank { .. })), "sending to oneself is refused");
        assert!(matches!(comm.recv(2), Err(Error::NoSuchRank { .. })), "no rank 2 in a group of two");
    });
}

/// Sends started in the background arrive in the order they were started,
/// each behind the collectives started before it (which the receiver
/// joins before it receives), and a handle reports a send that could not
/// be made.
#[test]
fn background_sends_keep_their_order() {
    let world = InProcess::new(3).unwrap();
    on_every_rank(&world, |rank, comm, dev| {
        let next = (rank + 1) % 3;
        let prev = (rank + 2) % 3;
        let value = |k: usize| Tensor::from_vec(vec![(10 * rank + k) as f32; 4], [4], dev).unwrap();
        let first = comm.send_async(&value(1), next).unwrap();
        let gathered = comm.all_gather_async(&value(0), 0).unwrap();
        let second = comm.send_async(&value(2), next).unwrap();
        let third = comm.send_async(&value(3), next).unwrap();
        let got: Vec<f32> = (0..3).map(|_| comm.recv(prev).unwrap().to_vec::<f32>().unwrap()[0]).collect();
        let p = prev as f32;
        assert_eq!(got, vec![10.0 * p + 1.0, 10.0 * p + 2.0, 10.0 * p + 3.0], "rank {rank}: in the order sent");
        for s in [first, second, third] {
            s.wait().unwrap();
        }
        assert_eq!(gathered.wait().unwrap().dims(), &[12]);
        let err = comm.send_async(&value(4), rank).and_then(|p| p.wait());
        assert!(matches!(err, Err(Error::NoSuchRank { .. })), "rank {rank}: sending to oneself is refused: {err:?}");
    });
}

#[test]
fn sub_groups_run_concurrently_without_interfering() {
    // World 8 as a 4 × 2 mesh: tp groups of 2 adjacent ranks, dp groups of 4.
    let world = InProcess::new(8).unwrap();
    let tp_of = |r: usize| vec![r / 2 * 2, r / 2 * 2 + 1];
    let dp_of = |r: usize| (0..4).map(|i| r % 2 + 2 * i).collect::<Vec<_>>();
    let outs = on_threads(world.world_size(), |rank| {
        let dev = Device::cpu();
        let tp = world.tagged_group("tp", &tp_of(rank)).unwrap().communicator(rank, &dev).unwrap();
        let dp = world.tagged_group("dp", &dp_of(rank)).unwrap().communicator(rank, &dev).unwrap();
        assert_eq!((tp.rank(), tp.size(), dp.rank(), dp.size()), (rank % 2, 2, rank / 2, 4));
        let mut outs = Vec::new();
        for step in 0..6u64 {
            let x = input(rank, step, &[33], DType::F32, &dev);
            // A dp gradient all-reduce in flight while the tp group works.
            let g = dp.all_reduce_sum_async(&x).unwrap();
            let h = tp.all_reduce_sum(&x).unwrap();
            let gathered = tp.all_gather(&h, 0).unwrap();
            outs.push((g.wait().unwrap(), h, gathered));
        }
        outs
    });
    let dev = Device::cpu();
    for step in 0..6u64 {
        let x = |r: usize| input(r, step, &[33], DType::F32, &dev);
        for (rank, o) in outs.iter().enumerate() {
            let (g, h, gathered) = &o[step as usize];
            assert_bits(g, &sum_ref(&dp_of(rank).into_iter().map(x).collect::<Vec<_>>()), "dp all-reduce");
            let tp_sum = sum_ref(&tp_of(rank).into_iter().map(x).collect::<Vec<_>>());
            assert_bits(h, &tp_sum, "tp all-reduce");
            assert_bits(gathered, &[tp_sum.clone(), tp_sum].concat(), "tp all-gather");
        }
    }
}

#[test]
fn groups_are_validated() {
    let world = InProcess::new(4).unwrap();
    assert!(InProcess::new(0).is_err());
    assert!(world.group(&[]).is_err());
    assert!(world.group(&[0, 4]).is_err(), "rank 4 is outside a world of 4");
    assert!(world.group(&[1, 1]).is_err(), "a rank listed twice");
    let g = world.group(&[3, 1]).unwrap();
    assert_eq!((g.ranks(), g.size()), (&[3, 1][..], 2));
    let dev = Device::cpu();
    assert!(g.communicator(0, &dev).is_err(), "rank 0 is not a member");
    let c = g.communicator(1, &dev).unwrap();
    assert_eq!((c.rank(), c.world_rank()), (1, 1));
    assert!(world.group(&[3, 1]).unwrap().communicator(1, &dev).is_err(), "one communicator per rank and group");
}

#[test]
fn async_collectives_run_in_the_background_and_match_sync() {
    let n = 4;
    let world = InProcess::new(n).unwrap();
    on_every_rank(&world, |rank, comm, dev| {
        let buckets: Vec<Tensor> = (0..3).map(|b| input(rank, 50 + b, &[4096 + b as usize], DType::F32, dev)).collect();
        let sync: Vec<Tensor> = buckets.iter().map(|b| comm.all_reduce_sum(b).unwrap()).collect();
        let gathered = comm.all_gather(&buckets[0], 0).unwrap();
        let scattered = comm.reduce_scatter_sum(&buckets[0], 0).unwrap();
        let bcast = comm.broadcast(&buckets[1], 2).unwrap();

        // Start every bucket's all-reduce, then keep computing ("the rest of
        // the backward") before waiting; a sync call queues behind them.
        let pending: Vec<_> = buckets.iter().map(|b| comm.all_reduce_sum_async(b).unwrap()).collect();
        let g2 = comm.all_gather_async(&buckets[0], 0).unwrap();
        let a = Tensor::full(0.5, [64, 64], DType::F32, dev).unwrap();
        let mut acc = a.clone();
        for _ in 0..8 {
            acc = tessera::ops::matmul(&acc, &a).unwrap();
        }
        let rs = comm.reduce_scatter_sum(&buckets[0], 0).unwrap();
        let b2 = comm.broadcast_async(&buckets[1], 2).unwrap();
        comm.barrier_async().unwrap().wait().unwrap();
        // Waited for out of order: each handle still gets its own result.
        assert_eq!(bits(&b2.wait().unwrap()), bits(&bcast));
        assert_eq!(bits(&g2.wait().unwrap()), bits(&gathered));
        for (p, s) in pending.into_iter().rev().zip(sync.iter().rev()) {
            assert_eq!(bits(&p.wait().unwrap()), bits(s), "async all-reduce equals sync");
        }
        assert_eq!(bits(&rs), bits(&scattered));
        assert!(acc.to_f32_vec().unwrap().iter().all(|v| v.is_finite()));
    });
}

#[test]
fn an_async_collective_progresses_while_its_caller_never_calls_in() {
    // Rank 0 starts an all-reduce and only polls `is_done`: the collective
    // can only complete if it really runs on a background thread.
    let world = InProcess::new(2).unwrap();
    let outs = on_every_rank(&world, |rank, comm, dev| {
        let x = input(rank, 60, &[1000], DType::F32, dev);
        if rank == 0 {
            let p = comm.all_reduce_sum_async(&x).unwrap();
            let start = Instant::now();
            let mut spins = 0u64;
            while !p.is_done() {
                assert!(start.elapsed() < Duration::from_secs(5), "the async all-reduce made no progress");
                spins += 1;
                thread::yield_now();
            }
            assert!(p.is_done(), "stays done");
            let _ = spins;
            p.wait().unwrap()
        } else {
            thread::sleep(Duration::from_millis(50));
            comm.all_reduce_sum(&x).unwrap()
        }
    });
    assert_eq!(bits(&outs[0]), bits(&outs[1]));
}

#[test]
fn received_tensors_are_counted_on_the_receivers_device() {
    let world = InProcess::new(2).unwrap();
    on_every_rank(&world, |rank, comm, dev| {
        let x = input(rank, 70, &[1000], DType::F32, dev);
        comm.barrier().unwrap();
        let base = dev.memory_stats().in_use;
        let y = comm.all_reduce_sum(&x).unwrap();
        // Once every rank is past the all-reduce, the temporaries (the summed
        // chunk the peer read) are freed: only the result remains.
        comm.barrier().unwrap();
        assert_eq!(dev.memory_stats().in_use, base + 4000, "rank {rank}: all-reduce result");
        let g = comm.all_gather(&x, 0).unwrap();
        comm.barrier().unwrap();
        assert_eq!(dev.memory_stats().in_use, base + 4000 + 8000, "rank {rank}: all-gather result");
        drop((y, g));
        comm.barrier().unwrap();
        if rank == 0 {
            comm.send(&x, 1).unwrap();
            comm.barrier().unwrap();
            assert_eq!(dev.memory_stats().in_use, base, "the sender keeps no copy");
        } else {
            comm.barrier().unwrap();
            assert_eq!(dev.memory_stats().in_use, base + 4000, "a message in flight is counted at its receiver");
            let m = comm.recv(0).unwrap();
            assert_eq!(dev.memory_stats().in_use, base + 4000);
            drop(m);
            assert_eq!(dev.memory_stats().in_use, base);
        }
    });
}

/// [`on_every_rank`] where ranks may panic: each rank's result, or `None`
/// where its thread panicked.
fn on_every_rank_fallible<R: Send>(world: &InProcess, f: impl Fn(usize, InProcessComm, &Device) -> R + Sync) -> Vec<Option<R>> {
    thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = (0..world.world_size())
            .map(|rank| {
                s.spawn(move || {
                    let dev = Device::cpu();
                    f(rank, world.communicator(rank, &dev).unwrap(), &dev)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().ok()).collect()
    })
}

#[test]
fn a_rank_that_panics_mid_step_fails_its_peers_fast() {
    let world = InProcess::new(4).unwrap(); // the default 60 s timeout
    let start = Instant::now();
    let outs = on_every_rank_fallible(&world, |rank, comm, dev| {
        let x = input(rank, 80, &[64], DType::F32, dev);
        for step in 0..100 {
            if rank == 3 && step == 2 {
                panic!("rank 3 fails on purpose in step 2");
            }
            if let Err(e) = comm.all_reduce_sum(&x) {
                return (step, e);
            }
        }
        unreachable!("the step loop cannot finish without rank 3");
    });
    assert!(start.elapsed() < Duration::from_secs(5), "peers noticed the panic well within the timeout");
    assert!(outs[3].is_none());
    for out in &outs[..3] {
        let (step, e) = out.as_ref().expect("survivors return an error");
        assert_eq!(*step, 2);
        match e {
            Error::PeerFailed { rank: 3, reason } => assert!(reason.contains("panicked"), "{reason}"),
            other => panic!("expected PeerFailed from rank 3, got {other}"),
        }
    }
    // The world stays stopped: a late call fails at once too.
    assert!(matches!(world.check(), Err(Error::PeerFailed { rank: 3, .. })));
}

#[test]
fn abort_stops_pending_and_later_calls_on_every_rank() {
    let world = InProcess::new(3).unwrap();
    let start = Instant::now();
    let outs = on_every_rank(&world, |rank, comm, dev| {
        let x = input(rank, 90, &[8], DType::F32, dev);
        if rank == 1 {
            thread::sleep(Duration::from_millis(30));
            comm.abort("out of memory in the optimizer step");
        }
        // Ranks 0 and 2 are already waiting (a pending async call and a sync one).
        let pending = comm.all_reduce_sum_async(&x).unwrap();
        let later = comm.barrier();
        (pending.wait(), later, comm.recv((rank + 1) % 3))
    });
    assert!(start.elapsed() < Duration::from_secs(5));
    for (a, b, c) in outs {
        for e in [a.unwrap_err(), b.unwrap_err(), c.unwrap_err()] {
            let msg = e.to_string();
            assert!(matches!(e, Error::PeerFailed { rank: 1, .. }), "{msg}");
            assert!(msg.contains("out of memory in the optimizer step"), "{msg}");
        }
    }
}

#[test]
fn a_rank_that_never_arrives_times_out() {
    let world = InProcess::with_timeout(2, Duration::from_millis(300)).unwrap();
    let (tx, rx) = mpsc::channel::<()>();
    let rx = std::sync::Mutex::new(rx);
    let outs = on_every_rank(&world, |rank, comm, dev| {
        let x = input(rank, 100, &[8], DType::F32, dev);
        if rank == 0 {
            let start = Instant::now();
            let e = comm.all_reduce_sum(&x).unwrap_err();
            let took = start.elapsed();
            tx.send(()).unwrap();
            (e, took)
        } else {
            // Alive, holding its communicator, but never calling the collective.
            rx.lock().unwrap().recv().unwrap();
            let start = Instant::now();
            (comm.all_reduce_sum(&x).unwrap_err(), start.elapsed())
        }
    });
    let (e0, took0) = &outs[0];
    match e0 {
        Error::Timeout { op, waited, detail } => {
            assert_eq!(*op, "all_reduce_sum");
            assert!(*waited >= Duration::from_millis(300) && *took0 < Duration::from_secs(2));
            assert!(detail.contains("[1]"), "names the missing rank: {detail}");
        }
        other => panic!("expected a timeout, got {other}"),
    }
    // The late rank learns at once that its peer gave up.
    let (e1, took1) = &outs[1];
    assert!(matches!(e1, Error::PeerFailed { rank: 0, .. }), "{e1}");
    assert!(*took1 < Duration::from_secs(1), "a late call fails at once, not after its own timeout");
}

#[test]
fn recv_from_a_silent_peer_times_out() {
    let world = InProcess::with_timeout(2, Duration::from_millis(200)).unwrap();
    let outs = on_every_rank(&world, |rank, comm, _| {
        if rank == 0 {
            Some(comm.recv(1).unwrap_err())
        } else {
            thread::sleep(Duration::from_millis(400));
            None
        }
    });
    assert!(matches!(&outs[0], Some(Error::Timeout { op: "recv", .. })), "{:?}", outs[0]);
}

#[test]
fn a_dropped_communicator_fails_the_peers_waiting_for_it() {
    let world = InProcess::new(3).unwrap();
    let start = Instant::now();
    let outs = on_every_rank(&world, |rank, comm, dev| {
        let x = input(rank, 110, &[8], DType::F32, dev);
        comm.all_reduce_sum(&x).unwrap();
        if rank == 2 {
            drop(comm);
            return None;
        }
        Some(comm.all_reduce_sum(&x).unwrap_err())
    });
    assert!(start.elapsed() < Duration::from_secs(5));
    for e in outs[..2].iter().map(|o| o.as_ref().unwrap()) {
        assert!(matches!(e, Error::PeerFailed { rank: 2, reason } if reason.contains("dropped")), "{e}");
    }
}

#[test]
fn mismatched_calls_are_errors_on_every_rank_not_hangs() {
    let world = InProcess::new(2).unwrap();
    let start = Instant::now();
    on_every_rank(&world, |rank, comm, dev| {
        let x = input(rank, 120, &[4, 6], DType::F32, dev);
        // Different collectives.
        let e = if rank == 0 { comm.all_reduce_sum(&x) } else { comm.all_gather(&x, 0) }.unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, Error::CollectiveMismatch { .. }), "{msg}");
        assert!(msg.contains("all_reduce_sum") && msg.contains("all_gather"), "{msg}");
        // Same collective, different shapes, dtypes or arguments.
        let y = input(rank, 120, &[4, 6 + rank], DType::F32, dev);
        assert!(matches!(comm.all_reduce_sum(&y), Err(Error::CollectiveMismatch { .. })));
        let z = input(rank, 120, &[4, 6], if rank == 0 { DType::F32 } else { DType::BF16 }, dev);
        assert!(matches!(comm.all_gather(&z, 1), Err(Error::CollectiveMismatch { .. })));
        assert!(matches!(comm.all_gather(&x, rank), Err(Error::CollectiveMismatch { .. })));
        assert!(matches!(comm.broadcast(&x, rank), Err(Error::CollectiveMismatch { .. })));
        // One rank's invalid arguments: its own error there, a mismatch on the peer.
        let w = input(rank, 120, &[3 + rank, 2], DType::F32, dev);
        match (rank, comm.reduce_scatter_sum(&w, 0)) {
            (0, Err(Error::Shape { .. })) | (1, Err(Error::CollectiveMismatch { .. })) => {}
            (r, other) => panic!("rank {r}: unexpected {other:?}"),
        }
        let parts = vec![x.clone(); 1 + rank];
        match (rank, comm.all_to_all(parts)) {
            (0, Err(Error::InvalidArgument { .. })) | (1, Err(Error::CollectiveMismatch { .. })) => {}
            (r, other) => panic!("rank {r}: unexpected {other:?}"),
        }
        // The group stays usable: the next matched call works.
        let s = comm.all_reduce_sum(&x).unwrap();
        assert_eq!(s.dims(), &[4, 6]);
    });
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[test]
fn single_rank_is_the_identity() {
    let dev = Device::cpu();
    let c = SingleRank;
    let x = input(0, 130, &[5], DType::F32, &dev);
    assert_eq!(bits(&c.all_reduce_sum(&x).unwrap()), bits(&x));
    assert_eq!(bits(&c.all_reduce_sum_async(&x).unwrap().wait().unwrap()), bits(&x));
    let p = c.all_gather_async(&x, 0).unwrap();
    assert!(p.is_done());
    assert_eq!(bits(&p.wait().unwrap()), bits(&x));
    assert_eq!(bits(&c.reduce_scatter_sum_async(&x, 0).unwrap().wait().unwrap()), bits(&x));
    assert_eq!(bits(&c.broadcast_async(&x, 0).unwrap().wait().unwrap()), bits(&x));
    assert_eq!(c.all_to_all_async(vec![x.clone()]).unwrap().wait().unwrap().len(), 1);
    c.barrier_async().unwrap().wait().unwrap();
    assert!(c.send(&x, 0).is_err() && c.recv(0).is_err());
    assert!(c.broadcast(&x, 1).is_err());
}

#[test]
fn a_world_of_one_rank_works_like_single_rank() {
    let world = InProcess::new(1).unwrap();
    let dev = Device::cpu();
    let c = world.communicator(0, &dev).unwrap();
    let x = input(0, 140, &[2, 3], DType::BF16, &dev);
    assert_eq!(bits(&c.all_reduce_sum(&x).unwrap()), bits(&x));
    assert_eq!(bits(&c.all_gather(&x, 1).unwrap()), bits(&x));
    assert_eq!(bits(&c.reduce_scatter_sum_async(&x, 0).unwrap().wait().unwrap()), bits(&x));
    c.barrier().unwrap();
}

/// The thread that runs a communicator's background collectives asks Linux
/// for the shortest slice (0.1 ms), so that it gets a core soon after it
/// wakes beside the ranks' products. Kernels before 6.12 have no per-thread
/// slice (the request is ignored there) and the test says so.
#[cfg(target_os = "linux")]
#[test]
fn communication_threads_ask_for_a_short_slice() {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let version: Vec<u32> = release.trim().split(['.', '-']).take(2).map(|p| p.parse().unwrap_or(0)).collect();
    if version.len() < 2 || (version[0], version[1]) < (6, 12) {
        println!("skipped: Linux {} has no per-thread slice", release.trim());
        return;
    }
    let slice_of = |comm: &str| -> Option<u64> {
        for task in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
            if std::fs::read_to_string(task.path().join("comm")).ok()?.trim() == comm {
                let sched = std::fs::read_to_string(task.path().join("sched")).ok()?;
                let line = sched.lines().find(|l| l.starts_with("se.slice"))?;
                return line.split(':').nth(1)?.trim().parse().ok();
            }
        }
        None
    };
    let world = InProcess::new(2).unwrap();
    let slices = on_every_rank(&world, |rank, comm, dev| {
        // A background collective starts the communicator's thread.
        let x = Tensor::from_vec(vec![rank as f32; 4], [4], dev).unwrap();
        comm.all_reduce_sum_async(&x).unwrap().wait().unwrap();
        let slice = slice_of(&format!("tessera-comm-{rank}"));
        comm.barrier().unwrap();
        slice
    });
    if slices.iter().all(Option::is_none) && std::fs::read_to_string("/proc/self/sched").is_ok_and(|s| !s.contains("se.slice")) {
        println!("skipped: this kernel does not show a thread's slice");
        return;
    }
    assert_eq!(slices, vec![Some(100_000); 2], "each rank's communication thread's slice, in ns");
}
