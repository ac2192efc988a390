//! The learned position embedding against central finite differences in
//! f64, its errors, and its sequence-parallel form against one rank.

mod common;
use common::*;
use std::sync::Arc;
use tessera::dist::inproc::InProcess;
use tessera::module::{self, materialize, Groups, Plain, Replicated};
use tessera::nn::PositionEmbedding;
use tessera::prelude::*;

fn cx(dev: &Device) -> Cx {
    Cx::new(dev.clone()).with_dtype(DType::F64)
}

/// A table of 5 positions of width 3 with uniform values (rows 3 and 4 are
/// never read by a sequence of 3, so their gradient must be zero).
fn layer(dev: &Device) -> PositionEmbedding {
    let wpe = PositionEmbedding::new(5, 3).unwrap();
    materialize(&wpe, &cx(dev)).unwrap();
    wpe.weight().set_value(rand_t(11, &[5, 3], dev)).unwrap();
    wpe
}

#[test]
fn gradients_match_finite_differences() {
    let dev = cpu();
    let wpe = layer(&dev);
    let x = rand_t(12, &[2, 3, 3], &dev);
    let table = wpe.weight().value().unwrap();
    gradcheck(
        "position embedding",
        &[x, table],
        &[0, 1],
        |xs| {
            wpe.weight().set_value(xs[1].clone())?;
            Ok(wpe.forward(&mut cx(&dev), Act::new(xs[0].clone()))?.0.into_tensor())
        },
        |xs, dy| {
            wpe.weight().set_value(xs[1].clone())?;
            wpe.weight().take_grad();
            let c = &mut cx(&dev);
            let (_, saved) = wpe.forward(c, Act::new(xs[0].clone()))?;
            let dx = wpe.backward(c, saved, Act::new(dy.clone()))?;
            Ok(vec![dx.into_tensor(), wpe.weight().grad().expect("the table receives a gradient")])
        },
    );
}

#[test]
fn adds_the_rows_of_each_position() {
    let dev = cpu();
    let wpe = layer(&dev);
    let x = rand_t(13, &[2, 3, 3], &dev);
    let (y, saved) = wpe.forward(&mut cx(&dev), Act::new(x.clone())).unwrap();
    assert_eq!(saved.bytes(), 0);
    let (x, y, table) = (x.to_f64_vec().unwrap(), y.tensor().to_f64_vec().unwrap(), wpe.weight().value().unwrap().to_f64_vec().unwrap());
    for b in 0..2 {
        for t in 0..3 {
            for d in 0..3 {
                let i = (b * 3 + t) * 3 + d;
                assert_eq!(y[i], x[i] + table[t * 3 + d], "batch {b} position {t} value {d}");
            }
        }
    }
}

#[test]
fn refuses_long_sequences_and_bad_shapes() {
    let dev = cpu();
    let wpe = layer(&dev);
    let err = wpe.forward(&mut cx(&dev), Act::new(rand_t(1, &[1, 6, 3], &dev))).unwrap_err().to_string();
    assert!(err.contains("at most 5 tokens"), "{err}");
    let err = wpe.forward(&mut cx(&dev), Act::new(rand_t(1, &[1, 2, 4], &dev))).unwrap_err().to_string();
    assert!(err.contains("last dimension must be 3"), "{err}");
    let err = wpe.forward(&mut cx(&dev), Act::new(rand_t(1, &[6, 3], &dev))).unwrap_err().to_string();
    assert!(err.contains("[batch, seq, 3]"), "{err}");
    let err = PositionEmbedding::new(0, 3).unwrap_err().to_string();
    assert!(err.contains("max_positions"), "{err}");
}

/// Under sequence parallelism each of two ranks holds half of a sequence of
/// 4: its output is that half of the single-rank output, and the table's
/// gradient (summed over the group, as for every layer that reads a slice of
/// the tokens and is called as a sub-module) is the single-rank gradient.
#[test]
fn sequence_parallel_ranks_add_their_own_positions() {
    let dev = cpu();
    let wpe = layer(&dev);
    let x = rand_t(14, &[2, 4, 3], &dev);
    let dy = rand_t(15, &[2, 4, 3], &dev);
    let c = &mut cx(&dev);
    let (y, saved) = wpe.forward(c, Act::new(x.clone())).unwrap();
    wpe.backward(c, saved, Act::new(dy.clone())).unwrap();
    let (y_full, g_full) = (y.into_tensor(), wpe.weight().grad().unwrap().to_f64_vec().unwrap());
    let table = wpe.weight().value().unwrap();

    let world = InProcess::new(2).unwrap();
    std::thread::scope(|s| {
        for rank in 0..2 {
            let (world, x, dy, y_full, g_full, table) = (&world, &x, &dy, &y_full, &g_full, &table);
            s.spawn(move || {
                let dev = Device::cpu();
                let mut groups = Groups::single();
                groups.tp = Arc::new(world.communicator(rank, &dev).unwrap());
                let c = &mut Cx::new(dev.clone()).with_dtype(DType::F64).with_groups(groups).with_sequence_parallel(true);
                let wpe = PositionEmbedding::new(5, 3).unwrap();
                materialize(&wpe, c).unwrap();
                wpe.weight().set_value(Tensor::from_vec(table.to_f64_vec().unwrap(), [5, 3], &dev).unwrap()).unwrap();
                let half = |t: &Tensor| Tensor::from_vec(t.narrow(1, 2 * rank, 2).unwrap().to_f64_vec().unwrap(), [2, 2, 3], &dev).unwrap();
                let (y, saved) = module::call::<Plain, _, Replicated>(&wpe, c, "wpe", Act::new(half(x))).unwrap();
                assert_eq!(y.tensor().to_f64_vec().unwrap(), half(y_full).to_f64_vec().unwrap(), "rank {rank}: output");
                module::call_backward::<Plain, _>(&wpe, c, "wpe", saved, Act::new(half(dy))).unwrap();
                assert_close(&wpe.weight().grad().unwrap().to_f64_vec().unwrap(), g_full, 1e-14, 1e-12, &format!("rank {rank}: table gradient"));
            });
        }
    });
}
