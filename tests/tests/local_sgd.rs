//! Local SGD and DiLoCo's outer step, held against an f64 reference: the
//! mean outer gradient over the replicas, Nesterov momentum over rounds,
//! every replica leaving a meeting with the same parameters, and the
//! traffic of one all-reduce of the parameters.

mod common;
use common::models::GptBlock;
use common::*;
use std::sync::Arc;
use tessera::dist::inproc::InProcess;
use tessera::dist::Communicator;
use tessera::module::{self, Cx, Param};
use tessera::parallel::local_sgd::{LocalSgd, OuterConfig};
use tessera::prelude::*;

/// What one replica saw: the global values it left each meeting with, the
/// bytes each meeting sent, and the local values it brought.
struct Replica {
    starts: Vec<Vec<f64>>,
    met: Vec<Vec<Vec<f64>>>,
    locals: Vec<Vec<Vec<f64>>>,
    bytes: Vec<usize>,
}

/// `rounds` meetings of `replicas` replicas of a GPT block (f64, one seed):
/// before each, replica `r` moves every parameter by its own random step
/// from where the last meeting left it (the inner steps' work).
fn meetings(replicas: usize, config: OuterConfig, rounds: usize) -> Vec<Replica> {
    let world = InProcess::new(replicas).unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..replicas)
            .map(|r| {
                let world = &world;
                s.spawn(move || {
                    let dev = Device::cpu();
                    let comm: Arc<dyn Communicator> = Arc::new(world.communicator(r, &dev).unwrap());
                    let cx = Cx::new(dev.clone()).with_dtype(DType::F64).with_seed(7);
                    let block = module::build(GptBlock::new(8, 2).unwrap(), &cx).unwrap();
                    let mut engine = LocalSgd::new(&block, comm, None, config).unwrap();
                    let params: Vec<Param> = engine.params().to_vec();
                    let values = |params: &[Param]| params.iter().map(|p| p.value().unwrap().to_f64_vec().unwrap()).collect::<Vec<_>>();
                    let starts = values(&params);
                    engine.start(params.iter().map(|p| p.value().unwrap()).collect()).unwrap();
                    let (mut met, mut locals, mut bytes) = (Vec::new(), Vec::new(), Vec::new());
                    for round in 0..rounds {
                        let moved: Vec<Tensor> = params
                            .iter()
                            .enumerate()
                            .map(|(i, p)| {
                                let v = p.value().unwrap().to_f64_vec().unwrap();
                                let step = rand_vec((1000 * round + 100 * r + i) as u64, v.len());
                                let v: Vec<f64> = v.iter().zip(step).map(|(a, b)| a + 0.1 * b).collect();
                                Tensor::from_vec(v, p.local_shape().clone(), &dev).unwrap()
                            })
                            .collect();
                        locals.push(moved.iter().map(|t| t.to_f64_vec().unwrap()).collect());
                        let (global, stats) = engine.meet(&moved).unwrap();
                        for (p, v) in params.iter().zip(global) {
                            p.set_value(v).unwrap();
                        }
                        met.push(values(&params));
                        bytes.push(stats.bytes);
                    }
                    Replica { starts, met, locals, bytes }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The outer step in f64 from the replicas' local values: `Δ̄` the mean of
/// `global − local`, `v ← μv + Δ̄`, `global ← global − η(Δ̄ + μv)`.
fn reference(runs: &[Replica], config: OuterConfig) -> Vec<Vec<Vec<f64>>> {
    let mut global = runs[0].starts.clone();
    let mut velocity: Vec<Vec<f64>> = global.iter().map(|g| vec![0.0; g.len()]).collect();
    let mut out = Vec::new();
    for round in 0..runs[0].locals.len() {
        for (i, g) in global.iter_mut().enumerate() {
            for j in 0..g.len() {
                let d = runs.iter().map(|r| g[j] - r.locals[round][i][j]).sum::<f64>() / runs.len() as f64;
                velocity[i][j] = config.momentum * velocity[i][j] + d;
                g[j] -= config.lr * (d + config.momentum * velocity[i][j]);
            }
        }
        out.push(global.clone());
    }
    out
}

#[test]
fn the_outer_step_follows_the_reference_and_every_replica_leaves_with_the_same_parameters() {
    for (what, config, replicas) in [
        ("DiLoCo", OuterConfig::diloco(1), 3),
        ("averaging", OuterConfig::averaging(1), 2),
        ("momentum 0.5", OuterConfig { every: 1, lr: 1.3, momentum: 0.5 }, 4),
    ] {
        let runs = meetings(replicas, config, 3);
        let want = reference(&runs, config);
        for (round, want) in want.iter().enumerate() {
            for r in &runs {
                assert!(r.met[round] == runs[0].met[round], "{what}, round {round}: every replica leaves with the same parameters, bit for bit");
            }
            for (i, (got, want)) in runs[0].met[round].iter().zip(want).enumerate() {
                assert_close(got, want, 1e-13, 1e-12, &format!("{what}, round {round}, parameter {i}"));
            }
        }
        // One all-reduce of every parameter, in f64.
        let values: usize = runs[0].starts.iter().map(Vec::len).sum();
        assert!(runs.iter().all(|r| r.bytes.iter().all(|&b| b == 8 * values)), "{what}: bytes per meeting {:?}, expected {}", runs[0].bytes, 8 * values);
    }
}

/// Averaging after every step of plain SGD is data-parallel SGD: each
/// replica's `θ − lr·g_r`, averaged, is `θ − lr·mean(g)`.
#[test]
fn averaging_after_every_sgd_step_is_data_parallel_sgd() {
    let runs = meetings(2, OuterConfig::averaging(1), 2);
    let mut theta = runs[0].starts.clone();
    for round in 0..2 {
        for (i, t) in theta.iter_mut().enumerate() {
            for (j, x) in t.iter_mut().enumerate() {
                // Each replica's move from θ is its `−lr·g_r`.
                let mean_move = runs.iter().map(|r| r.locals[round][i][j] - *x).sum::<f64>() / 2.0;
                *x += mean_move;
            }
        }
        for (i, (got, want)) in runs[0].met[round].iter().zip(&theta).enumerate() {
            assert_close(got, want, 1e-14, 1e-13, &format!("round {round}, parameter {i}"));
        }
    }
}

/// The momentum matters: without it the rounds after the first differ.
/// (A deliberate check that the reference test above can fail: an engine
/// that ignored μ would match `averaging`-like updates, not these.)
#[test]
fn momentum_changes_the_later_rounds_only() {
    let with = OuterConfig { every: 1, lr: 0.7, momentum: 0.9 };
    let without = OuterConfig { momentum: 0.0, ..with };
    let (a, b) = (meetings(2, with, 2), meetings(2, without, 2));
    // The first round's velocity is Δ̄ itself: η(1 + μ)Δ̄ against ηΔ̄.
    assert!(a[0].met[0] != b[0].met[0]);
    let gap = |r: &Replica, s: &Replica| {
        r.met[1].iter().zip(&s.met[1]).map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs()).fold(0.0, f64::max)).fold(0.0, f64::max)
    };
    assert!(gap(&a[0], &b[0]) > 1e-3, "momentum carries over to the second round");
}

#[test]
fn bad_settings_and_values_are_refused_with_the_fix() {
    for (config, want) in [
        (OuterConfig { every: 0, lr: 0.7, momentum: 0.9 }, "H ≥ 1"),
        (OuterConfig { every: 5, lr: 0.0, momentum: 0.9 }, "outer learning rate of 0"),
        (OuterConfig { every: 5, lr: f64::NAN, momentum: 0.9 }, "outer learning rate of NaN"),
        (OuterConfig { every: 5, lr: 0.7, momentum: 1.0 }, "outer momentum of 1"),
    ] {
        let err = config.check().unwrap_err().to_string();
        assert!(err.contains(want), "{config:?}: {err}");
    }
    let world = InProcess::new(1).unwrap();
    let dev = Device::cpu();
    let comm: Arc<dyn Communicator> = Arc::new(world.communicator(0, &dev).unwrap());
    let cx = Cx::new(dev.clone()).with_dtype(DType::F64).with_seed(7);
    let block = module::build(GptBlock::new(8, 2).unwrap(), &cx).unwrap();
    let mut engine = LocalSgd::new(&block, comm, None, OuterConfig::diloco(4)).unwrap();
    let values: Vec<Tensor> = engine.params().iter().map(|p| p.value().unwrap()).collect();
    assert!(engine.meet(&values).unwrap_err().to_string().contains("call `start`"));
    assert!(engine.start(values[1..].to_vec()).unwrap_err().to_string().contains("values for the"));
    let mut swapped = values.clone();
    swapped.swap(0, 1);
    if swapped[0].shape() != values[0].shape() {
        assert!(engine.start(swapped).unwrap_err().to_string().contains("whose shard is"));
    }
    engine.start(values.clone()).unwrap();
    assert!(engine.due(4) && engine.due(8) && !engine.due(5));
}
