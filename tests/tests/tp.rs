//! Tensor-parallel pieces against their single-rank equivalents.

mod common;
use common::*;
use tessera::module::{Act, Cx};
use tessera::nn::{vocab_parallel_cross_entropy, vocab_parallel_cross_entropy_backward};
use tessera::ops;
use tessera::prelude::*;

#[test]
fn vocab_parallel_cross_entropy_on_one_rank_is_cross_entropy() {
    let cx = Cx::new(Device::cpu()).with_dtype(DType::F64);
    let (n, vocab) = (6, 13);
    let logits = ops::scale(&rand_t(1, &[2, 3, vocab], cx.device()), 5.0).unwrap();
    let targets = Tensor::from_vec(vec![0u32, 12, 7, 999, 3, 3], [2, 3], cx.device()).unwrap();
    let (expect, saved) = ops::cross_entropy(&logits, &targets, Some(999)).unwrap();
    let dexpect = ops::cross_entropy_backward(&logits, &targets, Some(999), &saved, 0.5).unwrap();
    let act = Act::new(logits.clone());
    let (loss, vsaved) = vocab_parallel_cross_entropy(cx.tp(), &act, &targets, vocab, Some(999)).unwrap();
    let d = vocab_parallel_cross_entropy_backward(&act, &targets, vocab, Some(999), &vsaved, 0.5).unwrap();
    assert_close(&[loss.to_scalar().unwrap()], &[expect.to_scalar().unwrap()], 1e-12, 1e-12, "loss");
    assert_close(&d.tensor().to_f64_vec().unwrap(), &dexpect.to_f64_vec().unwrap(), 1e-14, 1e-12, "dlogits");
    assert_eq!(n, 6);
}

use common::models::{Gpt, GptBlock, LlamaBlock};
use std::sync::Arc;
use tessera::dist::inproc::InProcess;
use tessera::module::{self, Groups, Module, Param, Shard};

/// Every parameter's gradient by name, as a single rank computes it.
fn grads_by_name<M: Module>(m: &M) -> Vec<(String, Param, Vec<f64>)> {
    let mut out: Vec<(String, Param, Vec<f64>)> = Vec::new();
    module::visit_params(m, |e| {
        if !out.iter().any(|(_, p, _)| p.same(e.param)) {
            let g = e.param.grad().expect("every parameter has a gradient").to_f64_vec()?;
            out.push((e.name.to_string(), e.param.clone(), g));
        }
        Ok(())
    })
    .unwrap();
    out
}

/// The slice of a full (row-major) tensor that `shard` holds.
fn shard_of(full: &[f64], global: &[usize], shard: Shard) -> Vec<f64> {
    let Shard::Split { dim, rank, degree } = shard else { return full.to_vec() };
    let t = Tensor::from_vec(full.to_vec(), global, &Device::cpu()).unwrap();
    let part = global[dim] / degree;
    t.narrow(dim, rank * part, part).unwrap().to_f64_vec().unwrap()
}

/// The shape of `shard`'s part of a tensor of shape `global`.
fn shard_of_dims(global: &[usize], shard: Shard) -> Vec<usize> {
    let mut d = global.to_vec();
    if let Shard::Split { dim, degree, .. } = shard {
        d[dim] /= degree;
    }
    d
}

/// Runs `make()` on one rank and on `tp` tensor-parallel ranks (threads), in
/// f64, with the same input and upstream gradient; asserts that the outputs,
/// the input gradients and every parameter shard's gradient agree.
/// Both with and without sequence parallelism.
fn tp_matches_single_rank<M, F>(name: &str, tp: usize, make: F, input: impl Fn(&Device) -> Tensor + Sync, vocab_out: bool)
where
    M: Module<In = tessera::module::Replicated>,
    F: Fn() -> tessera::Result<M> + Sync,
{
    tp_matches(name, tp, false, &make, &input, vocab_out);
    tp_matches(&format!("{name} + sequence parallel"), tp, true, &make, &input, vocab_out);
}

/// Like [`tp_matches_single_rank`] for one setting of sequence parallelism:
/// with it on, float inputs and outputs are this rank's slice of the sequence.
fn tp_matches<M, F>(name: &str, tp: usize, sp: bool, make: &F, input: &(impl Fn(&Device) -> Tensor + Sync), vocab_out: bool)
where
    M: Module<In = tessera::module::Replicated>,
    F: Fn() -> tessera::Result<M> + Sync,
{
    let cx = Cx::new(Device::cpu()).with_dtype(DType::F64).with_seed(7);
    let single = module::build(make().unwrap(), &cx).unwrap();
    let mut cx1 = cx;
    let x = input(cx1.device());
    let (y, saved) = single.forward(&mut cx1, Act::new(x.clone())).unwrap();
    let y_full = y.tensor().to_f64_vec().unwrap();
    let y_dims = y.tensor().dims().to_vec();
    let dy_full = rand_vec(5, y_full.len());
    let dy = Tensor::from_vec(dy_full.clone(), y_dims.clone(), cx1.device()).unwrap();
    let dx = single.backward(&mut cx1, saved, Act::new(dy)).unwrap();
    let dx_full = if x.dtype().is_float() { dx.tensor().to_f64_vec().unwrap() } else { vec![] };
    let reference = grads_by_name(&single);

    let world = InProcess::new(tp).unwrap();
    std::thread::scope(|s| {
        for rank in 0..tp {
            let (world, make, input, reference, y_full, dy_full, dx_full, y_dims) = (&world, &make, &input, &reference, &y_full, &dy_full, &dx_full, &y_dims);
            s.spawn(move || {
                let dev = Device::cpu();
                let mut groups = Groups::single();
                groups.tp = Arc::new(world.communicator(rank, &dev).unwrap());
                let mut cx = Cx::new(dev.clone()).with_dtype(DType::F64).with_seed(7).with_groups(groups).with_sequence_parallel(sp);
                let m = module::build(make().unwrap(), &cx).unwrap();
                let full_x = input(&dev);
                // Under sequence parallelism a float input is this rank's slice of the sequence.
                let seq_shard = Shard::Split { dim: 1, rank, degree: tp };
                let x = if sp && full_x.dtype().is_float() {
                    Tensor::from_vec(shard_of(&full_x.to_f64_vec().unwrap(), full_x.dims(), seq_shard), shard_of_dims(full_x.dims(), seq_shard), &dev).unwrap()
                } else {
                    full_x.clone()
                };
                let (y, saved) = m.forward(&mut cx, Act::new(x.clone())).unwrap();
                // A vocab-parallel head leaves each rank its slice of the logits;
                // with sequence parallelism a block's output is a slice of the sequence.
                let shard = if vocab_out {
                    Shard::Split { dim: y_dims.len() - 1, rank, degree: tp }
                } else if sp {
                    seq_shard
                } else {
                    Shard::Full
                };
                let expect_y = shard_of(y_full, y_dims, shard);
                assert_close(&y.tensor().to_f64_vec().unwrap(), &expect_y, 1e-11, 1e-9, &format!("{name} rank {rank}: output"));
                let dy = Tensor::from_vec(shard_of(dy_full, y_dims, shard), y.tensor().shape().clone(), &dev).unwrap();
                let dx = m.backward(&mut cx, saved, Act::new(dy)).unwrap();
                if x.dtype().is_float() {
                    let expect = if sp { shard_of(dx_full, full_x.dims(), seq_shard) } else { dx_full.clone() };
                    assert_close(&dx.tensor().to_f64_vec().unwrap(), &expect, 1e-11, 1e-9, &format!("{name} rank {rank}: input gradient"));
                }
                let mine = grads_by_name(&m);
                assert_eq!(mine.len(), reference.len());
                for ((n, p, g), (rn, rp, rg)) in mine.iter().zip(reference) {
                    assert_eq!(n, rn);
                    let expect = shard_of(rg, rp.global_shape().dims(), p.shard());
                    assert_close(g, &expect, 1e-11, 1e-9, &format!("{name} rank {rank}: d/d {n} ({:?})", p.shard()));
                }
            });
        }
    });
}

#[test]
fn gpt_block_on_two_tp_ranks_equals_one_rank() {
    tp_matches_single_rank("gpt block", 2, || GptBlock::new(8, 2), |d| rand_t(3, &[2, 4, 8], d), false);
}

#[test]
fn llama_block_on_two_tp_ranks_equals_one_rank() {
    tp_matches_single_rank("llama block", 2, || LlamaBlock::new(8, 4, 2, 12), |d| rand_t(4, &[2, 4, 8], d), false);
}

#[test]
fn small_gpt_on_two_tp_ranks_equals_one_rank() {
    let ids = |d: &Device| Tensor::from_vec(vec![1u32, 5, 10, 0, 3, 3, 7, 2], [2, 4], d).unwrap();
    tp_matches_single_rank("small gpt", 2, || Gpt::new(12, 8, 2, 2), ids, true);
}

#[test]
fn vocab_parallel_cross_entropy_on_several_ranks_equals_one() {
    for tp in [2, 4] {
        vocab_parallel_cross_entropy_on_ranks_equals_one(tp);
    }
}

fn vocab_parallel_cross_entropy_on_ranks_equals_one(tp: usize) {
    let dev = Device::cpu();
    let (rows, vocab) = (5, 8);
    let full = ops::scale(&rand_t(9, &[rows, vocab], &dev), 4.0).unwrap();
    let targets = vec![0u32, 7, 3, 999, 4];
    let t = Tensor::from_vec(targets.clone(), [rows], &dev).unwrap();
    let (loss, saved) = ops::cross_entropy(&full, &t, Some(999)).unwrap();
    let dfull = ops::cross_entropy_backward(&full, &t, Some(999), &saved, 1.0).unwrap().to_f64_vec().unwrap();
    let full_v = full.to_f64_vec().unwrap();
    let loss = loss.to_scalar().unwrap();
    let world = InProcess::new(tp).unwrap();
    std::thread::scope(|s| {
        for rank in 0..tp {
            let (world, full_v, dfull, targets) = (&world, &full_v, &dfull, &targets);
            s.spawn(move || {
                let dev = Device::cpu();
                let mut groups = Groups::single();
                groups.tp = Arc::new(world.communicator(rank, &dev).unwrap());
                let cx = Cx::new(dev.clone()).with_dtype(DType::F64).with_groups(groups);
                let shard = Shard::Split { dim: 1, rank, degree: tp };
                let logits = Act::new(Tensor::from_vec(shard_of(full_v, &[rows, vocab], shard), [rows, vocab / tp], &dev).unwrap());
                let t = Tensor::from_vec(targets.clone(), [rows], &dev).unwrap();
                let (l, saved) = vocab_parallel_cross_entropy(cx.tp(), &logits, &t, vocab, Some(999)).unwrap();
                assert_close(&[l.to_scalar().unwrap()], &[loss], 1e-12, 1e-12, "loss");
                let d = vocab_parallel_cross_entropy_backward(&logits, &t, vocab, Some(999), &saved, 1.0).unwrap();
                assert_close(&d.tensor().to_f64_vec().unwrap(), &shard_of(dfull, &[rows, vocab], shard), 1e-14, 1e-12, "dlogits");
            });
        }
    });
}
