//! The mixture-of-experts layer: expert parallelism on in-process ranks
//! against single-rank runs, the capacity's drops against hand counts and
//! finite differences, and the load-balancing loss against a direct
//! computation and finite differences; all in f64.

mod common;
use common::*;
use std::sync::Arc;
use tessera::dist::inproc::InProcess;
use tessera::module::{self, materialize, Groups};
use tessera::nn::{Moe, MoeStats};
use tessera::prelude::*;

const DIM: usize = 4;
const HIDDEN: usize = 6;

fn cx(dev: &Device) -> Cx {
    Cx::new(dev.clone()).with_dtype(DType::F64)
}

/// Every parameter of `m` with its name, in visiting order.
fn params(m: &Moe) -> Vec<(String, Param)> {
    let mut out = Vec::new();
    module::visit_params(m, |e| {
        out.push((e.name.to_string(), e.param.clone()));
        Ok(())
    })
    .unwrap();
    out
}

/// Gives every parameter values in [-1, 1) drawn from its name, so a
/// parameter holds the same values on whichever rank holds it.
fn fill_by_name(m: &Moe) {
    for (name, p) in params(m) {
        let seed = name.bytes().fold(17u64, |h, b| h.wrapping_mul(31).wrapping_add(b as u64));
        let dev = p.value().unwrap().device().clone();
        p.set_value(rand_t(seed, p.local_shape().dims(), &dev)).unwrap();
    }
}

/// Forward and backward with upstream gradient `dy`: output, input gradient, stats.
fn pass(m: &Moe, c: &mut Cx, x: &Tensor, dy: &Tensor) -> (Vec<f64>, Vec<f64>, MoeStats) {
    let (y, saved) = m.forward(c, Act::new(x.clone())).unwrap();
    let stats = saved.stats().clone();
    let dx = m.backward(c, saved, Act::new(dy.clone())).unwrap();
    (y.tensor().to_f64_vec().unwrap(), dx.tensor().to_f64_vec().unwrap(), stats)
}

/// A copy of `t` on `dev` (each in-process rank has its own device).
fn on(t: &Tensor, dev: &Device) -> Tensor {
    Tensor::from_vec(t.to_f64_vec().unwrap(), t.shape().clone(), dev).unwrap()
}

fn grad_of(p: &Param) -> Vec<f64> {
    p.grad().expect("every parameter receives a gradient").to_f64_vec().unwrap()
}

fn configure(m: Moe, capacity: Option<f64>, aux: f64) -> Moe {
    let m = match capacity {
        Some(f) => m.with_capacity_factor(f).unwrap(),
        None => m,
    };
    m.with_aux_loss(aux).unwrap()
}

/// `ep` in-process ranks, each with its own tokens, against single-rank runs.
///
/// Reference: one single-rank layer with the same weights runs each rank's
/// tokens in turn, without clearing gradients in between for the experts.
/// The capacity and the load-balancing loss are per rank's tokens, so rank
/// `r`'s output, input gradient, statistics and router gradient must equal
/// the single-rank run on rank `r`'s tokens; an expert's gradient sums every
/// rank's tokens routed to it, which is what the experts accumulate over the
/// single-rank runs.
fn ep_matches_single_rank(ep: usize, experts: usize, top_k: usize, capacity: Option<f64>, aux: f64) {
    let dev = cpu();
    let shape = [2, 3, DIM];
    let xs: Vec<Tensor> = (0..ep).map(|r| rand_t(100 + r as u64, &shape, &dev)).collect();
    let dys: Vec<Tensor> = (0..ep).map(|r| rand_t(200 + r as u64, &shape, &dev)).collect();

    let single = configure(Moe::new(DIM, HIDDEN, experts, top_k).unwrap(), capacity, aux);
    let mut c = cx(&dev);
    materialize(&single, &c).unwrap();
    fill_by_name(&single);
    let mut expect = Vec::new();
    for (x, dy) in xs.iter().zip(&dys) {
        let (y, dx, stats) = pass(&single, &mut c, x, dy);
        let router = single.router().take_grad().unwrap().to_f64_vec().unwrap();
        expect.push((y, dx, stats, router));
    }
    let expert_grads: Vec<(String, Vec<f64>)> = params(&single).into_iter().skip(1).map(|(n, p)| (n, grad_of(&p))).collect();
    let total_kept: usize = expect.iter().map(|e| e.2.slots() - e.2.dropped_total()).sum();
    if capacity.is_some() {
        assert!(expect.iter().any(|e| e.2.dropped_total() > 0), "the capacity drops some slots, so drops cross ranks too");
    }

    let world = InProcess::new(ep).unwrap();
    let received: Vec<usize> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..ep)
            .map(|rank| {
                let (world, xs, dys, expect, expert_grads) = (&world, &xs, &dys, &expect, &expert_grads);
                s.spawn(move || {
                    let dev = Device::cpu();
                    let mut groups = Groups::single();
                    groups.ep = Arc::new(world.communicator(rank, &dev).unwrap());
                    let mut c = cx(&dev).with_groups(groups);
                    let m = configure(Moe::new(DIM, HIDDEN, experts, top_k).unwrap(), capacity, aux).with_expert_parallel(rank, ep).unwrap();
                    materialize(&m, &c).unwrap();
                    fill_by_name(&m);
                    let local = experts / ep;
                    assert_eq!(m.local_experts(), rank * local..(rank + 1) * local);
                    // Only this rank's experts exist here.
                    let mine = params(&m);
                    assert_eq!(mine.len(), 1 + 3 * local, "rank {rank}: router plus its {local} experts");
                    assert!(m.expert((rank + 1) % ep * local).is_none() && m.expert(rank * local).is_some());

                    let (y, dx, stats) = pass(&m, &mut c, &on(&xs[rank], &dev), &on(&dys[rank], &dev));
                    let (ey, edx, estats, erouter) = &expect[rank];
                    let what = |s: &str| format!("ep {ep} rank {rank}: {s}");
                    assert_close(&y, ey, 1e-13, 1e-11, &what("output"));
                    assert_close(&dx, edx, 1e-13, 1e-11, &what("input gradient"));
                    assert_eq!((&stats.routed, &stats.dropped, stats.capacity), (&estats.routed, &estats.dropped, estats.capacity), "{}", what("routing"));
                    assert_close(&[stats.aux_loss], &[estats.aux_loss], 1e-14, 1e-12, &what("aux loss"));
                    assert_close(&grad_of(m.router()), erouter, 1e-13, 1e-11, &what("router gradient"));
                    for (name, p) in &mine[1..] {
                        let (_, g) = expert_grads.iter().find(|(n, _)| n == name).expect("a parameter of the single-rank layer");
                        assert_close(&grad_of(p), g, 1e-13, 1e-11, &what(&format!("d/d {name}")));
                    }
                    assert_eq!(m.last_stats().as_ref(), Some(&stats));
                    stats.received.iter().sum::<usize>()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // Every kept slot was processed exactly once, somewhere.
    assert_eq!(received.iter().sum::<usize>(), total_kept);
}

#[test]
fn expert_parallel_on_two_ranks_equals_one_rank() {
    ep_matches_single_rank(2, 4, 2, None, 0.0);
    ep_matches_single_rank(2, 8, 2, Some(0.75), 0.3);
}

#[test]
fn expert_parallel_on_four_ranks_equals_one_rank() {
    ep_matches_single_rank(4, 8, 2, Some(1.0), 0.2);
    ep_matches_single_rank(4, 4, 1, None, 0.0);
}

/// With unlimited capacity and no load-balancing loss, two ranks equal one
/// rank running everybody's tokens as one batch: rank `r`'s rows of the
/// output and input gradient, and every expert's gradient.
#[test]
fn expert_parallel_equals_one_rank_over_all_tokens() {
    let (ep, experts) = (2, 4);
    let dev = cpu();
    let x_all = rand_t(300, &[ep * 5, DIM], &dev);
    let dy_all = rand_t(301, &[ep * 5, DIM], &dev);
    let single = Moe::new(DIM, HIDDEN, experts, 2).unwrap();
    let mut c = cx(&dev);
    materialize(&single, &c).unwrap();
    fill_by_name(&single);
    let (y_all, dx_all, _) = pass(&single, &mut c, &x_all, &dy_all);
    let reference: Vec<(String, Vec<f64>)> = params(&single).into_iter().map(|(n, p)| (n, grad_of(&p))).collect();

    let world = InProcess::new(ep).unwrap();
    let routers: Vec<Vec<f64>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..ep)
            .map(|rank| {
                let (world, x_all, dy_all, y_all, dx_all, reference) = (&world, &x_all, &dy_all, &y_all, &dx_all, &reference);
                s.spawn(move || {
                    let dev = Device::cpu();
                    let mut groups = Groups::single();
                    groups.ep = Arc::new(world.communicator(rank, &dev).unwrap());
                    let mut c = cx(&dev).with_groups(groups);
                    let m = Moe::new(DIM, HIDDEN, experts, 2).unwrap().with_expert_parallel(rank, ep).unwrap();
                    materialize(&m, &c).unwrap();
                    fill_by_name(&m);
                    let rows = |t: &Tensor| on(&t.narrow(0, rank * 5, 5).unwrap(), &dev);
                    let (y, dx, _) = pass(&m, &mut c, &rows(x_all), &rows(dy_all));
                    let range = rank * 5 * DIM..(rank + 1) * 5 * DIM;
                    assert_close(&y, &y_all[range.clone()], 1e-13, 1e-11, "output rows");
                    assert_close(&dx, &dx_all[range], 1e-13, 1e-11, "input gradient rows");
                    for (name, p) in &params(&m)[1..] {
                        let (_, g) = reference.iter().find(|(n, _)| n == name).unwrap();
                        assert_close(&grad_of(p), g, 1e-13, 1e-11, &format!("rank {rank}: d/d {name}"));
                    }
                    grad_of(m.router())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // The router's gradient over the whole batch is the sum of the ranks' parts.
    let summed: Vec<f64> = routers[0].iter().zip(&routers[1]).map(|(a, b)| a + b).collect();
    assert_close(&summed, &reference[0].1, 1e-13, 1e-11, "router gradient summed over ranks");
}

#[test]
fn one_expert_parallel_rank_is_the_plain_layer() {
    let dev = cpu();
    let x = rand_t(5, &[3, 2, DIM], &dev);
    let dy = rand_t(6, &[3, 2, DIM], &dev);
    let run = |m: Moe| {
        let mut c = cx(&dev);
        materialize(&m, &c).unwrap();
        fill_by_name(&m);
        let (y, dx, _) = pass(&m, &mut c, &x, &dy);
        let grads: Vec<Vec<f64>> = params(&m).iter().map(|(_, p)| grad_of(p)).collect();
        (y, dx, grads)
    };
    let plain = run(Moe::new(DIM, HIDDEN, 4, 2).unwrap());
    let split = run(Moe::new(DIM, HIDDEN, 4, 2).unwrap().with_expert_parallel(0, 1).unwrap());
    assert_eq!(plain, split);
}

#[test]
fn configuration_errors_name_the_problem() {
    let err = Moe::new(DIM, HIDDEN, 6, 2).unwrap().with_expert_parallel(1, 4).unwrap_err().to_string();
    assert!(err.contains("6 experts") && err.contains("group of 4"), "{err}");
    assert!(Moe::new(DIM, HIDDEN, 4, 2).unwrap().with_expert_parallel(2, 2).is_err());
    assert!(Moe::new(DIM, HIDDEN, 4, 2).unwrap().with_capacity_factor(0.0).is_err());
    assert!(Moe::new(DIM, HIDDEN, 4, 2).unwrap().with_capacity_factor(f64::NAN).is_err());
    assert!(Moe::new(DIM, HIDDEN, 4, 2).unwrap().with_aux_loss(-1.0).is_err());
    // A layer split for two ranks refuses to run in a group of one.
    let dev = cpu();
    let m = Moe::new(DIM, HIDDEN, 4, 2).unwrap().with_expert_parallel(1, 2).unwrap();
    let mut c = cx(&dev);
    materialize(&m, &c).unwrap();
    let err = m.forward(&mut c, Act::new(rand_t(1, &[2, DIM], &dev))).unwrap_err().to_string();
    assert!(err.contains("with_expert_parallel(0, 1)"), "{err}");
}

/// Runs `m` forward on `xs[0]` with parameters `xs[1..]`; returns the output and the stats.
fn eval(m: &Moe, ps: &[Param], xs: &[Tensor]) -> (Tensor, MoeStats) {
    for (p, v) in ps.iter().zip(&xs[1..]) {
        p.set_value(v.clone()).unwrap();
    }
    let (y, saved) = m.forward(&mut cx(xs[0].device()), Act::new(xs[0].clone())).unwrap();
    (y.into_tensor(), saved.stats().clone())
}

/// Runs `m` forward on `x` with its current parameters.
fn fwd(m: &Moe, x: &Tensor) -> (Tensor, MoeStats) {
    eval(m, &[], std::slice::from_ref(x))
}

/// Checks the input and every parameter gradient of `<y, dy> + coef · aux`
/// (what the backward differentiates) against central differences.
fn fd_check(name: &str, m: &Moe, x: Tensor) {
    let ps: Vec<Param> = params(m).into_iter().map(|(_, p)| p).collect();
    let mut inputs = vec![x];
    inputs.extend(ps.iter().map(|p| p.value().unwrap()));
    let dev = inputs[0].device().clone();
    let dy_vals = rand_vec(0xD1, inputs[0].elem_count());
    let dy = Tensor::from_vec(dy_vals.clone(), inputs[0].shape().clone(), &dev).unwrap();
    let objective = |xs: &[Tensor]| {
        let (y, stats) = eval(m, &ps, xs);
        y.to_f64_vec().unwrap().iter().zip(&dy_vals).map(|(a, b)| a * b).sum::<f64>() + stats.aux_contribution()
    };
    for p in &ps {
        p.take_grad();
    }
    eval(m, &ps, &inputs);
    let mut c = cx(&dev);
    let (_, saved) = m.forward(&mut c, Act::new(inputs[0].clone())).unwrap();
    let dx = m.backward(&mut c, saved, Act::new(dy)).unwrap().into_tensor();
    let grads: Vec<Tensor> = std::iter::once(dx).chain(ps.iter().map(|p| p.grad().unwrap())).collect();
    let eps = 1e-6;
    for (i, g) in grads.iter().enumerate() {
        let base = inputs[i].to_f64_vec().unwrap();
        let numeric: Vec<f64> = (0..base.len())
            .map(|j| {
                let at = |delta: f64| {
                    let mut v = base.clone();
                    v[j] += delta;
                    let mut xs = inputs.clone();
                    xs[i] = Tensor::from_vec(v, inputs[i].shape().clone(), &dev).unwrap();
                    objective(&xs)
                };
                (at(eps) - at(-eps)) / (2.0 * eps)
            })
            .collect();
        assert_close(&g.to_f64_vec().unwrap(), &numeric, 1e-6, 1e-5, &format!("{name}: d/d input {i}"));
    }
    eval(m, &ps, &inputs);
}

/// A router that ranks the experts 0 > 1 > 2 > 3 for every positive token.
fn ranked_router(m: &Moe, dev: &Device) {
    let rows: Vec<f64> = [1.0, 0.5, -0.5, -1.0].iter().flat_map(|&v| [v; DIM]).collect();
    m.router().set_value(Tensor::from_vec(rows, [4, DIM], dev).unwrap()).unwrap();
}

#[test]
fn capacity_drops_the_overflow() {
    let dev = cpu();
    // 6 positive tokens, top-2 of 4 experts, all choosing (0, 1): the capacity
    // is ceil(1.0 · 6 · 2 / 4) = 3, so experts 0 and 1 keep the first three
    // tokens each and drop the other three; tokens 3..6 lose both slots.
    let x = Tensor::from_vec(rand_vec(40, 6 * DIM).iter().map(|v| 0.6 + 0.4 * v).collect::<Vec<_>>(), [6, DIM], &dev).unwrap();
    let build = |cap: Option<f64>| {
        let m = configure(Moe::new(DIM, HIDDEN, 4, 2).unwrap(), cap, 0.0);
        materialize(&m, &cx(&dev)).unwrap();
        fill_by_name(&m);
        ranked_router(&m, &dev);
        m
    };
    let capped = build(Some(1.0));
    let free = build(None);
    let (y, stats) = fwd(&capped, &x);
    assert_eq!(stats.capacity, Some(3));
    assert_eq!(stats.routed, [6, 6, 0, 0]);
    assert_eq!(stats.dropped, [3, 3, 0, 0]);
    assert_eq!(stats.dropped_total(), 6);
    assert_eq!(stats.drop_fraction(), 0.5);
    assert_eq!(stats.received, [3, 3, 0, 0]);
    let (y_free, free_stats) = fwd(&free, &x);
    assert_eq!((free_stats.capacity, free_stats.dropped_total()), (None, 0));
    let (y, y_free) = (y.to_f64_vec().unwrap(), y_free.to_f64_vec().unwrap());
    // Tokens that kept both slots are untouched; dropped tokens get nothing.
    assert_eq!(y[..3 * DIM], y_free[..3 * DIM]);
    assert!(y[3 * DIM..].iter().all(|&v| v == 0.0));
    assert!(y_free[3 * DIM..].iter().any(|&v| v != 0.0));
    fd_check("crafted capacity", &capped, x);

    // Random routing with partial drops: still exact gradients.
    let m = configure(Moe::new(DIM, HIDDEN, 4, 2).unwrap(), Some(0.5), 0.0);
    materialize(&m, &cx(&dev)).unwrap();
    fill_by_name(&m);
    let x = rand_t(41, &[2, 4, DIM], &dev);
    let (_, stats) = fwd(&m, &x);
    assert_eq!(stats.capacity, Some(2));
    assert!(stats.dropped_total() > 0 && stats.dropped_total() < stats.slots(), "{stats:?}");
    fd_check("random capacity", &m, x);
}

/// `E · Σ_e f_e · P_e` computed directly from the weights.
fn direct_aux(x: &[f64], router: &[f64], experts: usize, top_k: usize) -> f64 {
    let n = x.len() / DIM;
    let (mut f, mut p) = (vec![0.0; experts], vec![0.0; experts]);
    for t in 0..n {
        let logits: Vec<f64> = (0..experts).map(|e| (0..DIM).map(|i| x[t * DIM + i] * router[e * DIM + i]).sum()).collect();
        let max = logits.iter().cloned().fold(f64::MIN, f64::max);
        let z: f64 = logits.iter().map(|l| (l - max).exp()).sum();
        for e in 0..experts {
            p[e] += (logits[e] - max).exp() / z / n as f64;
        }
        let mut order: Vec<usize> = (0..experts).collect();
        order.sort_by(|&a, &b| logits[b].partial_cmp(&logits[a]).unwrap().then(a.cmp(&b)));
        for &e in &order[..top_k] {
            f[e] += 1.0 / (n * top_k) as f64;
        }
    }
    experts as f64 * f.iter().zip(&p).map(|(a, b)| a * b).sum::<f64>()
}

#[test]
fn load_balancing_loss() {
    let dev = cpu();
    let m = Moe::new(DIM, HIDDEN, 4, 2).unwrap().with_aux_loss(0.7).unwrap();
    materialize(&m, &cx(&dev)).unwrap();
    fill_by_name(&m);
    let x = rand_t(50, &[2, 3, DIM], &dev);
    let (_, stats) = fwd(&m, &x);
    let expect = direct_aux(&x.to_f64_vec().unwrap(), &m.router().value().unwrap().to_f64_vec().unwrap(), 4, 2);
    assert_close(&[stats.aux_loss], &[expect], 1e-14, 1e-12, "aux loss");
    assert_eq!(stats.aux_coef, 0.7);
    assert!(stats.aux_loss > 1.0, "unbalanced routing costs more than 1: {}", stats.aux_loss);
    fd_check("aux loss", &m, x.clone());

    // Off by default: reported, but the gradient is the plain layer's.
    let plain = Moe::new(DIM, HIDDEN, 4, 2).unwrap();
    materialize(&plain, &cx(&dev)).unwrap();
    fill_by_name(&plain);
    let (_, plain_stats) = eval(&plain, &[], &[x]);
    assert_eq!(plain_stats.aux_loss, stats.aux_loss);
    assert_eq!(plain_stats.aux_contribution(), 0.0);

    // Perfectly uniform routing: token i (one-hot) goes to expert i, and the
    // mean router probability of every expert is 1/E by symmetry.
    let m = Moe::new(DIM, HIDDEN, 4, 1).unwrap().with_aux_loss(1.0).unwrap();
    materialize(&m, &cx(&dev)).unwrap();
    let eye: Vec<f64> = (0..16).map(|i| if i % 5 == 0 { 1.0 } else { 0.0 }).collect();
    m.router().set_value(Tensor::from_vec(eye.iter().map(|v| 3.0 * v).collect::<Vec<_>>(), [4, 4], &dev).unwrap()).unwrap();
    let (_, stats) = eval(&m, &[], &[Tensor::from_vec(eye, [4, DIM], &dev).unwrap()]);
    assert_eq!(stats.routed, [1, 1, 1, 1]);
    assert_close(&[stats.aux_loss, stats.aux_contribution()], &[1.0, 1.0], 1e-15, 1e-15, "uniform routing");
}
