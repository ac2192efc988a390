//! Dynamic loss scaling: the schedule, overflow detection and skipped steps,
//! and an fp16 model whose unscaled gradients match the f32 ones.

mod common;
use common::models::GptBlock;
use common::*;
use tessera::module::{self, Act, Cx, Module};
use tessera::prelude::*;
use tessera::train::LossScaler;

#[test]
fn the_scale_grows_backs_off_and_waits_out_hysteresis() {
    let mut s = LossScaler::new().with_schedule(2.0, 0.5, 3).unwrap();
    assert_eq!(s.scale(), 65536.0);
    for _ in 0..3 {
        s.update(true);
    }
    assert_eq!(s.scale(), 131072.0, "grows after 3 good steps");
    s.update(false);
    assert_eq!(s.scale(), 65536.0, "backs off at once without hysteresis");
    let mut h = LossScaler::new().with_hysteresis(2).unwrap();
    h.update(false);
    assert_eq!(h.scale(), 65536.0, "the first overflow is tolerated");
    h.update(true);
    h.update(false);
    assert_eq!(h.scale(), 65536.0, "a good step in between resets the count");
    h.update(false);
    assert_eq!(h.scale(), 32768.0, "two overflows in a row back off");
    assert!(LossScaler::new().with_initial_scale(0.0).is_err());
    assert!(LossScaler::new().with_schedule(1.0, 0.5, 10).is_err());
}

/// One fp16 forward and backward of a block with the upstream gradient
/// multiplied by `scale`; returns whether the step may be applied and the gradients.
fn fp16_step(scaler: &LossScaler) -> (bool, Vec<Vec<f64>>) {
    let mut cx = Cx::new(Device::cpu()).with_seed(4);
    cx.set_compute_dtype(DType::F16);
    let block = module::build(GptBlock::new(8, 2).unwrap(), &cx).unwrap();
    let x = rand_t(1, &[2, 4, 8], cx.device()).to_dtype(DType::F16).unwrap();
    let (y, saved) = block.forward(&mut cx, Act::new(x)).unwrap();
    let dy = tessera::ops::scale(&rand_t(2, y.tensor().dims(), cx.device()), scaler.scale()).unwrap().to_dtype(DType::F16).unwrap();
    block.backward(&mut cx, saved, Act::new(dy)).unwrap();
    let ok = scaler.unscale_and_check(&block, &cx).unwrap();
    let mut grads = Vec::new();
    module::visit_params(&block, |e| {
        grads.push(e.param.grad().unwrap().to_f64_vec()?);
        Ok(())
    })
    .unwrap();
    (ok, grads)
}

#[test]
fn an_overflow_is_detected_and_a_safe_scale_unscales_exactly() {
    // 2^40 overflows fp16 (max 65504): the step must be skipped.
    let huge = LossScaler::new().with_initial_scale(2f64.powi(40)).unwrap();
    let (ok, _) = fp16_step(&huge);
    assert!(!ok, "an fp16 overflow is detected");
    // A power-of-two scale that fits is exact: the same gradients as scale 1.
    let (ok1, g1) = fp16_step(&LossScaler::new().with_initial_scale(1.0).unwrap());
    let (ok8, g8) = fp16_step(&LossScaler::new().with_initial_scale(8.0).unwrap());
    assert!(ok1 && ok8);
    for (a, b) in g1.iter().zip(&g8) {
        assert_close(b, a, 1e-3, 2e-2, "unscaled gradients");
    }
}
