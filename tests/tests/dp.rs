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
                    let sync = Arc::new(DataParallel::new(&block, comm, 2048).unwrap().with_compression(compression));
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
