//! Resharding checkpoints: a small GPT trained at dp2×tp2×pp2 (interleaved,
//! each stage holding only its own parameters), saved, and loaded at tp4
//! and on one rank restores every parameter bit for bit and trains on like
//! the uninterrupted run; so do ZeRO-1 state loaded into plain AdamW and an
//! MoE model saved at ep2 and loaded at ep1. A background save equals a
//! foreground one while training goes on.

mod common;
use common::models::{Gpt, MoeGpt};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tessera::ckpt::{serde_json, Checkpointer, OptimizerState};
use tessera::dist::inproc::{mesh_groups, InProcess};
use tessera::dist::mesh::{Axis, Mesh};
use tessera::module::{self, Cx, Replicated, Shard, SplitHidden, Staged};
use tessera::nn::{vocab_parallel_cross_entropy, vocab_parallel_cross_entropy_backward};
use tessera::ops;
use tessera::optim::{AdamW, AdamWConfig};
use tessera::parallel::pipeline::{run_stage, sync_tied_grads, Schedule, ScheduleKind};
use tessera::parallel::zero::{Stage, Zero, ZeroConfig};
use tessera::prelude::*;
use tessera::testing::Scratch;

const VOCAB: usize = 12;
const SEQS: usize = 4;
const TOKENS: usize = 4;
const LAYERS: usize = 4;
const LR: f64 = 1e-2;

/// Parameter values by name, as bits.
type Bits = BTreeMap<String, Vec<u32>>;
const ADAMW: AdamWConfig = AdamWConfig { beta1: 0.9, beta2: 0.999, eps: 1e-6, weight_decay: 0.01 };

/// A fresh, empty directory for one test.
fn scratch(name: &str) -> Scratch {
    Scratch::new(&format!("reshard-{name}"))
}

/// Four heads, so that tensor parallelism of 4 divides them.
fn gpt(_: usize, _: usize) -> tessera::Result<Gpt> {
    Gpt::with_qkv_bias(VOCAB, 8, 4, LAYERS, false)
}

fn moe(e: usize, ep: usize) -> tessera::Result<MoeGpt> {
    MoeGpt::new(VOCAB, 8, 2, LAYERS, 4, e, ep)
}

/// The sequence `seq` of step `step`: ids and next-token targets.
fn data(step: usize, seq: usize) -> (Vec<u32>, Vec<u32>) {
    let tok = |i: usize| ((step * 13 + seq * 7 + i * 5 + i * i) % VOCAB) as u32;
    ((0..TOKENS).map(tok).collect(), (1..=TOKENS).map(tok).collect())
}

/// How a run trains.
#[derive(Clone, Copy)]
struct Setup {
    mesh: &'static str,
    schedule: ScheduleKind,
    zero: Option<Stage>,
}

impl Setup {
    fn new(mesh: &'static str) -> Self {
        Setup { mesh, schedule: ScheduleKind::OneFOneB, zero: None }
    }
}

enum Opt {
    Adam(AdamW),
    Zero(Arc<Zero>),
}

/// One rank of a run: its model, optimizer and place on the mesh.
struct Rank<M> {
    model: M,
    cx: Cx,
    opt: Opt,
    schedule: Schedule,
    /// This rank's data replica, of how many, and its pipeline stage.
    replica: usize,
    replicas: usize,
    stage: usize,
}

impl<M: Staged<In = Replicated, Out = SplitHidden>> Rank<M> {
    fn state(&self) -> &dyn OptimizerState {
        match &self.opt {
            Opt::Adam(a) => a,
            Opt::Zero(z) => z,
        }
    }

    /// One training step; the mean loss over the whole batch, on every rank.
    fn step(&mut self, step: usize) -> f64 {
        let dev = self.cx.device().clone();
        let g = self.cx.groups().clone();
        let per_replica = SEQS / self.replicas;
        let seqs: Vec<_> = (0..per_replica).map(|i| data(step, self.replica * per_replica + i)).collect();
        let inputs: Vec<Tensor> = seqs.iter().map(|(x, _)| Tensor::from_vec(x.clone(), [1, TOKENS], &dev).unwrap()).collect();
        let targets: Vec<Tensor> = seqs.iter().map(|(_, y)| Tensor::from_vec(y.clone(), [1, TOKENS], &dev).unwrap()).collect();
        let report = run_stage(&self.model, &mut self.cx, &self.schedule, self.stage, &inputs, |mb, out| {
            let (l, saved) = vocab_parallel_cross_entropy(&*g.tp, out, &targets[mb], VOCAB, None)?;
            let dl = vocab_parallel_cross_entropy_backward(out, &targets[mb], VOCAB, None, &saved, 1.0 / per_replica as f64)?;
            Ok((l.to_scalar()?, dl))
        })
        .unwrap();
        sync_tied_grads(&self.model, &self.cx).unwrap();
        match &mut self.opt {
            Opt::Zero(z) => z.step(LR).unwrap(),
            Opt::Adam(opt) => {
                // Average over the replicas; an expert's gradient already holds every replica's tokens.
                for n in module::distinct_params(&self.model).unwrap() {
                    let Some(grad) = n.param.grad() else { continue };
                    let mut sum = g.dp.all_reduce_sum(&grad).unwrap();
                    if !n.name().contains(".experts.") {
                        sum = g.ep.all_reduce_sum(&sum).unwrap();
                    }
                    n.param.set_grad(ops::scale(&sum, 1.0 / self.replicas as f64).unwrap()).unwrap();
                }
                opt.step(LR).unwrap();
                opt.zero_grad();
            }
        }
        let local: f64 = report.losses.iter().map(|(_, l)| l).sum::<f64>() / per_replica as f64;
        let last = g.pp.size() - 1;
        let mean = g.ep.all_reduce_sum(&g.dp.all_reduce_sum(&Tensor::from_vec(vec![local], [1], &dev).unwrap()).unwrap()).unwrap();
        g.pp.broadcast(&mean, last).unwrap().to_scalar().unwrap() / self.replicas as f64
    }

    fn save(&self, root: &Path, step: u64) -> PathBuf {
        Checkpointer::new(root, 2).unwrap().save(step, &self.model, Some(self.state()), &self.cx, serde_json::json!({ "step": step })).unwrap()
    }

    /// Loads the newest checkpoint under `root`; the step it was taken after.
    fn load(&mut self, root: &Path) -> u64 {
        let ckpt = Checkpointer::new(root, 2).unwrap();
        let (model, cx) = (&self.model, &self.cx);
        let opt = match &mut self.opt {
            Opt::Adam(a) => a as &mut dyn OptimizerState,
            Opt::Zero(z) => z,
        };
        let restored = ckpt.load_latest_valid(model, Some(opt), cx).unwrap().expect("a checkpoint");
        assert!(restored.skipped.is_empty(), "{:?}", restored.skipped);
        restored.manifest.extra["step"].as_u64().unwrap()
    }

    /// The whole value (gathered over tensor parallelism and ZeRO) of every
    /// parameter this rank holds, as bits.
    fn params(&self) -> Bits {
        let gathered: BTreeMap<String, Tensor> = match &self.opt {
            Opt::Zero(z) => z.gather_parameters().unwrap().into_iter().collect(),
            Opt::Adam(_) => BTreeMap::new(),
        };
        let tp = &self.cx.groups().tp;
        let mut out = BTreeMap::new();
        for n in module::distinct_params(&self.model).unwrap() {
            if n.param.is_remote() {
                continue;
            }
            let v = gathered.get(n.name()).cloned().unwrap_or_else(|| n.param.value().unwrap());
            let whole = match n.param.shard() {
                Shard::Split { dim, .. } => tp.all_gather(&v, dim).unwrap(),
                Shard::Full => v,
            };
            out.insert(n.name().to_string(), whole.to_vec::<f32>().unwrap().iter().map(|x| x.to_bits()).collect());
        }
        out
    }
}

/// Runs `body` on every rank of a fresh run of `setup`, building the model
/// with `make(ep_rank, ep_degree)`; the results in rank order.
fn run<M, R>(setup: Setup, make: fn(usize, usize) -> tessera::Result<M>, body: impl Fn(&mut Rank<M>) -> R + Sync) -> Vec<R>
where
    M: Staged<In = Replicated, Out = SplitHidden>,
    R: Send,
{
    let world_size: usize = setup.mesh.split(',').map(|a| a.trim_start_matches(char::is_alphabetic).parse::<usize>().unwrap()).product();
    let mesh = Mesh::parse(setup.mesh, world_size, world_size).unwrap();
    let world = InProcess::new(world_size).unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world_size)
            .map(|rank| {
                let (world, mesh, body) = (&world, &mesh, &body);
                s.spawn(move || {
                    let dev = Device::cpu();
                    let c = mesh.coords(rank).unwrap();
                    let (dp, ep, pp) = (mesh.size(Axis::Dp), mesh.size(Axis::Ep), mesh.size(Axis::Pp));
                    let groups = mesh_groups(world, mesh, rank, &dev).unwrap();
                    let chunks = match setup.schedule {
                        ScheduleKind::Interleaved { chunks } => chunks,
                        _ => 1,
                    };
                    let mut cx = Cx::new(dev).with_seed(11).with_groups(groups).with_pipeline_chunks(chunks);
                    let model = module::build(make(c[Axis::Ep], ep).unwrap(), &cx).unwrap();
                    let opt = match setup.zero {
                        Some(stage) => {
                            let config = ZeroConfig::new(stage).with_adamw(ADAMW).with_bucket_bytes(2048);
                            let z = Arc::new(Zero::new(&model, cx.groups().dp.clone(), config).unwrap());
                            cx = cx.with_hooks(z.clone());
                            Opt::Zero(z)
                        }
                        None => Opt::Adam(AdamW::new(&model, ADAMW).unwrap()),
                    };
                    let replicas = dp * ep;
                    let schedule = setup.schedule.build(pp, SEQS / replicas).unwrap();
                    let mut r = Rank { model, cx, opt, schedule, replica: c[Axis::Dp] * ep + c[Axis::Ep], replicas, stage: c[Axis::Pp] };
                    body(&mut r)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Every rank's parameters in one map (the lowest rank's copy of each).
fn merged(per_rank: impl IntoIterator<Item = Bits>) -> Bits {
    let mut out = BTreeMap::new();
    for m in per_rank {
        for (k, v) in m {
            out.entry(k).or_insert(v);
        }
    }
    out
}

/// What a straight run and a restored run are compared on: the parameters
/// right after saving (or loading), then the losses of the next steps and
/// the parameters after them. On one rank, its own parameters; merged, all.
struct Outcome {
    restored: Bits,
    losses: Vec<f64>,
    after: Bits,
}

/// Trains `before` steps under `saved`, saves, trains `after` more; the
/// straight run's outcome.
fn straight<M: Staged<In = Replicated, Out = SplitHidden>>(
    root: &Path,
    saved: Setup,
    make: fn(usize, usize) -> tessera::Result<M>,
    before: usize,
    after: usize,
) -> Outcome {
    let per_rank = run(saved, make, |r| {
        for s in 0..before {
            r.step(s);
        }
        r.save(root, before as u64);
        let restored = r.params();
        let losses: Vec<f64> = (before..before + after).map(|s| r.step(s)).collect();
        Outcome { restored, losses, after: r.params() }
    });
    merge(per_rank)
}

/// Loads the checkpoint under `root` into a fresh run of `setup` and trains `after` steps.
fn resumed<M: Staged<In = Replicated, Out = SplitHidden>>(root: &Path, setup: Setup, make: fn(usize, usize) -> tessera::Result<M>, after: usize) -> Outcome {
    let per_rank = run(setup, make, |r| {
        let from = r.load(root) as usize;
        let restored = r.params();
        let losses: Vec<f64> = (from..from + after).map(|s| r.step(s)).collect();
        Outcome { restored, losses, after: r.params() }
    });
    merge(per_rank)
}

/// Every rank's outcome in one (each rank reports the same losses).
fn merge(per_rank: Vec<Outcome>) -> Outcome {
    let losses = per_rank[0].losses.clone();
    let (restored, after): (Vec<_>, Vec<_>) = per_rank.into_iter().map(|o| (o.restored, o.after)).unzip();
    Outcome { restored: merged(restored), losses, after: merged(after) }
}

/// The restored parameters equal the saved ones bit for bit; the losses and
/// the parameters after training on agree to 1e-5 (relative).
fn check(name: &str, got: &Outcome, want: &Outcome) {
    assert_eq!(got.restored.keys().collect::<Vec<_>>(), want.restored.keys().collect::<Vec<_>>(), "{name}: the same parameters");
    for (k, w) in &want.restored {
        assert!(got.restored[k] == *w, "{name}: `{k}` differs from the saved value");
    }
    assert_eq!(got.losses.len(), want.losses.len());
    for (step, (g, w)) in got.losses.iter().zip(&want.losses).enumerate() {
        assert!((g - w).abs() <= 1e-5 * w.abs(), "{name}: loss {step} after resuming is {g}, the straight run's {w}");
    }
    for (k, w) in &want.after {
        let (g, w): (Vec<f64>, Vec<f64>) = got.after[k].iter().zip(w).map(|(a, b)| (f32::from_bits(*a) as f64, f32::from_bits(*b) as f64)).unzip();
        let diff = g.iter().zip(&w).map(|(a, b)| (a - b).powi(2)).sum::<f64>().sqrt();
        let norm = w.iter().map(|b| b * b).sum::<f64>().sqrt();
        assert!(diff <= 1e-5 * norm, "{name}: `{k}` after training on: relative error {:.2e}", diff / norm);
    }
}

#[test]
fn a_pipelined_tensor_parallel_checkpoint_loads_at_tp4_and_on_one_rank() {
    let root = scratch("dp2tp2pp2");
    let saved = Setup { schedule: ScheduleKind::Interleaved { chunks: 2 }, ..Setup::new("dp2,tp2,pp2") };
    let want = straight(&root, saved, gpt, 2, 2);
    let whole = module::build(gpt(0, 1).unwrap(), &Cx::new(Device::cpu())).unwrap();
    assert_eq!(want.restored.len(), module::distinct_params(&whole).unwrap().len(), "every parameter is held by some stage");

    let dir = Checkpointer::new(&root, 2).unwrap().step_dir(2);
    let manifest = tessera::ckpt::verify(&dir).unwrap();
    assert_eq!((manifest.mesh.pp, manifest.mesh.chunks), (2, 2));
    let files = manifest.files();
    for f in ["pp0-tp0.safetensors", "pp0-tp1.safetensors", "pp1-tp0.safetensors", "pp1-tp1.safetensors"] {
        assert!(files.contains(&f), "{f} in {files:?}");
    }
    // Interleaved over 4 virtual stages: stage 0 runs layers 0 and 2, stage 1 layers 1 and 3.
    for layer in 0..LAYERS {
        let name = format!("blocks.{layer}.up.weight");
        let files: Vec<&str> = manifest.pieces(&name, tessera::ckpt::TensorKind::Param).map(|r| r.file.as_str()).collect();
        assert_eq!(files.len(), 2, "{name}: one slice per tensor-parallel rank");
        assert!(files.iter().all(|f| f.starts_with(&format!("pp{}-", layer % 2))), "{name} is written by the stage that trains it: {files:?}");
    }

    check("tp4", &resumed(&root, Setup::new("tp4"), gpt, 2), &want);
    check("one rank", &resumed(&root, Setup::new("dp1"), gpt, 2), &want);
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn zero1_state_loads_into_plain_adamw() {
    let root = scratch("zero1");
    let saved = Setup { zero: Some(Stage::One), ..Setup::new("dp2") };
    let want = straight(&root, saved, gpt, 2, 2);
    let manifest = tessera::ckpt::verify(&Checkpointer::new(&root, 2).unwrap().step_dir(2)).unwrap();
    assert_eq!(manifest.zero_stage, Some(1));
    assert!(manifest.files().contains(&"pp0-dp1-tp0.safetensors"), "each replica writes its shard: {:?}", manifest.files());
    assert!(manifest.tensors.iter().any(|r| r.region.flat.is_some()), "ZeRO shards are runs of elements");
    check("zero1 dp2 -> adamw dp1", &resumed(&root, Setup::new("dp1"), gpt, 2), &want);
    check("zero1 dp2 -> zero3 dp2", &resumed(&root, Setup { zero: Some(Stage::Three), ..Setup::new("dp2") }, gpt, 2), &want);
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn an_expert_parallel_moe_checkpoint_loads_on_one_rank() {
    let root = scratch("ep2");
    let want = straight(&root, Setup::new("ep2"), moe, 2, 2);
    let manifest = tessera::ckpt::verify(&Checkpointer::new(&root, 2).unwrap().step_dir(2)).unwrap();
    let expert = manifest.tensors.iter().find(|r| r.name == "blocks.0.moe.experts.3.up.weight").unwrap();
    assert_eq!(expert.file, "pp0-ep1-tp0.safetensors", "expert 3 of 4 lives on ep rank 1");
    assert_eq!(manifest.param("blocks.0.moe.experts.3.up.weight").unwrap().expert.map(|e| (e.index, e.count)), Some((3, 4)));
    check("ep2 -> ep1", &resumed(&root, Setup::new("dp1"), moe, 2), &want);
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn a_background_save_equals_a_foreground_one_while_training_goes_on() {
    let (fg, bg) = (scratch("fg"), scratch("bg"));
    let moved = run(Setup::new("tp2,pp2"), gpt, |r| {
        r.step(0);
        r.save(&fg, 1);
        let at_save = r.params();
        // (The checkpointer lives on: dropping its last handle would wait for the write.)
        let ckpt = Checkpointer::new(&bg, 2).unwrap();
        let handle = ckpt.save_in_background(1, &r.model, Some(r.state()), &r.cx, serde_json::json!({ "step": 1 })).unwrap();
        // Training goes on (updating the parameters in place) while the files are written.
        r.step(1);
        let moved = r.params() != at_save;
        let dir = handle.wait().unwrap();
        assert_eq!(dir, bg.join("step-1"));
        moved
    });
    assert!(moved.iter().all(|&m| m), "the step after the save changed the parameters");
    let names = |d: &Path| {
        let mut v: Vec<String> = std::fs::read_dir(d).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        v.sort();
        v
    };
    let (a, b) = (fg.join("step-1"), bg.join("step-1"));
    assert_eq!(names(&a), names(&b));
    for f in names(&a) {
        assert!(std::fs::read(a.join(&f)).unwrap() == std::fs::read(b.join(&f)).unwrap(), "{f} differs between the foreground and the background save");
    }
    assert_eq!(Checkpointer::new(&bg, 2).unwrap().latest().unwrap(), Some(b));
    let _ = (std::fs::remove_dir_all(&fg), std::fs::remove_dir_all(&bg));
}

#[test]
fn a_pipeline_that_does_not_declare_its_layout_is_refused() {
    let root = scratch("nolayout");
    let world = InProcess::new(2).unwrap();
    let mesh = Mesh::parse("pp2", 2, 2).unwrap();
    std::thread::scope(|s| {
        for rank in 0..2 {
            let (world, mesh, root) = (&world, &mesh, &root);
            s.spawn(move || {
                let dev = Device::cpu();
                let cx = Cx::new(dev.clone()).with_groups(mesh_groups(world, mesh, rank, &dev).unwrap());
                let model = module::build(gpt(0, 1).unwrap(), &cx).unwrap();
                let err = Checkpointer::new(root, 1).unwrap().save(1, &model, None, &cx, serde_json::Value::Null).unwrap_err();
                assert!(err.to_string().contains("with_pipeline_chunks"), "{err}");
            });
        }
    });
    assert!(Checkpointer::new(&root, 1).unwrap().steps().unwrap().is_empty());
    let _ = std::fs::remove_dir_all(&root);
}
