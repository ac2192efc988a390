//! Activation offload: the inputs that fully recomputed layers keep for
//! their backward wait in host memory (its own pool) instead of on the
//! device, and come back, the next layer's ahead of use, for the
//! recompute. Values never change. (ZeRO-Offload is tested with the ZeRO
//! engine in zero.rs, and in whole runs in trainer.rs and matrix.rs.)

mod common;
use common::models::RecomputeGpt;
use common::rand_vec;
use tessera::module::{self, Act, Cx, Module, RecomputeOverride};
use tessera::prelude::*;

const VOCAB: usize = 50;
const D: usize = 32;
const LAYERS: usize = 4;
const BATCH: usize = 8;
const SEQ: usize = 64;

struct Pass {
    /// Every parameter's gradient, by name.
    grads: Vec<(String, Vec<f32>)>,
    /// Device bytes held between the forward and the backward.
    device_between: usize,
    /// Host bytes held then.
    host_between: usize,
    /// The device's peak over the forward and the backward.
    device_peak: usize,
}

fn pass(recompute: RecomputeOverride, offload: bool) -> Pass {
    let dev = Device::cpu();
    let host = Device::cpu();
    let mut cx = Cx::new(dev.clone()).with_seed(3);
    cx.set_recompute_override(recompute);
    if offload {
        cx = cx.with_activation_offload(host.clone());
    }
    let model = module::build(RecomputeGpt::new(VOCAB, D, 2, LAYERS).unwrap(), &cx).unwrap();
    let ids: Vec<u32> = (0..BATCH * SEQ).map(|i| ((i * 7 + i * i) % VOCAB) as u32).collect();
    let ids = Tensor::from_vec(ids, [BATCH, SEQ], &dev).unwrap();
    dev.reset_peak();
    let (y, saved) = model.forward(&mut cx, Act::new(ids)).unwrap();
    let dy = Tensor::from_vec(rand_vec(5, y.tensor().elem_count()).into_iter().map(|v| v as f32).collect(), y.tensor().shape().clone(), &dev).unwrap();
    drop(y);
    let (device_between, host_between) = (dev.memory_stats().in_use, host.memory_stats().in_use);
    model.backward(&mut cx, saved, Act::new(dy)).unwrap();
    let device_peak = dev.memory_stats().peak;
    assert_eq!(host.memory_stats().in_use, 0, "nothing is left on the host after the backward");
    let mut grads = Vec::new();
    module::visit_params(&model, |e| {
        grads.push((e.name.to_string(), e.param.grad().unwrap().to_vec::<f32>()?));
        Ok(())
    })
    .unwrap();
    Pass { grads, device_between, host_between, device_peak }
}

#[test]
fn offloaded_activations_give_the_same_gradients_and_leave_the_device() {
    let kept = pass(RecomputeOverride::Full, false);
    let offloaded = pass(RecomputeOverride::Full, true);
    assert_eq!(offloaded.grads, kept.grads, "bit for bit");
    // Each of the four blocks keeps its input, batch x seq x d in f32.
    let inputs = LAYERS * BATCH * SEQ * D * 4;
    println!("between forward and backward: device {} B -> {} B, host {} B", kept.device_between, offloaded.device_between, offloaded.host_between);
    println!("device peak: {} B -> {} B", kept.device_peak, offloaded.device_peak);
    assert_eq!(offloaded.host_between, inputs, "the host holds the kept inputs");
    assert_eq!(kept.device_between - offloaded.device_between, inputs, "the device no longer does");
    assert!(offloaded.device_peak < kept.device_peak, "the device's peak falls");
    // Without recompute there is nothing kept to offload: the setting changes nothing.
    let off = pass(RecomputeOverride::Off, true);
    assert_eq!(off.host_between, 0);
    assert_eq!(off.grads, pass(RecomputeOverride::Off, false).grads);
}
