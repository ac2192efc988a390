//! The NCCL communicator against the in-process CPU communicator: the same
//! inputs through every collective, on one rank per GPU, compared within the
//! dtype's tolerance (NCCL sums in the tensor's dtype, in its own order).
//!
//! The multi-rank tests need as many GPUs as ranks and report
//! `skipped: needs N CUDA devices` where there are fewer (`skipped: no CUDA
//! device` where there is none); the one-rank tests run on a single GPU.
//! The argument checks that need no GPU run everywhere.

#![cfg(feature = "cuda")]

mod common;

use common::models::GptBlock;
use common::{assert_close, rand_vec};
use std::sync::Arc;
use tessera::backend::cuda::report_skip;
use tessera::dist::inproc::InProcess;
use tessera::dist::mesh::Mesh;
use tessera::dist::nccl::{self, NcclCommunicator};
use tessera::dist::Communicator;
use tessera::module::{self, Act, Cx, Groups, Module};
use tessera::parallel::data::{DataParallel, SyncStats};
use tessera::{bf16, f16, ops, DType, Device, Error, Init, Result, RngKey, Tensor};
use tessera_comm_harness::on_threads;

const DTYPES: [DType; 4] = [DType::F32, DType::F64, DType::BF16, DType::F16];

/// `n` CUDA devices and the NCCL group over them, or `None` after reporting
/// why the test cannot run here.
fn group_or_skip(test: &str, n: usize) -> Option<(Vec<Device>, Vec<NcclCommunicator>)> {
    let mut devices = Vec::new();
    for i in 0..n {
        match Device::cuda(i) {
            Ok(d) => devices.push(d),
            Err(e) if i == 0 => {
                report_skip(test, &format!("no CUDA device: {e}"));
                return None;
            }
            Err(e) => {
                report_skip(test, &format!("needs {n} CUDA devices: {e}"));
                return None;
            }
        }
    }
    match NcclCommunicator::group(&devices) {
        Ok(comms) => Some((devices, comms)),
        Err(e @ Error::NcclUnavailable { .. }) => {
            report_skip(test, &format!("no NCCL library: {e}"));
            None
        }
        Err(e) => panic!("creating the NCCL group failed: {e}"),
    }
}

/// Rank `rank`'s input for case `case`, on the CPU: reproducible values in
/// `[-1, 1)` of `dtype`.
fn input(rank: usize, case: u64, dims: &[usize], dtype: DType) -> Tensor {
    Tensor::rand(Init::Uniform { lo: -1.0, hi: 1.0 }, RngKey::new(7000 + rank as u64, case), dims, dtype, &Device::cpu()).unwrap()
}

/// A copy of the CPU tensor `t` on `dev`, with the same bits.
fn to_device(t: &Tensor, dev: &Device) -> Tensor {
    match t.dtype() {
        DType::F32 => Tensor::from_vec(t.to_vec::<f32>().unwrap(), t.dims(), dev),
        DType::F64 => Tensor::from_vec(t.to_vec::<f64>().unwrap(), t.dims(), dev),
        DType::BF16 => Tensor::from_vec(t.to_vec::<bf16>().unwrap(), t.dims(), dev),
        DType::F16 => Tensor::from_vec(t.to_vec::<f16>().unwrap(), t.dims(), dev),
        other => panic!("no test inputs of {other}"),
    }
    .unwrap()
}

/// The elements of `t` (on any device) as `f64`, read as its own dtype.
fn host(t: &Tensor) -> Vec<f64> {
    match t.dtype() {
        DType::F32 => t.to_vec::<f32>().unwrap().into_iter().map(f64::from).collect(),
        DType::F64 => t.to_vec::<f64>().unwrap(),
        DType::BF16 => t.to_vec::<bf16>().unwrap().into_iter().map(f64::from).collect(),
        DType::F16 => t.to_vec::<f16>().unwrap().into_iter().map(f64::from).collect(),
        other => panic!("no test outputs of {other}"),
    }
}

/// A rank's result: its dims and elements.
type Got = (Vec<usize>, Vec<f64>);

/// What the in-process CPU communicator gives each rank for `call` on `inputs`.
fn reference(inputs: &[Tensor], call: &(dyn Fn(&dyn Communicator, &Tensor) -> Result<Tensor> + Sync)) -> Vec<Got> {
    let world = InProcess::new(inputs.len()).unwrap();
    let cpu = Device::cpu();
    on_threads(inputs.len(), |r| {
        let comm = world.communicator(r, &cpu).unwrap();
        let out = call(&comm, &inputs[r]).unwrap();
        (out.dims().to_vec(), host(&out))
    })
}

/// What the group `comms` gives each rank for `call` on `inputs` (copied to the ranks' devices).
fn on_devices<C: Communicator>(
    devices: &[Device],
    comms: &[C],
    inputs: &[Tensor],
    call: &(dyn Fn(&dyn Communicator, &Tensor) -> Result<Tensor> + Sync),
) -> Vec<Got> {
    on_threads(devices.len(), |r| {
        let x = to_device(&inputs[r], &devices[r]);
        let out = call(&comms[r], &x).unwrap();
        assert_eq!(out.device().to_string(), devices[r].to_string(), "a rank's result lives on its own device");
        (out.dims().to_vec(), host(&out))
    })
}

/// Agreement relative to the largest magnitude of the expected values.
fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-6,
        DType::F64 => 1e-12,
        DType::BF16 => 1e-2,
        _ => 2e-3,
    }
}

#[track_caller]
fn assert_agree(got: &[Got], want: &[Got], dtype: DType, what: &str) {
    for (r, ((gd, gv), (wd, wv))) in got.iter().zip(want).enumerate() {
        assert_eq!(gd, wd, "{what}, rank {r}: dims");
        let scale = wv.iter().fold(1e-30f64, |m, v| m.max(v.abs()));
        let worst = gv.iter().zip(wv).map(|(g, w)| (g - w).abs() / scale).fold(0.0, f64::max);
        assert!(worst <= tolerance(dtype), "{what}, rank {r}: relative error {worst:e} over {}", tolerance(dtype));
    }
    // Every rank of a reduction receives the same values.
    if got.iter().all(|(d, _)| *d == got[0].0) && what.starts_with("all_reduce") {
        assert!(got.iter().all(|g| g.1 == got[0].1), "{what}: ranks received different sums");
    }
}

/// Every collective of the trait, every float dtype and every dim, through
/// `comms` (NCCL on GPUs) and through the in-process communicator.
fn check_every_collective<C: Communicator>(devices: &[Device], comms: &[C]) {
    let n = devices.len();
    for (case, dtype) in DTYPES.into_iter().enumerate() {
        let case = case as u64 * 100;
        let compare = |dims: &[usize], sub: u64, what: &str, call: &(dyn Fn(&dyn Communicator, &Tensor) -> Result<Tensor> + Sync)| {
            let inputs: Vec<Tensor> = (0..n).map(|r| input(r, case + sub, dims, dtype)).collect();
            let want = reference(&inputs, call);
            let got = on_devices(devices, comms, &inputs, call);
            assert_agree(&got, &want, dtype, &format!("{what} {dtype} {dims:?}"));
        };
        compare(&[3, 5, 7], 1, "all_reduce_sum", &|c, t| c.all_reduce_sum(t));
        compare(&[3, 5, 7], 2, "all_reduce_sum_async", &|c, t| c.all_reduce_sum_async(t)?.wait());
        compare(&[2, 3, 4], 3, "all_gather_async dim 1", &|c, t| c.all_gather_async(t, 1)?.wait());
        compare(&[2, 3 * n, 4], 4, "reduce_scatter_sum_async dim 1", &|c, t| c.reduce_scatter_sum_async(t, 1)?.wait());
        compare(&[4, 6], 5, "broadcast_async root 0", &|c, t| c.broadcast_async(t, 0)?.wait());
        for dim in 0..3 {
            compare(&[2, 3, 4], 10 + dim as u64, &format!("all_gather dim {dim}"), &move |c, t| c.all_gather(t, dim));
            compare(&[2 * n, 3 * n, n], 20 + dim as u64, &format!("reduce_scatter_sum dim {dim}"), &move |c, t| c.reduce_scatter_sum(t, dim));
        }
        for root in [0, n - 1] {
            compare(&[4, 6], 30 + root as u64, &format!("broadcast root {root}"), &move |c, t| c.broadcast(t, root));
        }
        // A strided view is made contiguous before it is sent.
        compare(&[4, 6], 40, "all_gather of a transposed view", &|c, t| c.all_gather(&t.t()?, 1));
        compare(&[6, 2 * n], 41, "all_reduce_sum of a transposed view", &|c, t| c.all_reduce_sum(&t.t()?));
        // Uneven parts: rank r sends rank p a [r + 1, p + 2] part (the one to itself too).
        let parts_of = |r: usize| -> Vec<Tensor> { (0..n).map(|p| input(r, case + 50 + p as u64, &[r + 1, p + 2], dtype)).collect() };
        let world = InProcess::new(n).unwrap();
        let cpu = Device::cpu();
        let want = on_threads(n, |r| world.communicator(r, &cpu).unwrap().all_to_all(parts_of(r)).unwrap());
        let got = on_threads(n, |r| comms[r].all_to_all(parts_of(r).iter().map(|t| to_device(t, &devices[r])).collect()).unwrap());
        for (r, (got, want)) in got.iter().zip(&want).enumerate() {
            assert_eq!(got.len(), n, "all_to_all: rank {r} receives one part per rank");
            for (s, (g, w)) in got.iter().zip(want).enumerate() {
                assert_eq!(g.device().to_string(), devices[r].to_string());
                assert_agree(&[(g.dims().to_vec(), host(g))], &[(w.dims().to_vec(), host(w))], dtype, &format!("all_to_all {dtype}: rank {r} from {s}"));
            }
        }
    }
    on_threads(n, |r| comms[r].barrier().unwrap());
}

/// The comparison itself, checked where there is no GPU: the in-process
/// communicator of CPU ranks against itself must pass it.
#[test]
fn the_comparison_passes_for_the_in_process_communicator_on_cpu_ranks() {
    let world = InProcess::new(2).unwrap();
    let devices = [Device::cpu(), Device::cpu()];
    let comms: Vec<_> = devices.iter().enumerate().map(|(r, d)| world.communicator(r, d).unwrap()).collect();
    check_every_collective(&devices, &comms);
}

#[test]
fn every_collective_on_one_gpu_matches_the_in_process_communicator() {
    let Some((devices, comms)) = group_or_skip("every_collective_on_one_gpu_matches_the_in_process_communicator", 1) else { return };
    assert_eq!((comms[0].rank(), comms[0].size()), (0, 1));
    check_every_collective(&devices, &comms);
}

#[test]
fn every_collective_on_two_gpus_matches_the_in_process_communicator() {
    let Some((devices, comms)) = group_or_skip("every_collective_on_two_gpus_matches_the_in_process_communicator", 2) else { return };
    assert_eq!(comms.iter().map(|c| (c.rank(), c.size())).collect::<Vec<_>>(), [(0, 2), (1, 2)]);
    check_every_collective(&devices, &comms);
}

#[test]
fn bad_arguments_on_a_gpu_are_errors_naming_the_fix() {
    let Some((devices, comms)) = group_or_skip("bad_arguments_on_a_gpu_are_errors_naming_the_fix", 1) else { return };
    let comm = &comms[0];
    let host_tensor = Tensor::zeros([4], DType::F32, &Device::cpu()).unwrap();
    let e = comm.all_reduce_sum(&host_tensor).unwrap_err();
    assert!(matches!(e, Error::Placement { .. }) && e.to_string().contains("cuda:0"), "{e}");
    let x = Tensor::zeros([2, 3], DType::F32, &devices[0]).unwrap();
    let e = comm.all_gather(&x, 2).unwrap_err();
    assert!(e.to_string().contains("dim 2 is out of range"), "{e}");
    let e = comm.broadcast(&x, 1).unwrap_err();
    assert!(e.to_string().contains("root 1"), "{e}");
    let e = comm.all_to_all(vec![x.clone(), x.clone()]).unwrap_err();
    assert!(e.to_string().contains("takes exactly 1"), "{e}");
    let e = comm.send(&x, 0).unwrap_err();
    assert!(matches!(e, Error::NoSuchRank { .. }) && e.to_string().contains("itself"), "{e}");
    let e = comm.recv(3).unwrap_err();
    assert!(e.to_string().contains("peer 3"), "{e}");
    // The communicator still works after refusing those calls.
    assert_eq!(host(&comm.all_reduce_sum(&x).unwrap()), vec![0.0; 6]);
}

#[test]
fn abort_stops_the_group_with_a_typed_error() {
    let Some((devices, comms)) = group_or_skip("abort_stops_the_group_with_a_typed_error", 1) else { return };
    let x = Tensor::zeros([3], DType::F32, &devices[0]).unwrap();
    comms[0].abort("a test gave up");
    let e = comms[0].all_reduce_sum(&x).unwrap_err();
    assert!(matches!(&e, Error::PeerFailed { rank: 0, reason } if reason.contains("a test gave up")), "{e}");
    assert!(matches!(comms[0].barrier().unwrap_err(), Error::PeerFailed { rank: 0, .. }));
}

#[test]
fn mesh_groups_on_two_gpus_reduce_along_each_axis() {
    let Some((devices, comms)) = group_or_skip("mesh_groups_on_two_gpus_reduce_along_each_axis", 2) else { return };
    drop(comms);
    for (spec, dp, tp) in [("dp2", 2, 1), ("tp2", 1, 2)] {
        let mesh = Mesh::parse(spec, 2, 2).unwrap();
        let groups = nccl::mesh_groups(&mesh, &devices).unwrap();
        let sums = on_threads(2, |r| {
            let g = &groups[r];
            assert_eq!((g.dp.size(), g.tp.size(), g.pp.size(), g.ep.size()), (dp, tp, 1, 1), "{spec}");
            let x = Tensor::from_vec(vec![r as f32 + 1.0; 4], [4], &devices[r]).unwrap();
            let along = if dp == 2 { &g.dp } else { &g.tp };
            (along.all_reduce_sum(&x).unwrap().to_vec::<f32>().unwrap(), g.pp.all_reduce_sum(&x).unwrap().to_vec::<f32>().unwrap())
        });
        for (r, (sum, own)) in sums.into_iter().enumerate() {
            assert_eq!(sum, vec![3.0; 4], "{spec}: rank {r} sums over its group");
            assert_eq!(own, vec![r as f32 + 1.0; 4], "{spec}: a one-rank axis returns the input");
        }
    }
}

#[test]
fn groups_of_no_device_or_of_cpu_devices_are_refused() {
    let e = NcclCommunicator::group(&[]).unwrap_err();
    assert!(e.to_string().contains("at least one device"), "{e}");
    let e = NcclCommunicator::group(&[Device::cpu()]).unwrap_err();
    assert!(matches!(e, Error::Topology { .. }) && e.to_string().contains("in-process communicator"), "{e}");
    let mesh = Mesh::parse("dp2", 2, 2).unwrap();
    let e = nccl::mesh_groups(&mesh, &[Device::cpu()]).unwrap_err();
    assert!(e.to_string().contains("2 ranks but 1 devices"), "{e}");
    let e = nccl::mesh_groups(&mesh, &[Device::cpu(), Device::cpu()]).unwrap_err();
    assert!(e.to_string().contains("NCCL connects CUDA devices"), "{e}");
}

/// An asynchronous all-reduce leaves the compute stream free, so the
/// buffers it reads must outlive the caller's handles: the input is dropped
/// and its memory churned by new tensors while the collective may still
/// run, and the sums must still be right.
#[test]
fn an_async_all_reduce_keeps_its_input_alive_until_waited_for() {
    let Some((devices, comms)) = group_or_skip("an_async_all_reduce_keeps_its_input_alive_until_waited_for", 1) else { return };
    let dev = &devices[0];
    let n = 1 << 20;
    let x = Tensor::from_vec(vec![1.5f32; n], [n], dev).unwrap();
    let pending = comms[0].all_reduce_sum_async(&x).unwrap();
    drop(x);
    let churn: Vec<Tensor> = (0..4).map(|i| Tensor::from_vec(vec![i as f32 - 9.0; n], [n], dev).unwrap()).collect();
    let sum = pending.wait().unwrap();
    assert!(host(&sum).iter().all(|&v| v == 1.5), "the all-reduce read a buffer reused by later work");
    assert_eq!(host(&churn[3])[0], -6.0);
    // A handle dropped without waiting still orders the device's later work
    // after the collective, so its buffers are not reused under it.
    let y = Tensor::from_vec(vec![2.0f32; n], [n], dev).unwrap();
    drop(comms[0].all_reduce_sum_async(&y).unwrap());
    drop(y);
    let z = Tensor::from_vec(vec![3.0f32; n], [n], dev).unwrap();
    assert!(host(&comms[0].all_reduce_sum(&z).unwrap()).iter().all(|&v| v == 3.0));
}

/// One data-parallel step of a GPT block in f32, rank `r` on `devices[r]`
/// with the data-parallel group `comms[r]`: every rank's averaged gradients
/// (in parameter order) and sync figures.
fn dp_step(devices: &[Device], comms: &[Arc<dyn Communicator>]) -> Vec<(Vec<Vec<f64>>, SyncStats)> {
    let n = devices.len();
    let (per, t, d) = (2, 3, 8);
    let x = rand_vec(1, n * per * t * d);
    let dy = rand_vec(2, n * per * t * d);
    on_threads(n, |r| {
        let dev = &devices[r];
        let mut groups = Groups::single();
        groups.dp = comms[r].clone();
        let cx = Cx::new(dev.clone()).with_dtype(DType::F32).with_seed(7).with_groups(groups);
        let block = module::build(GptBlock::new(d, 2).unwrap(), &cx).unwrap();
        // Small buckets: several all-reduces, launched during the backward.
        let sync = Arc::new(DataParallel::new(&block, comms[r].clone(), 512).unwrap());
        let mut cx = cx.with_hooks(sync.clone());
        // Rank r's share of the batch; its upstream gradient is scaled by the
        // number of ranks, so that the average is the whole batch's.
        let share = |v: &[f64], scale: f64| -> Vec<f32> { v[r * per * t * d..(r + 1) * per * t * d].iter().map(|&e| (e * scale) as f32).collect() };
        let xr = Tensor::from_vec(share(&x, 1.0), [per, t, d], dev).unwrap();
        let (y, saved) = block.forward(&mut cx, Act::new(xr)).unwrap();
        let dyr = Tensor::from_vec(share(&dy, n as f64), y.tensor().shape().clone(), dev).unwrap();
        block.backward(&mut cx, saved, Act::new(dyr)).unwrap();
        let stats = sync.finish().unwrap();
        let mut grads = Vec::new();
        module::visit_params(&block, |e| {
            grads.push(host(&e.param.grad().expect("every parameter has a gradient")));
            Ok(())
        })
        .unwrap();
        (grads, stats)
    })
}

/// Data parallelism over NCCL: buckets all-reduced on the communication
/// stream while the backward runs give every rank the gradients CPU ranks
/// get from the in-process communicator.
fn check_data_parallel(devices: Vec<Device>, comms: Vec<NcclCommunicator>) {
    let n = devices.len();
    let world = InProcess::new(n).unwrap();
    let cpus: Vec<Device> = (0..n).map(|_| Device::cpu()).collect();
    let cpu_comms: Vec<Arc<dyn Communicator>> =
        cpus.iter().enumerate().map(|(r, d)| Arc::new(world.communicator(r, d).unwrap()) as Arc<dyn Communicator>).collect();
    let want = dp_step(&cpus, &cpu_comms);
    let gpu_comms: Vec<Arc<dyn Communicator>> = comms.into_iter().map(|c| Arc::new(c) as Arc<dyn Communicator>).collect();
    let got = dp_step(&devices, &gpu_comms);
    for (r, ((g, stats), (w, _))) in got.iter().zip(&want).enumerate() {
        assert!(stats.buckets >= 3 && stats.launched_during_backward == stats.buckets, "rank {r}: {stats:?}");
        for (i, (g, w)) in g.iter().zip(w).enumerate() {
            assert_close(g, w, 1e-4, 1e-3, &format!("rank {r}: gradient of parameter {i}"));
        }
    }
}

/// The data-parallel harness itself, where there is no GPU: on two CPU
/// ranks the step makes several buckets and both ranks end with the same
/// gradients.
#[test]
fn the_data_parallel_step_runs_on_cpu_ranks() {
    let world = InProcess::new(2).unwrap();
    let cpus = [Device::cpu(), Device::cpu()];
    let comms: Vec<Arc<dyn Communicator>> =
        cpus.iter().enumerate().map(|(r, d)| Arc::new(world.communicator(r, d).unwrap()) as Arc<dyn Communicator>).collect();
    let got = dp_step(&cpus, &comms);
    assert!(got[0].1.buckets >= 3, "{:?}", got[0].1);
    assert_eq!(got[0].0, got[1].0, "the replicas' averaged gradients agree");
    assert!(got[0].0.iter().flatten().any(|&g| g != 0.0));
}

#[test]
fn data_parallel_on_one_gpu_matches_cpu_ranks() {
    let Some((devices, comms)) = group_or_skip("data_parallel_on_one_gpu_matches_cpu_ranks", 1) else { return };
    check_data_parallel(devices, comms);
}

#[test]
fn data_parallel_on_two_gpus_matches_cpu_ranks() {
    let Some((devices, comms)) = group_or_skip("data_parallel_on_two_gpus_matches_cpu_ranks", 2) else { return };
    check_data_parallel(devices, comms);
}

/// Messages between two GPUs: both ranks send before they receive (a
/// rendezvous would deadlock), messages arrive in the order sent with their
/// shape, dtype and bits, and the sender may overwrite its tensor at once.
#[test]
fn send_and_recv_between_two_gpus_are_buffered_and_ordered() {
    let Some((devices, comms)) = group_or_skip("send_and_recv_between_two_gpus_are_buffered_and_ordered", 2) else { return };
    let got = on_threads(2, |r| {
        let peer = 1 - r;
        let dev = &devices[r];
        let first = to_device(&input(r, 900, &[3, 5], DType::BF16), dev);
        let second = to_device(&input(r, 901, &[7], DType::F32), dev);
        comms[r].send(&first, peer).unwrap();
        comms[r].send(&second, peer).unwrap();
        // Overwritten right after sending: the messages hold copies.
        ops::axpy(&second, 5.0, &Tensor::from_vec(vec![1.0f32; 7], [7], dev).unwrap()).unwrap();
        let a = comms[r].recv(peer).unwrap();
        let b = comms[r].recv(peer).unwrap();
        assert_eq!(a.device().to_string(), dev.to_string());
        ((a.dtype(), a.dims().to_vec(), host(&a)), (b.dtype(), b.dims().to_vec(), host(&b)))
    });
    for (r, (a, b)) in got.into_iter().enumerate() {
        let peer = 1 - r;
        assert_eq!(a, (DType::BF16, vec![3, 5], host(&input(peer, 900, &[3, 5], DType::BF16))), "rank {r}: first message");
        assert_eq!(b, (DType::F32, vec![7], host(&input(peer, 901, &[7], DType::F32))), "rank {r}: second message");
    }
    // A receiver waiting for a message that never comes is released by an abort.
    let e = on_threads(2, |r| {
        if r == 0 {
            comms[0].recv(1).unwrap_err().to_string()
        } else {
            std::thread::sleep(std::time::Duration::from_millis(100));
            comms[1].abort("gave up");
            String::new()
        }
    });
    assert!(e[0].contains("gave up"), "{}", e[0]);
}

/// Ranks of `n` processes on one machine, as threads: each with its own
/// rendezvous (rank 0 serving the store) and its own connections, as
/// separate processes would have.
fn process_ranks(n: usize, timeout: std::time::Duration) -> Vec<(tessera::dist::store::Rendezvous, tessera::dist::process::ProcessWorld)> {
    use tessera::dist::env::{Launcher, ProcessEnv};
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    on_threads(n, |rank| {
        let env = ProcessEnv {
            rank,
            world_size: n,
            local_rank: rank,
            local_world_size: n,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: port,
            restart: 0,
            launcher: Launcher::Torchrun,
        };
        let rdzv = tessera::dist::store::Rendezvous::join(&env, timeout).unwrap();
        let world = tessera::dist::process::ProcessWorld::join(&rdzv, &Device::cpu(), timeout).unwrap();
        (rdzv, world)
    })
}

/// Rank `r`'s input of the processes test.
fn process_input(r: usize) -> Vec<f32> {
    rand_vec(40 + r as u64, 64).iter().map(|&v| v as f32).collect()
}

/// NCCL between processes, a GPU each: every group gets its id through the
/// rendezvous store; the all-reduce matches the in-process one, messages
/// travel through the host, and a lost rank aborts the others' groups.
#[test]
fn processes_with_a_gpu_each_join_nccl_groups_through_the_store() {
    const TEST: &str = "processes_with_a_gpu_each_join_nccl_groups_through_the_store";
    let n = 2;
    if (0..n).any(|i| Device::cuda(i).is_err()) {
        report_skip(TEST, &format!("needs {n} CUDA devices"));
        return;
    }
    let ranks = process_ranks(n, std::time::Duration::from_secs(60));
    let mesh = Mesh::parse(&format!("dp{n}"), n, n).unwrap();
    let results = on_threads(n, |r| {
        let (rdzv, world) = &ranks[r];
        let dev = Device::cuda(r).unwrap();
        let groups = match nccl::process_mesh_groups(world, rdzv, &mesh, &dev) {
            Err(e @ Error::NcclUnavailable { .. }) => return Err(e.to_string()),
            other => other.unwrap(),
        };
        let x = Tensor::from_vec(process_input(r), [64], &dev).unwrap();
        let sum = groups.dp.all_reduce_sum(&x).unwrap().to_f64_vec().unwrap();
        let peer = (r + 1) % n;
        groups.dp.send(&x, peer).unwrap();
        let got = groups.dp.recv((r + n - 1) % n).unwrap().to_vec::<f32>().unwrap();
        Ok((sum, got))
    });
    if let Some(Err(e)) = results.iter().find(|r| r.is_err()) {
        report_skip(TEST, &format!("no NCCL library: {e}"));
        return;
    }
    let results: Vec<(Vec<f64>, Vec<f32>)> = results.into_iter().map(Result::unwrap).collect();
    let inputs: Vec<Vec<f32>> = (0..n).map(process_input).collect();
    let want: Vec<f64> = (0..64).map(|i| inputs.iter().map(|v| v[i] as f64).sum()).collect();
    for (r, (sum, got)) in results.iter().enumerate() {
        assert_close(sum, &want, 1e-5, 1e-5, &format!("rank {r}'s all-reduce"));
        assert_eq!(got, &inputs[(r + n - 1) % n], "rank {r}'s message");
    }
}

/// Without a GPU, a job of processes cannot put a rank on a CPU device
/// through NCCL: the error says so rather than failing later.
#[test]
fn nccl_groups_of_processes_refuse_a_cpu_device() {
    let ranks = process_ranks(2, std::time::Duration::from_secs(30));
    let mesh = Mesh::parse("dp2", 2, 2).unwrap();
    let errors = on_threads(2, |r| nccl::process_mesh_groups(&ranks[r].1, &ranks[r].0, &mesh, &Device::cpu()).unwrap_err().to_string());
    for e in errors {
        assert!(e.contains("NCCL connects CUDA devices"), "{e}");
    }
}
