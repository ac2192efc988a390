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
    let (loss, vsaved) = vocab_parallel_cross_entropy(&cx, &act, &targets, vocab, Some(999)).unwrap();
    let d = vocab_parallel_cross_entropy_backward(&act, &targets, vocab, Some(999), &vsaved, 0.5).unwrap();
    assert_close(&[loss.to_scalar().unwrap()], &[expect.to_scalar().unwrap()], 1e-12, 1e-12, "loss");
    assert_close(&d.tensor().to_f64_vec().unwrap(), &dexpect.to_f64_vec().unwrap(), 1e-14, 1e-12, "dlogits");
    assert_eq!(n, 6);
}
