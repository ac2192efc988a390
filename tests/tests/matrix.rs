//! The equivalence matrix: a small GPT trained for three AdamW steps under
//! each parallel configuration ends with the parameters and losses of the
//! single-rank run (f32, relative error of every parameter tensor ≤ 1e-5).
//!
//! The model's query/key/value projection has no bias: the key part of such
//! a bias gets no gradient at all (softmax ignores a shift of every score),
//! and Adam turns the rounding noise left in it into updates, which differ
//! between any two summation orders.

mod common;
use common::models::{Gpt, MoeGpt, RecomputeGpt, RecomputeMoeGpt};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use tessera::dist::inproc::{mesh_groups, InProcess};
use tessera::dist::mesh::{Axis, Mesh};
use tessera::dist::Communicator;
use tessera::module::{self, Cx, Param, RecomputeOverride, Replicated, Shard, SplitHidden, Staged};
use tessera::nn::{vocab_parallel_cross_entropy, vocab_parallel_cross_entropy_backward};
use tessera::ops;
use tessera::optim::AdamWConfig;
use tessera::parallel::pipeline::{run_stage, sync_tied_grads, ScheduleKind};
use tessera::parallel::zero::{Stage, Zero, ZeroConfig};
use tessera::prelude::*;
use tessera::train::{clip_grad_norm, NormClasses};

const VOCAB: usize = 12;
const SEQS: usize = 4;
const TOKENS: usize = 4;
const LAYERS: usize = 4;
const STEPS: usize = 3;

#[derive(Clone, Copy, Debug)]
struct Config {
    mesh: &'static str,
    schedule: ScheduleKind,
    sequence_parallel: bool,
    /// Pieces the sequence-parallel collectives are cut into (1: whole).
    tp_overlap: usize,
    recompute: Option<RecomputeOverride>,
    /// Train with a ZeRO engine over the data-parallel group instead of
    /// averaging gradients and running AdamW on every replica.
    zero: Option<Stage>,
    /// Clip the global gradient norm to this before each update.
    clip: Option<f64>,
    /// ZeRO-Offload (with `zero`) and activation offload (with recompute).
    offload: bool,
}

impl Config {
    fn new(mesh: &'static str) -> Self {
        Config { mesh, schedule: ScheduleKind::OneFOneB, sequence_parallel: false, tp_overlap: 1, recompute: None, zero: None, clip: None, offload: false }
    }
}

/// The optimizer of every run: AdamW, learning rate 1e-2, weight decay 0.01.
/// eps is 1e-6 rather than 1e-8: Adam divides each gradient by its own
/// running magnitude, so for a weight an expert barely used, 1e-8 turns f32
/// rounding differences between summation orders into visible updates.
const ADAMW: AdamWConfig = AdamWConfig { beta1: 0.9, beta2: 0.999, eps: 1e-6, weight_decay: 0.01 };
const LR: f64 = 1e-2;

/// The sequences of step `step`: ids and next-token targets.
fn data(step: usize, seq: usize) -> (Vec<u32>, Vec<u32>) {
    let tok = |i: usize| ((step * 13 + seq * 7 + i * 5 + i * i) % VOCAB) as u32;
    ((0..TOKENS).map(tok).collect(), (1..=TOKENS).map(tok).collect())
}

/// What a run ends with: the mean loss of every step, and every parameter's full value.
type Outcome = (Vec<f64>, BTreeMap<String, Vec<f32>>);

/// Builds the model for a rank whose expert-parallel coordinate and degree are given.
trait Make<M>: Fn(usize, usize) -> tessera::Result<M> + Sync {}
impl<M, F: Fn(usize, usize) -> tessera::Result<M> + Sync> Make<M> for F {}

fn train<M: Staged<In = Replicated, Out = SplitHidden>>(cfg: Config, make: impl Make<M>) -> Outcome {
    let world_size: usize = cfg.mesh.split(',').map(|a| a.trim_start_matches(|c: char| c.is_alphabetic()).parse::<usize>().unwrap()).product();
    let mesh = Mesh::parse(cfg.mesh, world_size, world_size).unwrap();
    let world = InProcess::new(world_size).unwrap();
    let results: Vec<Outcome> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world_size)
            .map(|rank| {
                let (world, mesh, make) = (&world, &mesh, &make);
                s.spawn(move || run_rank(cfg, world, mesh, rank, make))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut losses = Vec::new();
    let mut params = BTreeMap::new();
    for (l, p) in results {
        if !l.is_empty() {
            losses = l;
        }
        params.extend(p);
    }
    (losses, params)
}

fn run_rank<M: Staged<In = Replicated, Out = SplitHidden>>(cfg: Config, world: &InProcess, mesh: &Mesh, rank: usize, make: &impl Make<M>) -> Outcome {
    let dev = Device::cpu();
    let coords = mesh.coords(rank).unwrap();
    let (dp, ep, pp) = (mesh.size(Axis::Dp), mesh.size(Axis::Ep), mesh.size(Axis::Pp));
    let (d, e, t, stage) = (coords[Axis::Dp], coords[Axis::Ep], coords[Axis::Tp], coords[Axis::Pp]);
    let groups = mesh_groups(world, mesh, rank, &dev).unwrap();
    let (tp_group, dp_group, ep_group) = (groups.tp.clone(), groups.dp.clone(), groups.ep.clone());
    let mut cx = Cx::new(dev.clone()).with_seed(11).with_groups(groups).with_sequence_parallel(cfg.sequence_parallel).with_tp_overlap(cfg.tp_overlap);
    if let Some(r) = cfg.recompute {
        cx.set_recompute_override(r);
    }
    if cfg.offload {
        cx = cx.with_activation_offload(Device::cpu());
    }
    if pp > 1 {
        // Each stage materialises only its own layers, as the trainer's do.
        cx = cx.with_pipeline_chunks(match cfg.schedule {
            ScheduleKind::Interleaved { chunks } => chunks,
            _ => 1,
        });
    }
    let model = module::build(make(e, ep).unwrap(), &cx).unwrap();
    let zero = cfg.zero.map(|stage| {
        let config = ZeroConfig::new(stage).with_adamw(ADAMW).with_bucket_bytes(2048).with_offload(cfg.offload);
        Arc::new(if ep > 1 { Zero::with_experts(&model, cx.groups(), config) } else { Zero::new(&model, dp_group.clone(), config) }.unwrap())
    });
    if let Some(z) = &zero {
        cx = cx.with_hooks(z.clone());
    }
    // Data replicas: every (dp, ep) coordinate sees its own sequences.
    let replicas = dp * ep;
    let replica = d * ep + e;
    let per_replica = SEQS / replicas;
    let schedule = cfg.schedule.build(pp, per_replica).unwrap();
    let mut moments: BTreeMap<String, (Tensor, Tensor)> = BTreeMap::new();
    let mut trained: BTreeSet<String> = BTreeSet::new();
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let seqs: Vec<_> = (0..per_replica).map(|i| data(step, replica * per_replica + i)).collect();
        let inputs: Vec<Tensor> = seqs.iter().map(|(x, _)| Tensor::from_vec(x.clone(), [1, TOKENS], &dev).unwrap()).collect();
        let targets: Vec<Tensor> = seqs.iter().map(|(_, y)| Tensor::from_vec(y.clone(), [1, TOKENS], &dev).unwrap()).collect();
        // Each microbatch's loss is its mean; the step's loss is the mean over all of them.
        let report = run_stage(&model, &mut cx, &schedule, stage, &inputs, |mb, out| {
            let (l, saved) = vocab_parallel_cross_entropy(&*tp_group, out, &targets[mb], VOCAB, None)?;
            let dl = vocab_parallel_cross_entropy_backward(out, &targets[mb], VOCAB, None, &saved, 1.0 / per_replica as f64)?;
            Ok((l.to_scalar()?, dl))
        })
        .unwrap();
        sync_tied_grads(&model, &cx).unwrap();
        // (A ZeRO engine has already taken the gradients of full buckets: with
        // one stage, every parameter of the model is trained.)
        trained.extend(params_with_grads(&model));
        if zero.is_some() {
            module::visit_params(&model, |p| {
                if !p.param.is_remote() {
                    trained.insert(p.name.to_string());
                }
                Ok(())
            })
            .unwrap();
        }
        match &zero {
            Some(z) => {
                // The norm over the shards, the same on every rank at every
                // stage, each class of parameter summed over the groups it
                // is split over (tp, pp).
                let factor = cfg.clip.map_or(1.0, |max| {
                    let classes = NormClasses::of(&model, &cx).unwrap();
                    let squares = z.grad_squares(NormClasses::COUNT, |p| classes.class(p)).unwrap();
                    let norm = classes.norm(squares.try_into().unwrap(), &cx).unwrap();
                    assert!(norm > max, "the clipping threshold {max} must bite (norm {norm})");
                    max / (norm + 1e-6)
                });
                z.step_scaled(LR, factor).unwrap()
            }
            None => {
                average_grads(&model, &*dp_group, &*ep_group, replicas);
                if let Some(max) = cfg.clip {
                    let norm = clip_grad_norm(&model, &cx, max).unwrap();
                    assert!(norm > max, "the clipping threshold {max} must bite (norm {norm})");
                }
                adamw_step(&model, step, &mut moments);
            }
        }
        if stage == pp - 1 {
            let local: f64 = report.losses.iter().map(|(_, l)| l).sum::<f64>() / per_replica as f64;
            let sum = dp_group.all_reduce_sum(&Tensor::from_vec(vec![local], [1], &dev).unwrap()).unwrap();
            let mean = ep_group.all_reduce_sum(&sum).unwrap().to_scalar().unwrap() / replicas as f64;
            losses.push(mean);
        }
    }
    // Every parameter this stage trained, whole (ZeRO and tensor-parallel shards gathered).
    let gathered: BTreeMap<String, Tensor> = match &zero {
        Some(z) => z.gather_parameters().unwrap().into_iter().collect(),
        None => BTreeMap::new(),
    };
    let mut out = BTreeMap::new();
    let mut seen: Vec<Param> = Vec::new();
    module::visit_params(&model, |p| {
        // A tied weight is reported once, under its first name.
        if !trained.contains(p.name) || seen.iter().any(|q| q.same(p.param)) {
            return Ok(());
        }
        seen.push(p.param.clone());
        let v = match gathered.get(p.name) {
            Some(v) => v.clone(),
            None => p.param.value()?,
        };
        let whole = match p.param.shard() {
            Shard::Split { dim, .. } => tp_group.all_gather(&v, dim)?,
            Shard::Full => v,
        };
        out.insert(p.name.to_string(), whole.to_vec::<f32>()?);
        Ok(())
    })
    .unwrap();
    // Report from one copy of each parameter: dp and tp coordinate 0; every
    // expert-parallel rank reports its own experts (the rest are replicated).
    let keep = d == 0 && t == 0;
    if e != 0 {
        out.retain(|name, _| name.contains(".experts."));
    }
    (if keep && e == 0 && stage == pp - 1 { losses } else { vec![] }, if keep { out } else { BTreeMap::new() })
}

/// Names of the parameters that have a gradient now.
fn params_with_grads<M: module::Module>(m: &M) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    module::visit_params(m, |p| {
        if p.param.grad().is_some() {
            names.insert(p.name.to_string());
        }
        Ok(())
    })
    .unwrap();
    names
}

/// Averages every gradient over the data replicas.
///
/// An expert's gradient already holds every expert-parallel rank's tokens
/// (the all-to-all brought them to it); every other parameter is replicated
/// over the expert-parallel group too, and sums over it as well.
fn average_grads<M: module::Module>(model: &M, dp_group: &dyn Communicator, ep_group: &dyn Communicator, replicas: usize) {
    for (name, p) in distinct_params(model) {
        let Some(g) = p.grad() else { continue };
        let mut g = dp_group.all_reduce_sum(&g).unwrap();
        if !name.contains(".experts.") {
            g = ep_group.all_reduce_sum(&g).unwrap();
        }
        p.set_grad(ops::scale(&g, 1.0 / replicas as f64).unwrap()).unwrap();
    }
}

/// One AdamW update of every parameter with a gradient, taking the gradients.
fn adamw_step<M: module::Module>(model: &M, step: usize, moments: &mut BTreeMap<String, (Tensor, Tensor)>) {
    let adamw = ADAMW.at(step as u64 + 1, LR).unwrap();
    for (name, p) in distinct_params(model) {
        let Some(g) = p.take_grad() else { continue };
        let value = p.value().unwrap();
        let (m, v) = moments.entry(name).or_insert_with(|| (value.zeros_like().unwrap(), value.zeros_like().unwrap()));
        ops::adamw_update(&adamw, &value, &g, m, v).unwrap();
    }
}

/// Every parameter once (a tied weight under its first name).
fn distinct_params<M: module::Module>(model: &M) -> Vec<(String, Param)> {
    module::distinct_params(model).unwrap().into_iter().map(|n| (n.name().to_string(), n.param)).collect()
}

fn check(name: &str, got: &Outcome, want: &Outcome) {
    assert_eq!(got.0.len(), STEPS, "{name}: a loss per step");
    for (step, (g, w)) in got.0.iter().zip(&want.0).enumerate() {
        assert!((g - w).abs() <= 1e-5 * w.abs(), "{name}: step {step} loss {g} vs {w}");
    }
    assert_eq!(got.1.keys().collect::<Vec<_>>(), want.1.keys().collect::<Vec<_>>(), "{name}: the same parameters were trained");
    for (p, w) in &want.1 {
        let g = &got.1[p];
        // Relative error of the whole tensor: ‖got − want‖ / ‖want‖.
        let diff = g.iter().zip(w).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>().sqrt();
        let norm = w.iter().map(|b| (*b as f64).powi(2)).sum::<f64>().sqrt();
        assert!(diff <= 1e-5 * norm, "{name}: {p}: relative error {:.2e}", diff / norm);
    }
}

/// Full and selective recompute under tp2×pp2 (a model declaring selective
/// recompute on its blocks; the override makes it full) against `reference`.
fn check_recompute<M: Staged<In = Replicated, Out = SplitHidden>>(make: impl Make<M>, reference: &Outcome) {
    for (name, r) in [("full recompute tp2 pp2", RecomputeOverride::Full), ("selective recompute tp2 pp2", RecomputeOverride::AsDeclared)] {
        let cfg = Config { recompute: Some(r), ..Config::new("tp2,pp2") };
        check(name, &train(cfg, &make), reference);
    }
    // A recomputed forward must not leave reductions running that nothing takes.
    let cfg = Config { recompute: Some(RecomputeOverride::Full), sequence_parallel: true, tp_overlap: 2, ..Config::new("tp2,pp2") };
    check("full recompute tp2+sp pp2, collectives in 2 pieces", &train(cfg, &make), reference);
    // Offloaded: activations of the recomputed layers and ZeRO-3's state on the host.
    let cfg = Config { recompute: Some(RecomputeOverride::Full), zero: Some(Stage::Three), offload: true, ..Config::new("dp2,tp2,pp2") };
    check("full recompute zero3 dp2 tp2 pp2, offloaded", &train(cfg, &make), reference);
}

#[test]
fn every_configuration_trains_like_one_rank() {
    let gpt = |_: usize, _: usize| Gpt::with_qkv_bias(VOCAB, 8, 2, LAYERS, false);
    let reference = train(Config::new("dp1"), gpt);
    let configs = [
        ("dp2", Config::new("dp2")),
        ("tp2", Config::new("tp2")),
        ("tp2+sp", Config { sequence_parallel: true, ..Config::new("tp2") }),
        ("pp2 gpipe", Config { schedule: ScheduleKind::GPipe, ..Config::new("pp2") }),
        ("pp2 1f1b", Config::new("pp2")),
        ("pp2 interleaved v2", Config { schedule: ScheduleKind::Interleaved { chunks: 2 }, ..Config::new("pp2") }),
        ("pp2 zb-h1", Config { schedule: ScheduleKind::ZeroBubbleH1, ..Config::new("pp2") }),
        ("dp2 tp2+sp pp2 zb-h1", Config { schedule: ScheduleKind::ZeroBubbleH1, sequence_parallel: true, ..Config::new("dp2,tp2,pp2") }),
        ("tp2+sp in 2 pieces", Config { sequence_parallel: true, tp_overlap: 2, ..Config::new("tp2") }),
        (
            "zero3 dp2 tp2+sp pp2 zb-h1 in 2 pieces",
            Config { zero: Some(Stage::Three), schedule: ScheduleKind::ZeroBubbleH1, sequence_parallel: true, tp_overlap: 2, ..Config::new("dp2,tp2,pp2") },
        ),
        ("zero3 dp2 pp2 zb-h1", Config { zero: Some(Stage::Three), schedule: ScheduleKind::ZeroBubbleH1, ..Config::new("dp2,pp2") }),
        ("dp2 tp2 pp2", Config::new("dp2,tp2,pp2")),
        ("zero1 dp2", Config { zero: Some(Stage::One), ..Config::new("dp2") }),
        ("zero2 dp2", Config { zero: Some(Stage::Two), ..Config::new("dp2") }),
        ("zero3 dp2", Config { zero: Some(Stage::Three), ..Config::new("dp2") }),
        ("zero1 dp4", Config { zero: Some(Stage::One), ..Config::new("dp4") }),
        ("zero2 dp4", Config { zero: Some(Stage::Two), ..Config::new("dp4") }),
        ("zero3 dp4", Config { zero: Some(Stage::Three), ..Config::new("dp4") }),
        ("zero1 dp2 tp2 pp2", Config { zero: Some(Stage::One), ..Config::new("dp2,tp2,pp2") }),
        ("zero2 dp2 tp2 pp2", Config { zero: Some(Stage::Two), ..Config::new("dp2,tp2,pp2") }),
        ("zero3 dp2 tp2 pp2", Config { zero: Some(Stage::Three), ..Config::new("dp2,tp2,pp2") }),
        ("zero2 dp2 tp2+sp", Config { zero: Some(Stage::Two), sequence_parallel: true, ..Config::new("dp2,tp2") }),
        ("zero3 dp2 pp2 interleaved v2", Config { zero: Some(Stage::Three), schedule: ScheduleKind::Interleaved { chunks: 2 }, ..Config::new("dp2,pp2") }),
        ("zero1 dp2 offloaded", Config { zero: Some(Stage::One), offload: true, ..Config::new("dp2") }),
        ("zero2 dp2 tp2+sp pp2 offloaded", Config { zero: Some(Stage::Two), sequence_parallel: true, offload: true, ..Config::new("dp2,tp2,pp2") }),
    ];
    for (name, cfg) in configs {
        check(name, &train(cfg, gpt), &reference);
    }
    check_recompute(|_, _| RecomputeGpt::new(VOCAB, 8, 2, LAYERS), &reference);
}

#[test]
fn every_configuration_trains_the_moe_model_like_one_rank() {
    let moe = |e: usize, ep: usize| MoeGpt::new(VOCAB, 8, 2, LAYERS, 4, e, ep);
    let reference = train(Config::new("dp1"), moe);
    let configs = [
        ("pp2 1f1b", Config::new("pp2")),
        ("pp2 gpipe", Config { schedule: ScheduleKind::GPipe, ..Config::new("pp2") }),
        ("pp2 interleaved v2", Config { schedule: ScheduleKind::Interleaved { chunks: 2 }, ..Config::new("pp2") }),
        ("pp2 zb-h1", Config { schedule: ScheduleKind::ZeroBubbleH1, ..Config::new("pp2") }),
        (
            "zero2 ep2 tp2+sp pp2 zb-h1",
            Config { zero: Some(Stage::Two), schedule: ScheduleKind::ZeroBubbleH1, sequence_parallel: true, ..Config::new("ep2,tp2,pp2") },
        ),
        ("dp2 tp2 pp2", Config::new("dp2,tp2,pp2")),
        ("tp2+sp", Config { sequence_parallel: true, ..Config::new("tp2") }),
        (
            "zero2 ep2 tp2+sp pp2 zb-h1 in 2 pieces",
            Config { zero: Some(Stage::Two), schedule: ScheduleKind::ZeroBubbleH1, sequence_parallel: true, tp_overlap: 2, ..Config::new("ep2,tp2,pp2") },
        ),
        ("ep2", Config::new("ep2")),
        ("ep4", Config::new("ep4")),
        ("dp2 ep2", Config::new("dp2,ep2")),
        ("dp2", Config::new("dp2")),
        ("tp2", Config::new("tp2")),
        ("zero1 dp2", Config { zero: Some(Stage::One), ..Config::new("dp2") }),
        ("zero2 dp2", Config { zero: Some(Stage::Two), ..Config::new("dp2") }),
        ("zero3 dp2", Config { zero: Some(Stage::Three), ..Config::new("dp2") }),
        ("zero1 dp4", Config { zero: Some(Stage::One), ..Config::new("dp4") }),
        ("zero2 dp4", Config { zero: Some(Stage::Two), ..Config::new("dp4") }),
        ("zero3 dp4", Config { zero: Some(Stage::Three), ..Config::new("dp4") }),
        ("zero1 dp2 ep2", Config { zero: Some(Stage::One), ..Config::new("dp2,ep2") }),
        ("zero2 dp2 ep2", Config { zero: Some(Stage::Two), ..Config::new("dp2,ep2") }),
        ("zero3 dp2 ep2", Config { zero: Some(Stage::Three), ..Config::new("dp2,ep2") }),
        ("zero2 ep2 tp2 pp2", Config { zero: Some(Stage::Two), ..Config::new("ep2,tp2,pp2") }),
        ("zero3 dp2 ep2 pp2", Config { zero: Some(Stage::Three), ..Config::new("dp2,ep2,pp2") }),
        ("zero3 dp2 ep2 offloaded", Config { zero: Some(Stage::Three), offload: true, ..Config::new("dp2,ep2") }),
    ];
    for (name, cfg) in configs {
        check(name, &train(cfg, moe), &reference);
    }
    check_recompute(|e, ep| RecomputeMoeGpt::new(VOCAB, 8, 2, LAYERS, 4, e, ep), &reference);
}

#[test]
fn global_gradient_norm_clipping_counts_each_parameter_once() {
    let gpt = |_: usize, _: usize| Gpt::with_qkv_bias(VOCAB, 8, 2, LAYERS, false);
    let clip = Some(0.5);
    let reference = train(Config { clip, ..Config::new("dp1") }, gpt);
    let configs = [
        ("dp2", Config { clip, ..Config::new("dp2") }),
        ("tp2", Config { clip, ..Config::new("tp2") }),
        ("tp2+sp", Config { clip, sequence_parallel: true, ..Config::new("tp2") }),
        ("pp2 1f1b", Config { clip, ..Config::new("pp2") }),
        ("pp2 interleaved v2", Config { clip, schedule: ScheduleKind::Interleaved { chunks: 2 }, ..Config::new("pp2") }),
        ("dp2 tp2 pp2", Config { clip, ..Config::new("dp2,tp2,pp2") }),
        ("zero1 dp2", Config { clip, zero: Some(Stage::One), ..Config::new("dp2") }),
        ("zero2 dp2", Config { clip, zero: Some(Stage::Two), ..Config::new("dp2") }),
        ("zero3 dp4", Config { clip, zero: Some(Stage::Three), ..Config::new("dp4") }),
        ("zero1 dp2 tp2 pp2", Config { clip, zero: Some(Stage::One), ..Config::new("dp2,tp2,pp2") }),
        ("zero2 dp2 tp2 pp2", Config { clip, zero: Some(Stage::Two), ..Config::new("dp2,tp2,pp2") }),
        ("zero3 dp2 tp2+sp pp2", Config { clip, zero: Some(Stage::Three), sequence_parallel: true, ..Config::new("dp2,tp2,pp2") }),
    ];
    for (name, cfg) in configs {
        check(&format!("{name} with clipping"), &train(cfg, gpt), &reference);
    }
}
