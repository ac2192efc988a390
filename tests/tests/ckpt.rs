//! Checkpoints: bit-exact resume, checksums with fallback, atomic writes and
//! pruning, typed errors for a model that does not fit, and a two-rank
//! tensor-parallel save and reload; a manifest of another format is refused.

mod common;
use common::models::Gpt;
use std::path::Path;
use tessera::ckpt::{load_latest_valid, serde_json, Checkpointer};
use tessera::dist::inproc::{mesh_groups, InProcess};
use tessera::dist::mesh::Mesh;
use tessera::module::{self, Cx, Module};
use tessera::optim::{AdamW, AdamWConfig};
use tessera::prelude::*;
use tessera::testing::Scratch;
use tessera::Error;

const VOCAB: usize = 12;
const SEQS: usize = 2;
const TOKENS: usize = 4;
const LR: f64 = 1e-2;
const ADAMW: AdamWConfig = AdamWConfig { beta1: 0.9, beta2: 0.999, eps: 1e-6, weight_decay: 0.01 };

/// A fresh, empty directory for one test.
fn scratch(name: &str) -> Scratch {
    Scratch::new(&format!("ckpt-{name}"))
}

fn gpt() -> Gpt {
    Gpt::with_qkv_bias(VOCAB, 8, 2, 2, false).unwrap()
}

/// The batch of step `step`: ids and next-token targets, `[SEQS, TOKENS]`.
fn batch(step: u64, dev: &Device) -> (Tensor, Tensor) {
    let tok = |s: usize, i: usize| ((step as usize * 13 + s * 7 + i * 5 + i * i) % VOCAB) as u32;
    let ids: Vec<u32> = (0..SEQS).flat_map(|s| (0..TOKENS).map(move |i| tok(s, i))).collect();
    let tgt: Vec<u32> = (0..SEQS).flat_map(|s| (1..=TOKENS).map(move |i| tok(s, i))).collect();
    (Tensor::from_vec(ids, [SEQS, TOKENS], dev).unwrap(), Tensor::from_vec(tgt, [SEQS, TOKENS], dev).unwrap())
}

/// One training step (forward, cross-entropy, backward, AdamW); the loss.
fn train_step(model: &Gpt, opt: &mut AdamW, cx: &mut Cx, step: u64) -> f64 {
    let (ids, targets) = batch(step, cx.device());
    let (logits, saved) = model.forward(cx, Act::new(ids)).unwrap();
    let logits = logits.into_tensor();
    let (loss, ce) = tessera::ops::cross_entropy(&logits, &targets, None).unwrap();
    let dlogits = tessera::ops::cross_entropy_backward(&logits, &targets, None, &ce, 1.0).unwrap();
    model.backward(cx, saved, Act::new(dlogits)).unwrap();
    opt.step(LR).unwrap();
    opt.zero_grad();
    loss.to_scalar().unwrap()
}

/// Every distinct parameter's bits, by name.
fn param_bits<M: Module>(model: &M) -> Vec<(String, Vec<u32>)> {
    let mut out: Vec<(String, Vec<u32>)> = Vec::new();
    let mut seen: Vec<tessera::module::Param> = Vec::new();
    module::visit_params(model, |e| {
        if !seen.iter().any(|p| p.same(e.param)) {
            seen.push(e.param.clone());
            out.push((e.name.to_string(), e.param.value()?.to_vec::<f32>()?.iter().map(|x| x.to_bits()).collect()));
        }
        Ok(())
    })
    .unwrap();
    out
}

/// Every optimizer moment's bits and step count.
fn moment_bits(opt: &AdamW) -> Vec<(String, Vec<u32>, Vec<u32>, u64)> {
    let bits = |t: &Tensor| t.to_vec::<f32>().unwrap().iter().map(|x| x.to_bits()).collect();
    opt.moments().iter().map(|s| (s.name.to_string(), bits(s.m), bits(s.v), s.steps)).collect()
}

/// A freshly built model and optimizer (as a restarted process would have).
fn fresh(cx: &Cx) -> (Gpt, AdamW) {
    let model = module::build(gpt(), cx).unwrap();
    let opt = AdamW::new(&model, ADAMW).unwrap();
    (model, opt)
}

/// Trains `steps` steps from step 0 and saves each step `save_every`; the losses.
fn run(root: &Path, steps: u64, keep: usize) -> (Gpt, AdamW, Vec<f64>) {
    let mut cx = Cx::new(Device::cpu()).with_seed(5);
    let (model, mut opt) = fresh(&cx);
    let ckpt = Checkpointer::new(root, keep).unwrap();
    let mut losses = Vec::new();
    for step in 0..steps {
        losses.push(train_step(&model, &mut opt, &mut cx, step));
        ckpt.save(step + 1, &model, Some(&opt), &cx, serde_json::json!({ "cursor": step + 1 })).unwrap();
    }
    (model, opt, losses)
}

#[test]
fn resume_is_bit_exact() {
    let root = scratch("resume");
    // Six steps straight.
    let mut cx = Cx::new(Device::cpu()).with_seed(5);
    let (straight, mut straight_opt) = fresh(&cx);
    let straight_losses: Vec<f64> = (0..6).map(|s| train_step(&straight, &mut straight_opt, &mut cx, s)).collect();

    // Three steps, a checkpoint, then a restart: a new model and optimizer, loaded.
    let (_, _, first) = run(&root, 3, 2);
    let mut cx = Cx::new(Device::cpu()).with_seed(5);
    let (model, mut opt) = fresh(&cx);
    let restored = load_latest_valid(&root, &model, Some(&mut opt), &cx).unwrap().expect("a checkpoint");
    assert!(restored.skipped.is_empty(), "{:?}", restored.skipped);
    assert_eq!(restored.manifest.step, 3);
    let cursor = restored.manifest.extra["cursor"].as_u64().unwrap();
    assert_eq!(cursor, 3, "the trainer's own state comes back");
    let rest: Vec<f64> = (cursor..6).map(|s| train_step(&model, &mut opt, &mut cx, s)).collect();

    let resumed: Vec<u64> = first.iter().chain(&rest).map(|l| l.to_bits()).collect();
    let want: Vec<u64> = straight_losses.iter().map(|l| l.to_bits()).collect();
    assert_eq!(resumed, want, "losses after resuming differ from the uninterrupted run");
    assert_eq!(param_bits(&model), param_bits(&straight), "parameters after resuming differ");
    assert_eq!(moment_bits(&opt), moment_bits(&straight_opt), "optimizer state after resuming differs");

    // The tied embedding / output weight is stored once, with its second name recorded.
    let manifest = Checkpointer::new(&root, 2).unwrap().manifest(&restored.dir).unwrap();
    let tied: Vec<_> = manifest.params.iter().filter(|r| r.name == "tok.weight").collect();
    assert_eq!(tied.len(), 1);
    assert_eq!(tied[0].aliases, ["head.weight"]);
    assert!(manifest.tensors.iter().all(|r| r.param != "head.weight"));
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn a_corrupt_file_is_named_and_skipped() {
    let root = scratch("corrupt");
    let (model, _, _) = run(&root, 2, 3);
    let ckpt = Checkpointer::new(&root, 3).unwrap();
    let newest = ckpt.step_dir(2);
    let file = newest.join("pp0-tp0.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&file, bytes).unwrap();

    let cx = Cx::new(Device::cpu()).with_seed(5);
    let (fresh_model, mut opt) = fresh(&cx);
    let before = param_bits(&fresh_model);
    let err = ckpt.load(&newest, &fresh_model, Some(&mut opt), &cx).unwrap_err();
    let names: Vec<String> = ckpt.manifest(&newest).unwrap().tensors.iter().map(|r| r.name.clone()).collect();
    match &err {
        Error::CheckpointCorrupt { file, tensor, .. } => {
            assert!(file.ends_with("pp0-tp0.safetensors"), "{err}");
            assert!(names.contains(tensor), "{err}");
        }
        other => panic!("expected a corrupt-tensor error, got {other}"),
    }
    assert_eq!(param_bits(&fresh_model), before, "a failed load changes nothing");

    // Falling back: step 1 is intact, and step 2 is reported with the reason.
    let scan = ckpt.scan().unwrap();
    assert_eq!(scan.valid.as_deref(), Some(ckpt.step_dir(1).as_path()));
    assert_eq!(scan.skipped.len(), 1);
    assert_eq!(scan.skipped[0].dir, newest);
    assert!(matches!(scan.skipped[0].reason, Error::CheckpointCorrupt { .. }));
    let restored = ckpt.load_latest_valid(&fresh_model, Some(&mut opt), &cx).unwrap().unwrap();
    assert_eq!(restored.manifest.step, 1);
    assert_eq!(restored.skipped.len(), 1);
    drop(model);

    // A missing rank file is named too.
    std::fs::remove_file(ckpt.step_dir(1).join("pp0-tp0.safetensors")).unwrap();
    let err = ckpt.load(&ckpt.step_dir(1), &fresh_model, None, &cx).unwrap_err();
    assert!(
        matches!(&err, Error::CheckpointIo { path, source, .. } if path.ends_with("pp0-tp0.safetensors") && source.kind() == std::io::ErrorKind::NotFound),
        "{err}"
    );
    assert_eq!(ckpt.latest_valid().unwrap(), None);
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn writes_are_atomic_and_old_checkpoints_are_pruned() {
    let root = scratch("atomic");
    // A crashed writer's leftover directory, newer than anything complete.
    let stale = root.join("step-99.tmp-12345");
    std::fs::create_dir_all(&stale).unwrap();
    std::fs::write(stale.join("pp0-tp0.safetensors"), b"half written").unwrap();

    run(&root, 4, 2);
    let ckpt = Checkpointer::new(&root, 2).unwrap();
    let steps: Vec<u64> = ckpt.steps().unwrap().into_iter().map(|(s, _)| s).collect();
    assert_eq!(steps, [3, 4], "only the newest two are kept");
    assert_eq!(ckpt.latest().unwrap(), Some(ckpt.step_dir(4)));
    assert_eq!(ckpt.latest_valid().unwrap(), Some(ckpt.step_dir(4)), "the leftover temporary directory is ignored");
    assert!(!root.join("step-4").join("part-pp0-dp0-ep0-tp0.json").exists(), "no writer's scratch files remain");
    let leftovers: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.contains(".tmp-") && n != "step-99.tmp-12345")
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");

    // A pointer to a checkpoint that vanished falls back to the newest one present.
    std::fs::remove_dir_all(ckpt.step_dir(4)).unwrap();
    let scan = ckpt.scan().unwrap();
    assert_eq!(scan.valid, Some(ckpt.step_dir(3)));
    assert_eq!(scan.skipped.len(), 1);
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn a_different_model_is_refused_by_name_and_shapes() {
    let root = scratch("mismatch");
    run(&root, 1, 1);
    let ckpt = Checkpointer::new(&root, 1).unwrap();
    let cx = Cx::new(Device::cpu());
    let wider = module::build(Gpt::with_qkv_bias(VOCAB, 16, 2, 2, false).unwrap(), &cx).unwrap();
    let err = ckpt.load(&ckpt.step_dir(1), &wider, None, &cx).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::CheckpointMismatch { .. }), "{msg}");
    assert!(msg.contains("`tok.weight`") && msg.contains("[12, 8]") && msg.contains("[12, 16]"), "{msg}");

    let deeper = module::build(Gpt::with_qkv_bias(VOCAB, 8, 2, 3, false).unwrap(), &cx).unwrap();
    let err = ckpt.load(&ckpt.step_dir(1), &deeper, None, &cx).unwrap_err();
    assert!(matches!(err, Error::CheckpointMismatch { .. }) && err.to_string().contains("blocks.2."), "{err}");

    // A checkpoint saved without an optimizer cannot restore one.
    let plain = module::build(gpt(), &cx).unwrap();
    ckpt.save(7, &plain, None, &cx, serde_json::Value::Null).unwrap();
    let mut opt = AdamW::new(&plain, ADAMW).unwrap();
    let err = ckpt.load(&ckpt.step_dir(7), &plain, Some(&mut opt), &cx).unwrap_err();
    assert!(err.to_string().contains("no optimizer state"), "{err}");
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn two_tensor_parallel_ranks_save_and_reload_bit_exact() {
    let root = scratch("tp2");
    let mesh = Mesh::parse("tp2", 2, 2).unwrap();
    let world = InProcess::new(2).unwrap();
    std::thread::scope(|s| {
        for rank in 0..2 {
            let (world, mesh, root) = (&world, &mesh, &root);
            s.spawn(move || {
                let dev = Device::cpu();
                let groups = mesh_groups(world, mesh, rank, &dev).unwrap();
                let cx = Cx::new(dev).with_seed(5).with_groups(groups);
                let model = module::build(gpt(), &cx).unwrap();
                let ckpt = Checkpointer::new(root, 2).unwrap();
                let dir = ckpt.save(1, &model, None, &cx, serde_json::Value::Null).unwrap();
                // A model drawn from another seed, then loaded: the saved bits come back.
                let other = module::build(gpt(), &Cx::new(cx.device().clone()).with_seed(6).with_groups(cx.groups().clone())).unwrap();
                assert_ne!(param_bits(&other), param_bits(&model));
                let manifest = ckpt.load(&dir, &other, None, &cx).unwrap();
                assert_eq!(param_bits(&other), param_bits(&model), "rank {rank}");
                assert_eq!(manifest.mesh.tp, 2);
                assert!(manifest.tensors.iter().any(|r| r.file == "pp0-tp1.safetensors"), "each rank writes its own shards");
            });
        }
    });
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn another_format_version_is_refused_by_name() {
    let root = scratch("format");
    run(&root, 2, 2);
    let ckpt = Checkpointer::new(&root, 2).unwrap();
    let manifest = ckpt.step_dir(2).join(tessera::ckpt::MANIFEST);
    let mut json: serde_json::Value = serde_json::from_slice(&std::fs::read(&manifest).unwrap()).unwrap();
    json["format"] = 1.into();
    std::fs::write(&manifest, serde_json::to_vec(&json).unwrap()).unwrap();

    let cx = Cx::new(Device::cpu()).with_seed(5);
    let (model, mut opt) = fresh(&cx);
    let err = ckpt.load(&ckpt.step_dir(2), &model, Some(&mut opt), &cx).unwrap_err();
    assert!(matches!(err, Error::CheckpointFormat { found: Some(1), supported: tessera::ckpt::FORMAT_VERSION, .. }), "{err}");
    assert!(err.to_string().contains("older Tessera"), "{err}");
    // Falling back passes it over for the intact step 1, saying why.
    let restored = ckpt.load_latest_valid(&model, Some(&mut opt), &cx).unwrap().unwrap();
    assert_eq!(restored.manifest.step, 1);
    assert!(matches!(restored.skipped[0].reason, Error::CheckpointFormat { .. }));
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn pruning_sets_a_broken_checkpoint_aside_instead_of_deleting_it() {
    let root = scratch("prune-broken");
    run(&root, 2, 2);
    // Step 1 loses a rank file: pruning it would destroy the only evidence.
    std::fs::remove_file(root.join("step-1").join("pp0-tp0.safetensors")).unwrap();
    let cx = Cx::new(Device::cpu());
    let (model, opt) = fresh(&cx);
    let ckpt = Checkpointer::new(&root, 2).unwrap();
    ckpt.save(3, &model, Some(&opt), &cx, serde_json::json!(null)).unwrap();
    let steps: Vec<u64> = ckpt.steps().unwrap().into_iter().map(|(s, _)| s).collect();
    assert_eq!(steps, [2, 3]);
    let aside = ckpt.set_aside_dirs().unwrap();
    assert_eq!(aside.len(), 1, "step 1 is kept aside");
    assert!(aside[0].file_name().unwrap().to_string_lossy().starts_with("damaged-step-1-"));
    let reason = std::fs::read_to_string(aside[0].join(tessera::ckpt::REASON_FILE)).unwrap();
    assert!(reason.contains("pp0-tp0.safetensors") && reason.contains("missing"), "{reason}");
    let _ = std::fs::remove_dir_all(&root);
}

/// Local SGD's outer momentum goes into a checkpoint taken at a meeting
/// (one copy, sharded as the parameters are; here dp2 × tp2): loaded into
/// a fresh engine it comes back bit for bit, and the next meeting gives the
/// parameters the engine that kept running gives. Loaded without it, the
/// momentum starts over and that meeting differs (what a lost momentum
/// would look like); a checkpoint from before the first meeting holds none.
#[test]
fn local_sgd_outer_momentum_survives_a_checkpoint() {
    use tessera::ckpt::TensorKind;
    use tessera::parallel::local_sgd::{LocalSgd, OuterConfig, WithOuterMomentum};
    let root = scratch("outer-momentum");
    let mesh = Mesh::parse("dp2,tp2", 4, 4).unwrap();
    let world = InProcess::new(4).unwrap();
    let bits = |ts: &[Option<Tensor>]| -> Vec<Option<Vec<u32>>> {
        ts.iter().map(|t| t.as_ref().map(|t| t.to_vec::<f32>().unwrap().iter().map(|x| x.to_bits()).collect())).collect()
    };
    // Replica 0's tensor-parallel ranks' momentum: each parameter's shard and bits.
    let held: Vec<Vec<(tessera::module::Shard, Option<Vec<u32>>)>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|rank| {
                let (world, mesh, root) = (&world, &mesh, &root);
                s.spawn(move || {
                    let dev = Device::cpu();
                    let groups = mesh_groups(world, mesh, rank, &dev).unwrap();
                    let cx = Cx::new(dev.clone()).with_seed(5).with_groups(groups);
                    let replica = cx.groups().dp.rank();
                    let model = module::build(gpt(), &cx).unwrap();
                    let engine = || LocalSgd::new(&model, cx.groups().dp.clone(), None, OuterConfig::diloco(1)).unwrap();
                    let values = |e: &LocalSgd| e.params().iter().map(|p| p.value().unwrap()).collect::<Vec<_>>();
                    // Each replica's inner steps: its own move of every parameter.
                    let moved = |e: &LocalSgd, round: u64| -> Vec<Tensor> {
                        e.params()
                            .iter()
                            .enumerate()
                            .map(|(i, p)| {
                                let v = p.value().unwrap();
                                let step = Tensor::rand(
                                    Init::Normal { mean: 0.0, std: 0.01 },
                                    RngKey::new(round * 100 + i as u64, replica as u64),
                                    v.shape().clone(),
                                    v.dtype(),
                                    &dev,
                                )
                                .unwrap();
                                tessera::ops::add(&v, &step).unwrap()
                            })
                            .collect()
                    };
                    let (mut opt, mut local) = (AdamW::new(&model, ADAMW).unwrap(), engine());
                    local.start(values(&local)).unwrap();
                    let ckpt = Checkpointer::new(root, 3).unwrap();
                    let outer_pieces = |dir: &Path| ckpt.manifest(dir).unwrap().tensors.iter().filter(|r| r.kind == TensorKind::OuterMomentum).count();
                    let before = ckpt.save(1, &model, Some(&WithOuterMomentum::new(&mut opt, Some(&mut local))), &cx, serde_json::Value::Null).unwrap();
                    assert_eq!(outer_pieces(&before), 0, "no meeting yet, no momentum");
                    for round in 0..2 {
                        let (global, _) = local.meet(&moved(&local, round)).unwrap();
                        for (p, v) in local.params().to_vec().iter().zip(global) {
                            p.set_value(v).unwrap();
                        }
                    }
                    let dir = ckpt.save(2, &model, Some(&WithOuterMomentum::new(&mut opt, Some(&mut local))), &cx, serde_json::Value::Null).unwrap();
                    let manifest = ckpt.verify(&dir).unwrap();
                    // Placed as the values are (`verify` holds each kind to cover every parameter once).
                    let values_pieces = manifest.tensors.iter().filter(|r| r.kind == TensorKind::Param).count();
                    assert_eq!(outer_pieces(&dir), values_pieces, "every parameter's momentum, where its values are");
                    // A fresh engine and optimizer, loaded with the momentum and without it.
                    let (mut opt2, mut restored) = (AdamW::new(&model, ADAMW).unwrap(), engine());
                    ckpt.load(&dir, &model, Some(&mut WithOuterMomentum::new(&mut opt2, Some(&mut restored))), &cx).unwrap();
                    restored.start(values(&restored)).unwrap();
                    assert!(local.momentum().iter().all(Option::is_some));
                    assert_eq!(bits(restored.momentum()), bits(local.momentum()), "rank {rank}: the momentum comes back");
                    assert_eq!(restored.meetings(), 2);
                    let (mut opt3, mut forgot) = (AdamW::new(&model, ADAMW).unwrap(), engine());
                    ckpt.load(&dir, &model, Some(&mut opt3), &cx).unwrap();
                    forgot.start(values(&forgot)).unwrap();
                    assert!(forgot.momentum().iter().all(Option::is_none));
                    // The next meeting, from the same local values.
                    let next = moved(&local, 2);
                    let result = |e: &mut LocalSgd| e.meet(&next).unwrap().0.iter().map(|t| Some(t.clone())).collect::<Vec<_>>();
                    let (kept, back, lost) = (result(&mut local), result(&mut restored), result(&mut forgot));
                    assert_eq!(bits(&back), bits(&kept), "rank {rank}: the meeting after the load");
                    assert_ne!(bits(&lost), bits(&kept), "rank {rank}: without the momentum the meeting differs");
                    // A checkpoint without momentum restores none into an engine that had some.
                    let shards: Vec<_> = local.params().iter().map(|p| p.shard()).collect();
                    let held = shards.into_iter().zip(bits(loaded_engine(&dir, &ckpt, &model, &cx, engine()).momentum())).collect();
                    ckpt.load(&before, &model, Some(&mut WithOuterMomentum::new(&mut opt2, Some(&mut restored))), &cx).unwrap();
                    assert!(restored.momentum().iter().all(Option::is_none));
                    (replica == 0).then_some(held)
                })
            })
            .collect();
        handles.into_iter().filter_map(|h| h.join().unwrap()).collect()
    });
    // Loaded on one rank (another layout), each parameter's momentum is whole
    // and holds every shard the tensor-parallel ranks held.
    let dev = Device::cpu();
    let cx = Cx::new(dev.clone()).with_seed(9);
    let model = module::build(gpt(), &cx).unwrap();
    let ckpt = Checkpointer::new(&root, 3).unwrap();
    let one = loaded_engine(
        &ckpt.step_dir(2),
        &ckpt,
        &model,
        &cx,
        LocalSgd::new(&model, std::sync::Arc::new(tessera::dist::SingleRank), None, OuterConfig::diloco(1)).unwrap(),
    );
    for (tp_rank, held) in held.iter().enumerate() {
        for ((shard, want), whole) in held.iter().zip(one.momentum()) {
            let whole = whole.as_ref().expect("the momentum loads whole");
            let part = match *shard {
                tessera::module::Shard::Full => whole.clone(),
                tessera::module::Shard::Split { dim, degree, .. } => {
                    whole.narrow(dim, tp_rank * whole.dims()[dim] / degree, whole.dims()[dim] / degree).unwrap()
                }
            };
            assert_eq!(Some(part.to_vec::<f32>().unwrap().iter().map(|x| x.to_bits()).collect::<Vec<_>>()), *want, "tensor-parallel rank {tp_rank}");
        }
    }
    let _ = std::fs::remove_dir_all(&root);
}

/// A fresh engine for `model` loaded from `dir` with its outer momentum,
/// started from the loaded parameters.
fn loaded_engine<M: Module>(
    dir: &Path,
    ckpt: &Checkpointer,
    model: &M,
    cx: &Cx,
    mut engine: tessera::parallel::local_sgd::LocalSgd,
) -> tessera::parallel::local_sgd::LocalSgd {
    let mut opt = AdamW::new(model, ADAMW).unwrap();
    ckpt.load(dir, model, Some(&mut tessera::parallel::local_sgd::WithOuterMomentum::new(&mut opt, Some(&mut engine))), cx).unwrap();
    let values = engine.params().iter().map(|p| p.value().unwrap()).collect();
    engine.start(values).unwrap();
    engine
}
