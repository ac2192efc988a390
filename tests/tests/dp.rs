//! Data parallelism: bucketed, overlapped gradient all-reduce equals
//! single-rank training on the whole batch.

mod common;
use common::models::GptBlock;
use common::*;
use std::sync::Arc;
use tessera::dist::inproc::InProcess;
use tessera::dist::Communicator;
use tessera::module::{self, Act, Cx, Groups, Module, Param};
use tessera::parallel::data::{Compression, DataParallel, SyncStats};
use tessera::prelude::*;

/// Every distinct parameter with its name and gradient.
type Grads = Vec<(String, Param, Vec<f64>)>;

fn grads<M: Module>(m: &M) -> Grads {
    let mut out: Vec<(String, Param, Vec<f64>)> = Vec::new();
    module::visit_params(m, |e| {
        if !out.iter().any(|(_, p, _)| p.same(e.param)) {
            out.push((e.name.to_string(), e.param.clone(), e.param.grad().expect("gradient").to_f64_vec()?));
        }
        Ok(())
    })
    .unwrap();
    out
}

/// Trains one step of a GPT block on `dp` ranks, each on its slice of the
/// batch; returns every rank's averaged gradients and sync figures.
fn dp_step(dp: usize, compression: Compression, x: &[f64], dy: &[f64], dims: [usize; 3]) -> Vec<(Grads, SyncStats)> {
    let world = InProcess::new(dp).unwrap();
    let per = dims[0] / dp;
    let row = dims[1] * dims[2];
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..dp)
            .map(|rank| {
                let world = &world;
                s.spawn(move || {
                    let dev = Device::cpu();
                    let comm: Arc<dyn Communicator> = Arc::new(world.communicator(rank, &dev).unwrap());
                    let mut groups = Groups::single();
                    groups.dp = comm.clone();
                    let cx = Cx::new(dev.clone()).with_dtype(DType::F64).with_seed(7).with_groups(groups);
                    let block = module::build(GptBlock::new(8, 2).unwrap(), &cx).unwrap();
                    let sync = Arc::new(DataParallel::new(&block, comm, 2048).unwrap().with_compression(compression).unwrap());
                    let mut cx = cx.with_hooks(sync.clone());
                    let slice = |v: &[f64]| v[rank * per * row..(rank + 1) * per * row].to_vec();
                    let xr = Tensor::from_vec(slice(x), [per, dims[1], dims[2]], &dev).unwrap();
                    // Each rank's loss is the mean over its share: scale so the
                    // average over ranks is the mean over the whole batch.
                    let dyr: Vec<f64> = slice(dy).iter().map(|v| v * dp as f64).collect();
                    let (y, saved) = block.forward(&mut cx, Act::new(xr)).unwrap();
                    block.backward(&mut cx, saved, Act::new(Tensor::from_vec(dyr, y.tensor().shape().clone(), &dev).unwrap())).unwrap();
                    let stats = sync.finish().unwrap();
                    (grads(&block), stats)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn single_step(x: &[f64], dy: &[f64], dims: [usize; 3]) -> Grads {
    let mut cx = Cx::new(Device::cpu()).with_dtype(DType::F64).with_seed(7);
    let block = module::build(GptBlock::new(8, 2).unwrap(), &cx).unwrap();
    let x = Tensor::from_vec(x.to_vec(), dims, cx.device()).unwrap();
    let (y, saved) = block.forward(&mut cx, Act::new(x)).unwrap();
    let dy = Tensor::from_vec(dy.to_vec(), y.tensor().shape().clone(), cx.device()).unwrap();
    block.backward(&mut cx, saved, Act::new(dy)).unwrap();
    grads(&block)
}

#[test]
fn two_and_four_replicas_equal_one_rank_on_the_whole_batch() {
    let dims = [4, 3, 8];
    let n: usize = dims.iter().product();
    let (x, dy) = (rand_vec(1, n), rand_vec(2, n));
    let reference = single_step(&x, &dy, dims);
    for dp in [2, 4] {
        for (rank, (g, stats)) in dp_step(dp, Compression::None, &x, &dy, dims).into_iter().enumerate() {
            for ((name, _, got), (_, _, want)) in g.iter().zip(&reference) {
                assert_close(got, want, 1e-12, 1e-10, &format!("dp{dp} rank {rank}: {name}"));
            }
            // Small buckets: several all-reduces, each started during the
            // backward as soon as its last gradient was final.
            assert!(stats.buckets >= 3, "{stats:?}");
            assert_eq!(stats.launched_during_backward, stats.buckets, "{stats:?}");
            assert!(stats.hidden() <= stats.comm);
            assert_eq!(stats.bytes, reference.iter().map(|(_, _, g)| g.len() * 8).sum::<usize>());
        }
    }
}

#[test]
fn bf16_compression_halves_the_bytes_within_its_error_bound() {
    let dims = [2, 3, 8];
    let n: usize = dims.iter().product();
    let (x, dy) = (rand_vec(3, n), rand_vec(4, n));
    let exact = dp_step(2, Compression::None, &x, &dy, dims);
    let packed = dp_step(2, Compression::Bf16, &x, &dy, dims);
    assert_eq!(packed[0].1.bytes * 4, exact[0].1.bytes, "f64 gradients travel in bf16: a quarter of the bytes");
    // Per-replica gradients (before averaging) bound the error: each element
    // is rounded to bf16 (unit roundoff 2⁻⁸) on the way in and once more after
    // the sum, so the average is off by at most 2⁻⁷ times the mean magnitude.
    let single = |rank: usize| -> Vec<Vec<f64>> {
        let row = dims[1] * dims[2];
        let xs = x[rank * row..(rank + 1) * row].to_vec();
        let dys: Vec<f64> = dy[rank * row..(rank + 1) * row].iter().map(|v| v * 2.0).collect();
        single_step(&xs, &dys, [1, dims[1], dims[2]]).into_iter().map(|(_, _, g)| g).collect()
    };
    let (g0, g1) = (single(0), single(1));
    for (((name, _, got), (_, _, want)), (a, b)) in packed[0].0.iter().zip(&exact[0].0).zip(g0.iter().zip(&g1)) {
        for (j, (gv, wv)) in got.iter().zip(want).enumerate() {
            let bound = 2f64.powi(-7) * (a[j].abs() + b[j].abs()) / 2.0;
            assert!((gv - wv).abs() <= bound, "{name}[{j}]: {gv} vs {wv}, bound {bound}");
        }
    }
}

/// Per replica of a PowerSGD run: each step's applied gradients and bytes
/// sent, the fixed gradients it was given, and the parameters' shapes.
struct PowerSgdRun {
    applied: Vec<Vec<Vec<f64>>>,
    bytes: Vec<usize>,
    fixed: Vec<Vec<f64>>,
    shapes: Vec<Vec<usize>>,
}

/// `steps` steps of PowerSGD (`rank`, `warmup`) on two replicas of a GPT
/// block whose gradients are the same every step: a fixed, different
/// gradient on each rank.
fn powersgd_run(rank: usize, warmup: u64, steps: usize) -> Vec<PowerSgdRun> {
    let world = InProcess::new(2).unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|replica| {
                let world = &world;
                s.spawn(move || {
                    let dev = Device::cpu();
                    let comm: Arc<dyn Communicator> = Arc::new(world.communicator(replica, &dev).unwrap());
                    let cx = Cx::new(dev.clone()).with_dtype(DType::F64).with_seed(7);
                    let block = module::build(GptBlock::new(8, 2).unwrap(), &cx).unwrap();
                    let sync = DataParallel::new(&block, comm, 2048).unwrap().with_compression(Compression::PowerSgd { rank, warmup }).unwrap();
                    let mut params: Vec<Param> = Vec::new();
                    module::visit_params(&block, |e| {
                        params.push(e.param.clone());
                        Ok(())
                    })
                    .unwrap();
                    let fixed: Vec<Vec<f64>> =
                        params.iter().enumerate().map(|(i, p)| rand_vec(100 * replica as u64 + i as u64, p.local_shape().elem_count())).collect();
                    let (mut applied, mut bytes) = (Vec::new(), Vec::new());
                    for _ in 0..steps {
                        for (p, g) in params.iter().zip(&fixed) {
                            p.set_grad(Tensor::from_vec(g.clone(), p.local_shape().clone(), &dev).unwrap()).unwrap();
                        }
                        bytes.push(sync.finish().unwrap().bytes);
                        applied.push(params.iter().map(|p| p.grad().unwrap().to_f64_vec().unwrap()).collect::<Vec<_>>());
                    }
                    let shapes = params.iter().map(|p| p.local_shape().dims().to_vec()).collect();
                    PowerSgdRun { applied, bytes, fixed, shapes }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The mean over the two replicas of each fixed gradient.
fn mean_gradient(runs: &[PowerSgdRun]) -> Vec<Vec<f64>> {
    runs[0].fixed.iter().zip(&runs[1].fixed).map(|(a, b)| a.iter().zip(b).map(|(x, y)| (x + y) / 2.0).collect()).collect()
}

/// ‖got − want‖ / ‖want‖.
fn relative(got: &[f64], want: &[f64]) -> f64 {
    let d = got.iter().zip(want).map(|(a, b)| (a - b).powi(2)).sum::<f64>().sqrt();
    d / want.iter().map(|b| b * b).sum::<f64>().sqrt()
}

/// Whether a gradient of `dims` travels as rank-`rank` factors, and the values it sends.
fn factored(dims: &[usize], rank: usize) -> (bool, usize) {
    let (n, m) = (dims[0], dims[1..].iter().product::<usize>());
    let f = dims.len() >= 2 && (n + m) * rank < n * m;
    (f, if f { (n + m) * rank } else { n * m })
}

/// PowerSGD on two replicas: every rank applies the same gradient; vectors
/// are exact means; a step's matrices are rank-2 approximations of the
/// mean (far from it on the first step), and, with error feedback, what
/// was applied over many steps is the mean times the steps, to within the
/// last error. The bytes are the factors'.
#[test]
fn powersgd_applies_the_mean_gradient_over_the_steps() {
    const STEPS: usize = 60;
    const RANK: usize = 2;
    let runs = powersgd_run(RANK, 0, STEPS);
    let (applied, shapes) = (&runs[0].applied, &runs[0].shapes);
    assert!(runs[1].applied == *applied, "both replicas apply the same gradients");
    let mean = mean_gradient(&runs);
    let mut expected_bytes = 0;
    for (i, dims) in shapes.iter().enumerate() {
        let (is_factored, values) = factored(dims, RANK);
        expected_bytes += 8 * values;
        if !is_factored {
            for step in applied {
                assert!(relative(&step[i], &mean[i]) < 1e-12, "parameter {i} {dims:?} travels whole: the exact mean");
            }
            continue;
        }
        let first = relative(&applied[0][i], &mean[i]);
        assert!(first > 0.2, "parameter {i} {dims:?}: a rank-{RANK} step is far from the mean of random gradients ({first:.3})");
        let total: Vec<f64> = (0..mean[i].len()).map(|j| applied.iter().map(|s| s[i][j]).sum::<f64>() / STEPS as f64).collect();
        let over_steps = relative(&total, &mean[i]);
        assert!(over_steps < 0.1, "parameter {i} {dims:?}: applied over {STEPS} steps is {over_steps:.3} from the mean (first step {first:.3})");
    }
    assert!(runs.iter().all(|r| r.bytes.iter().all(|&b| b == expected_bytes)), "bytes per step {:?}, expected {expected_bytes}", runs[0].bytes);
}

/// The warm-up's steps travel whole (the exact mean, every byte), the
/// first one after it as factors.
#[test]
fn powersgd_sends_the_warm_up_steps_whole() {
    let runs = powersgd_run(2, 3, 4);
    let mean = mean_gradient(&runs);
    let whole: usize = runs[0].shapes.iter().map(|d| 8 * d.iter().product::<usize>()).sum();
    let factors: usize = runs[0].shapes.iter().map(|d| 8 * factored(d, 2).1).sum();
    assert_eq!(runs[0].bytes, vec![whole, whole, whole, factors]);
    for step in &runs[0].applied[..3] {
        for (i, g) in step.iter().enumerate() {
            assert!(relative(g, &mean[i]) < 1e-12, "warm-up step: parameter {i} is the exact mean");
        }
    }
    assert!(runs[0].applied[3].iter().zip(&mean).any(|(g, m)| relative(g, m) > 0.2), "the first step after the warm-up is compressed");
}

#[test]
fn powersgd_of_rank_zero_is_refused() {
    let dev = Device::cpu();
    let cx = Cx::new(dev.clone());
    let block = module::build(GptBlock::new(8, 2).unwrap(), &cx).unwrap();
    let comm: Arc<dyn Communicator> = Arc::new(tessera::dist::SingleRank);
    let e = DataParallel::new(&block, comm, 2048).unwrap().with_compression(Compression::PowerSgd { rank: 0, warmup: 0 }).unwrap_err().to_string();
    assert!(e.contains("at least 1"), "{e}");
}
