//! A backward split in two, as a zero-bubble pipeline runs it (the input
//! half now, the weight gradients put aside and computed later), gives the
//! whole backward's gradients bit for bit: dense and MoE models (an expert
//! that no token reaches included), on one rank and on two tensor-parallel
//! ranks with and without sequence parallelism.

mod common;
use common::models::{Gpt, MoeGpt};
use common::*;
use std::sync::Arc;
use tessera::dist::inproc::InProcess;
use tessera::module::{self, Act, Cx, Groups, Module, Replicated};
use tessera::prelude::*;

/// Every parameter's gradient by name (`None` where it has none yet).
type Grads = Vec<(String, Option<Vec<f64>>)>;

fn grads<M: Module>(m: &M) -> Grads {
    let mut out = Vec::new();
    module::visit_params(m, |e| {
        out.push((e.name.to_string(), e.param.grad().map(|g| g.to_f64_vec()).transpose()?));
        Ok(())
    })
    .unwrap();
    out
}

/// One forward and backward of a fresh `make()` in `cx`, whole or split;
/// returns the gradients, the input gradient, and (split) the gradients
/// present before the weight half ran and how many computations it held.
fn pass<M: Module<In = Replicated>>(
    make: &dyn Fn() -> tessera::Result<M>,
    cx: &mut Cx,
    ids: &Tensor,
    split: bool,
) -> (Grads, Vec<f64>, Option<(Grads, usize)>) {
    let m = module::build(make().unwrap(), cx).unwrap();
    let (y, saved) = m.forward(cx, Act::new(ids.clone())).unwrap();
    let dy = Tensor::from_vec(rand_vec(5, y.tensor().elem_count()), y.tensor().shape().clone(), cx.device()).unwrap();
    if split {
        cx.defer_weight_grads();
    }
    let dx = m.backward(cx, saved, Act::new(dy)).unwrap();
    let dx = if dx.tensor().dtype().is_float() { dx.tensor().to_f64_vec().unwrap() } else { vec![] };
    let before = split.then(|| {
        let put_aside = cx.take_weight_grads();
        let before = (grads(&m), put_aside.len());
        put_aside.run(cx).unwrap();
        before
    });
    (grads(&m), dx, before)
}

/// Whole and split agree exactly; the split one had put aside every
/// product's weight gradient (none was there before its weight half ran)
/// and computed the norms' at once.
fn split_equals_whole<M: Module<In = Replicated>>(what: &str, make: &dyn Fn() -> tessera::Result<M>, cx_for: &dyn Fn() -> Cx, ids: &Tensor) {
    let (whole, dx_whole, _) = pass(make, &mut cx_for(), ids, false);
    let (split, dx_split, before) = pass(make, &mut cx_for(), ids, true);
    assert_eq!(dx_split, dx_whole, "{what}: input gradient");
    assert_eq!(split, whole, "{what}: parameter gradients");
    let (before, jobs) = before.unwrap();
    assert!(jobs > 0, "{what}: nothing was put aside");
    for (name, g) in &before {
        // (The head's weight is the embedding's, tied: that use's gradient
        // is the embedding's, computed at once.)
        let product = name.contains("qkv") || name.contains("proj") || name.contains("moe") || name.contains("fc");
        let norm = name.contains("ln") || name.starts_with("norm");
        if product {
            assert!(g.is_none(), "{what}: {name} got its gradient in the input half");
        }
        if norm {
            assert!(g.is_some(), "{what}: {name} waited for the weight half");
        }
    }
}

fn ids(t: usize, vocab: usize, dev: &Device) -> Tensor {
    Tensor::from_vec((0..2 * t).map(|i| ((i * 5 + 3) % vocab) as u32).collect::<Vec<u32>>(), [2, t], dev).unwrap()
}

#[test]
fn split_backward_equals_whole_on_one_rank() {
    let cx_for = || Cx::new(Device::cpu()).with_dtype(DType::F64).with_seed(3);
    let dev = Device::cpu();
    split_equals_whole("GPT", &|| Gpt::new(12, 8, 2, 2), &cx_for, &ids(5, 12, &dev));
    // 32 experts for ten tokens choosing two each: most experts are idle.
    split_equals_whole("MoE GPT", &|| MoeGpt::new(12, 8, 2, 2, 32, 0, 1), &cx_for, &ids(5, 12, &dev));
}

#[test]
fn split_backward_equals_whole_on_tensor_parallel_ranks() {
    for sp in [false, true] {
        let world = InProcess::new(2).unwrap();
        std::thread::scope(|s| {
            for rank in 0..2 {
                let world = &world;
                s.spawn(move || {
                    let dev = Device::cpu();
                    let tp = Arc::new(world.communicator(rank, &dev).unwrap());
                    let cx_for = || {
                        let mut groups = Groups::single();
                        groups.tp = tp.clone();
                        Cx::new(dev.clone()).with_dtype(DType::F64).with_seed(3).with_groups(groups).with_sequence_parallel(sp)
                    };
                    let what = format!("rank {rank}, sequence parallel {sp}");
                    split_equals_whole(&format!("GPT {what}"), &|| Gpt::new(12, 8, 2, 2), &cx_for, &ids(6, 12, &dev));
                    split_equals_whole(&format!("MoE GPT {what}"), &|| MoeGpt::new(12, 8, 2, 2, 32, 0, 1), &cx_for, &ids(6, 12, &dev));
                });
            }
        });
    }
}
