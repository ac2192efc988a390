//! Quantized linear layers in every tensor-parallel role: on one rank and
//! on two, each rank quantizes its own shard of the column-, row-, plain-
//! and vocab-parallel weights, the outputs stay near the f32 single-rank
//! model's, the vocab head's padding logits stay −∞, and the backward says
//! the model is for inference.

mod common;
use common::*;
use std::sync::Arc;
use tessera::dist::inproc::InProcess;
use tessera::module::{self, Groups};
use tessera::nn::{quantize_linears, Linear};
use tessera::ops::QuantFormat;
use tessera::prelude::*;

/// A residual MLP and an output head: one linear layer in each role.
#[derive(Module)]
struct Roles {
    #[shard(column)]
    up: Linear,
    #[shard(row)]
    down: Linear,
    proj: Linear,
    #[shard(vocab)]
    head: Linear,
}

#[forward]
impl Roles {
    fn forward(&self, x: Act<Replicated>) -> Act<SplitHidden> {
        let h = x + all_reduce(self.down(gelu(self.up(x))));
        self.head(self.proj(h))
    }
}

const D: usize = 64;
const HIDDEN: usize = 256;
/// Output columns of the head, the last two padding (each of two ranks holds six).
const OUT: usize = 12;
const VALID: usize = 10;

fn roles() -> tessera::Result<Roles> {
    Ok(Roles {
        up: Linear::new(D, HIDDEN, true)?,
        down: Linear::new(HIDDEN, D, true)?,
        proj: Linear::new(D, D, false)?,
        head: Linear::new(D, OUT, true)?.with_valid_outputs(VALID)?,
    })
}

fn input(dev: &Device) -> Tensor {
    // Weights start at std 0.02; a larger input makes the outputs of a size worth comparing.
    tessera::ops::scale(&rand_t(3, &[2, 5, D], dev), 20.0).unwrap().to_dtype(DType::F32).unwrap()
}

/// (format, largest output drift allowed, as a fraction of the largest output).
const FORMATS: [(QuantFormat, f64); 3] = [(QuantFormat::Int8, 0.02), (QuantFormat::Int4 { group_size: 64 }, 0.2), (QuantFormat::W8A8, 0.04)];

#[test]
fn every_tensor_parallel_role_runs_its_quantized_shard() {
    let cx = &mut Cx::new(Device::cpu()).with_seed(5);
    cx.set_training(false);
    let single = module::build(roles().unwrap(), cx).unwrap();
    let want = single.forward(cx, Act::new(input(cx.device()))).unwrap().0.into_tensor().to_vec::<f32>().unwrap();
    let scale = want.iter().filter(|v| v.is_finite()).fold(0f32, |m, v| m.max(v.abs())) as f64;
    for tp in [1, 2] {
        for (format, tol) in FORMATS {
            let world = InProcess::new(tp).unwrap();
            std::thread::scope(|s| {
                for rank in 0..tp {
                    let (world, want) = (&world, &want);
                    s.spawn(move || {
                        let dev = Device::cpu();
                        let mut groups = Groups::single();
                        groups.tp = Arc::new(world.communicator(rank, &dev).unwrap());
                        let mut cx = Cx::new(dev.clone()).with_seed(5).with_groups(groups);
                        cx.set_training(false);
                        let m = module::build(roles().unwrap(), &cx).unwrap();
                        let report = quantize_linears(&m, &cx, format).unwrap();
                        assert_eq!(report.quantized, ["up.weight", "down.weight", "proj.weight", "head.weight"], "{report:?}");
                        // Each rank holds and quantized its own shard.
                        let shard = |l: &Linear| l.weight().quantized().unwrap().shape().dims().to_vec();
                        assert_eq!(shard(&m.up), [HIDDEN / tp, D]);
                        assert_eq!(shard(&m.down), [D, HIDDEN / tp]);
                        assert_eq!(shard(&m.proj), [D, D]);
                        assert_eq!(shard(&m.head), [OUT / tp, D]);
                        let (y, saved) = m.forward(&mut cx, Act::new(input(&dev))).unwrap();
                        let got = y.tensor().to_vec::<f32>().unwrap();
                        let cols = OUT / tp;
                        let what = format!("tp {tp} rank {rank} {format}");
                        let mut drift = 0f64;
                        for (row, (g, w)) in got.chunks(cols).zip(want.chunks(OUT)).enumerate() {
                            for (c, &v) in g.iter().enumerate() {
                                let column = rank * cols + c;
                                if column >= VALID {
                                    assert_eq!(v, f32::NEG_INFINITY, "{what}: padding logit [{row}, {column}]");
                                } else {
                                    drift = drift.max((v - w[column]).abs() as f64 / scale);
                                }
                            }
                        }
                        eprintln!("{what}: largest drift {drift:.4} of the largest output");
                        assert!(drift <= tol, "{what}: outputs drift by {drift} of the largest, more than {tol}");
                        let dy = Tensor::zeros(y.tensor().shape().clone(), DType::F32, &dev).unwrap();
                        let e = m.backward(&mut cx, saved, Act::new(dy)).unwrap_err().to_string();
                        assert!(e.contains("for inference only"), "{what}: {e}");
                    });
                }
            });
        }
    }
    // The single-rank model was never quantized: it still trains.
    assert!(single.head.weight().value().is_ok());
}
