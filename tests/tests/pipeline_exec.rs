//! Pipeline schedules run for real on in-process stages: gradients and
//! losses equal the single-rank run, and activation memory follows the
//! schedule (1F1B holds at most p microbatches, GPipe all m, ZB-H1 p on
//! every stage).

mod common;
use common::models::Gpt;
use common::*;
use std::sync::Arc;
use tessera::dist::inproc::InProcess;
use tessera::module::{self, Act, Cx, Groups, Module, Param, SplitHidden};
use tessera::ops;
use tessera::parallel::pipeline::{run_stage, sync_tied_grads, ScheduleKind, StageReport};
use tessera::prelude::*;

type Grads = Vec<(String, Param, Option<Vec<f64>>)>;

fn grads<M: Module>(m: &M) -> Grads {
    let mut out: Grads = Vec::new();
    module::visit_params(m, |e| {
        if !out.iter().any(|(_, p, _)| p.same(e.param)) {
            out.push((e.name.to_string(), e.param.clone(), e.param.grad().map(|g| g.to_f64_vec()).transpose()?));
        }
        Ok(())
    })
    .unwrap();
    out
}

const VOCAB: usize = 12;

fn batch(m: usize, t: usize, dev: &Device) -> (Vec<Tensor>, Vec<Tensor>) {
    let ids = |mb: usize, salt: usize| -> Vec<u32> { (0..t).map(|i| ((mb * 7 + i * 5 + salt) % VOCAB) as u32).collect() };
    let inputs = (0..m).map(|mb| Tensor::from_vec(ids(mb, 1), [1, t], dev).unwrap()).collect();
    let targets = (0..m).map(|mb| Tensor::from_vec(ids(mb, 4), [1, t], dev).unwrap()).collect();
    (inputs, targets)
}

/// Mean cross-entropy of one microbatch, its gradient scaled by `1 / m`.
fn loss(out: &Act<SplitHidden>, targets: &Tensor, m: usize) -> tessera::Result<(f64, Act<SplitHidden>)> {
    let (l, saved) = ops::cross_entropy(out.tensor(), targets, None)?;
    let d = ops::cross_entropy_backward(out.tensor(), targets, None, &saved, 1.0 / m as f64)?;
    Ok((l.to_scalar()?, Act::new(d)))
}

fn single_rank(layers: usize, m: usize, t: usize) -> (Grads, Vec<f64>) {
    let mut cx = Cx::new(Device::cpu()).with_dtype(DType::F64).with_seed(3);
    let gpt = module::build(Gpt::new(VOCAB, 8, 2, layers).unwrap(), &cx).unwrap();
    let (inputs, targets) = batch(m, t, cx.device());
    let mut losses = Vec::new();
    for (x, y) in inputs.iter().zip(&targets) {
        let (out, saved) = gpt.forward(&mut cx, Act::new(x.clone())).unwrap();
        let (l, dy) = loss(&out, y, m).unwrap();
        losses.push(l);
        gpt.backward(&mut cx, saved, dy).unwrap();
    }
    (grads(&gpt), losses)
}

fn pipelined(kind: ScheduleKind, stages: usize, layers: usize, m: usize, t: usize, dtype: DType) -> Vec<(Grads, StageReport)> {
    let schedule = kind.build(stages, m).unwrap();
    let world = InProcess::new(stages).unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..stages)
            .map(|stage| {
                let (world, schedule) = (&world, &schedule);
                s.spawn(move || {
                    let dev = Device::cpu();
                    let mut groups = Groups::single();
                    groups.pp = Arc::new(world.communicator(stage, &dev).unwrap());
                    let mut cx = Cx::new(dev.clone()).with_dtype(dtype).with_seed(3).with_groups(groups);
                    let gpt = module::build(Gpt::new(VOCAB, 8, 2, layers).unwrap(), &cx).unwrap();
                    let (inputs, targets) = batch(m, t, &dev);
                    let report = run_stage(&gpt, &mut cx, schedule, stage, &inputs, |mb, out| loss(out, &targets[mb], m)).unwrap();
                    sync_tied_grads(&gpt, &cx).unwrap();
                    (grads(&gpt), report)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn every_schedule_computes_the_single_rank_gradients() {
    let (layers, m, t) = (4, 4, 3);
    let (reference, ref_losses) = single_rank(layers, m, t);
    let cases = [
        (ScheduleKind::GPipe, 2),
        (ScheduleKind::OneFOneB, 2),
        (ScheduleKind::OneFOneB, 4),
        (ScheduleKind::Interleaved { chunks: 2 }, 2),
        (ScheduleKind::ZeroBubbleH1, 1),
        (ScheduleKind::ZeroBubbleH1, 2),
        (ScheduleKind::ZeroBubbleH1, 4),
    ];
    for (kind, stages) in cases {
        let ranks = pipelined(kind, stages, layers, m, t, DType::F64);
        let mut covered = vec![false; reference.len()];
        for (stage, (g, report)) in ranks.iter().enumerate() {
            for (i, ((name, _, got), (_, _, want))) in g.iter().zip(&reference).enumerate() {
                if let Some(got) = got {
                    assert_close(got, want.as_ref().unwrap(), 1e-12, 1e-10, &format!("{kind:?} p{stages} stage {stage}: {name}"));
                    covered[i] = true;
                }
            }
            if stage == stages - 1 {
                let mut losses = report.losses.clone();
                losses.sort_by_key(|(mb, _)| *mb);
                let got: Vec<f64> = losses.iter().map(|(_, l)| *l).collect();
                assert_close(&got, &ref_losses, 1e-12, 1e-12, &format!("{kind:?} p{stages}: losses"));
            }
        }
        assert!(covered.iter().all(|&c| c), "{kind:?} p{stages}: every parameter got its gradient on some stage");
    }
}

#[test]
fn one_f_one_b_holds_at_most_p_microbatches_and_gpipe_all() {
    let (stages, layers, m, t) = (2, 4, 8, 64);
    let gpipe = pipelined(ScheduleKind::GPipe, stages, layers, m, t, DType::F32);
    let ofob = pipelined(ScheduleKind::OneFOneB, stages, layers, m, t, DType::F32);
    assert_eq!(gpipe[0].1.peak_in_flight, m);
    assert_eq!(ofob[0].1.peak_in_flight, stages);
    // Measured: the first stage's activation bytes grow with the microbatches in flight.
    let (g, o) = (gpipe[0].1.peak_activation_bytes, ofob[0].1.peak_activation_bytes);
    let per_microbatch = (g - o) / (m - stages);
    assert!(per_microbatch > 0, "GPipe {g} vs 1F1B {o}");
    assert!(g >= m * per_microbatch, "GPipe holds all {m} microbatches: {g} bytes, {per_microbatch} each");
    assert!(o <= (stages + 1) * per_microbatch, "1F1B holds about {stages}: {o} bytes, {per_microbatch} each");
}

#[test]
fn zero_bubble_h1_holds_p_microbatches_until_their_weight_halves() {
    let (stages, layers, m, t) = (2, 4, 8, 64);
    let ofob = pipelined(ScheduleKind::OneFOneB, stages, layers, m, t, DType::F32);
    let zb = pipelined(ScheduleKind::ZeroBubbleH1, stages, layers, m, t, DType::F32);
    let gpipe = pipelined(ScheduleKind::GPipe, stages, layers, m, t, DType::F32);
    // The schedule's count, measured by the executor: p on every stage.
    assert_eq!(zb.iter().map(|(_, r)| r.peak_in_flight).collect::<Vec<_>>(), vec![stages; stages]);
    // And the bytes: the last stage holds more than under 1F1B (its weight
    // halves wait), the first no more than 1F1B's first, far below GPipe.
    let bytes = |run: &[(Grads, StageReport)], s: usize| run[s].1.peak_activation_bytes;
    let per_microbatch = (bytes(&gpipe, 0) - bytes(&ofob, 0)) / (m - stages);
    assert!(bytes(&zb, 1) > bytes(&ofob, 1), "ZB-H1's last stage holds its postponed weight halves: {} vs 1F1B {}", bytes(&zb, 1), bytes(&ofob, 1));
    assert!(bytes(&zb, 0) <= bytes(&ofob, 0) + per_microbatch / 4, "first stage: ZB-H1 {} vs 1F1B {}", bytes(&zb, 0), bytes(&ofob, 0));
    for s in 0..stages {
        assert!(bytes(&zb, s) <= (stages + 1) * per_microbatch, "stage {s}: {} bytes, {per_microbatch} a microbatch", bytes(&zb, s));
    }
    // Every action ran, the halves as such.
    let spans = &zb[0].1.spans;
    assert_eq!(spans.iter().filter(|s| matches!(s.action, tessera::parallel::pipeline::Action::BackwardWeight { .. })).count(), m);
}
