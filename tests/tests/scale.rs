//! Walking a model of very many layers costs time in proportion to its
//! parameters: every per-parameter lookup (naming, materialising, the
//! optimizer's slots, data-parallel buckets, checkpoints) is keyed, not a
//! search of everything seen so far.

use std::time::{Duration, Instant};
use tessera::ckpt::{serde_json, Checkpointer};
use tessera::module::{self, Cx};
use tessera::nn::{LayerNorm, Stack};
use tessera::optim::{AdamW, AdamWConfig};
use tessera::parallel::data::DataParallel;
use tessera::prelude::*;

/// Everything done once per parameter, on a stack of `layers` norms.
fn walk(layers: usize, root: &std::path::Path) -> Duration {
    let started = Instant::now();
    let cx = Cx::new(Device::cpu());
    let stack = Stack::from_fn(layers, |_| LayerNorm::new(2, 1e-5, true)).unwrap();
    let model = module::build(stack, &cx).unwrap();
    assert_eq!(module::distinct_params(&model).unwrap().len(), 2 * layers);
    let opt = AdamW::new(&model, AdamWConfig::default()).unwrap();
    let dp = DataParallel::new(&model, cx.groups().dp.clone(), 1 << 20).unwrap();
    drop(dp);
    let ckpt = Checkpointer::new(root, 1).unwrap();
    ckpt.save(1, &model, Some(&opt), &cx, serde_json::json!(null)).unwrap();
    let mut opt2 = AdamW::new(&model, AdamWConfig::default()).unwrap();
    ckpt.load_latest_valid(&model, Some(&mut opt2), &cx).unwrap().expect("the checkpoint just written");
    started.elapsed()
}

#[test]
fn a_model_of_many_layers_is_walked_in_linear_time() {
    let root = tessera::testing::Scratch::new("scale");
    let small = walk(1_000, &root.join("small"));
    let large = walk(10_000, &root.join("large"));
    // Ten times the parameters: about ten times the time; a quadratic walk
    // would take a hundred. The bound leaves room for a noisy machine.
    let ratio = large.as_secs_f64() / small.as_secs_f64().max(1e-3);
    eprintln!("{small:?} -> {large:?}: {ratio:.1}x");
    assert!(ratio < 35.0, "10× the layers took {ratio:.1}× the time ({small:?} -> {large:?})");
}
