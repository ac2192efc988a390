//! The configured training loop: run directory contents, bit-exact resume,
//! gradient accumulation, rollback on a loss spike with the offending data
//! skipped, and fp16 loss scaling. (The setup is in `common/training.rs`.)

mod common;
use common::models::{Gpt, MoeGpt};
use common::training::*;
use std::path::{Path, PathBuf};
use tessera::ckpt::serde_json;
use tessera::module::Cx;
use tessera::observe::{read_metrics, Event};
use tessera::prelude::*;
use tessera::train::{Batches, ModelFacts, Replica, RunSummary, TrainConfig, Trainer};
use tessera::Error;

#[test]
fn a_run_writes_metrics_trace_plot_and_checkpoint_and_learns() {
    let out = scratch("run");
    let summary = train(
        config(&out, "[mesh]\ndp = 2\ntp = 2\npp = 2\n[batch]\nmicro_batch = 4\ngrad_accum = 2\n", &["run.steps=30", "run.trace_steps=2", "optim.lr=1e-2"]),
        0..0,
    );
    let metrics = read_metrics(out.join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.len(), 30);
    assert_eq!(metrics.iter().map(|m| m.step).collect::<Vec<_>>(), (1..=30).collect::<Vec<_>>());
    let (first, last) = (metrics[0].loss, metrics[29].loss);
    assert!(last < 0.8 * first, "loss {first} -> {last}");
    for m in &metrics {
        assert_eq!(m.peak_memory.len(), 8, "one peak per rank");
        assert!(m.peak_memory.iter().all(|&b| b > 0));
        assert!(m.tokens_per_s > 0.0 && m.mfu > 0.0 && m.step_time_s >= m.compute_s.max(m.bubble_s));
        assert!(m.grad_norm.is_some_and(f64::is_finite));
    }
    let trace: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("trace.json")).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    for rank in 0..8 {
        assert!(events.iter().any(|e| e["ph"] == "X" && e["tid"] == rank && e["cat"] == "compute"), "rank {rank} has a track with compute");
    }
    let png = std::fs::read(out.join("loss.png")).unwrap();
    assert_eq!(&png[1..4], b"PNG");
    assert!(out.join("config.toml").exists());
    assert!(summary.checkpoint.join("manifest.json").exists());
    // The dp2 × tp2 × pp2 checkpoint loads on one rank.
    assert!(final_params(&summary).iter().all(|(_, v)| v.iter().all(|x| x.is_finite())));
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn a_resumed_run_continues_bit_for_bit() {
    let (a, b) = (scratch("straight"), scratch("resumed"));
    let text = "[mesh]\ndp = 2\n[batch]\nmicro_batch = 2\n[checkpoint]\nevery = 5\n";
    let straight = train(config(&a, text, &["run.steps=20"]), 0..0);
    let first = train(config(&b, text, &["run.steps=20", "run.stop_after=10", "checkpoint.every=10"]), 0..0);
    assert_eq!(first.losses.len(), 10);
    let resumed = train(config(&b, text, &["run.steps=20"]), 0..0);
    assert_eq!(resumed.resumed_from, 10);
    let losses: Vec<f64> = first.losses.iter().chain(&resumed.losses).map(|l| l.1).collect();
    assert_eq!(losses, straight.losses.iter().map(|l| l.1).collect::<Vec<_>>(), "losses of 10 + resume + 10 steps");
    assert_eq!(final_params(&resumed), final_params(&straight), "final parameters");
    let _ = (std::fs::remove_dir_all(&a), std::fs::remove_dir_all(&b));
}

/// A ZeRO run stopped and resumed equals the uninterrupted run, under data
/// parallelism alone and with tensor and pipeline parallelism (the shards
/// of tensor-parallel pieces on each stage saved and restored), and with
/// half-precision parameters (with and without ZeRO).
#[test]
fn zero_training_resumes_bit_for_bit() {
    // Half precision too: the f32 master copies (in AdamW, or sharded by
    // ZeRO) are what the checkpoint holds and what the resumed run updates.
    let bf16 = "[precision]\ncompute = \"bf16\"\n";
    let cases = [
        ("dp2", "dp = 2", 2, ""),
        ("dp2-tp2-pp2", "dp = 2\ntp = 2\npp = 2", 2, ""),
        ("dp2-tp2-pp2", "dp = 2\ntp = 2\npp = 2", 3, ""),
        ("dp2-bf16", "dp = 2", 0, bf16),
        ("dp2-bf16", "dp = 2", 2, bf16),
        ("dp2-pp2-bf16", "dp = 2\npp = 2", 3, bf16),
    ];
    for (tag, mesh, stage, extra) in cases {
        let (a, b) = (scratch(&format!("zero{stage}-{tag}-straight")), scratch(&format!("zero{stage}-{tag}-resumed")));
        let text = format!("[mesh]\n{mesh}\n[zero]\nstage = {stage}\n[optim]\nclip = 0.0\n[batch]\nmicro_batch = 2\n{extra}");
        let straight = train(config(&a, &text, &["run.steps=8"]), 0..0);
        let first = train(config(&b, &text, &["run.steps=8", "run.stop_after=4"]), 0..0);
        let resumed = train(config(&b, &text, &["run.steps=8"]), 0..0);
        assert_eq!(resumed.resumed_from, 4);
        let losses: Vec<f64> = first.losses.iter().chain(&resumed.losses).map(|l| l.1).collect();
        assert_eq!(losses, straight.losses.iter().map(|l| l.1).collect::<Vec<_>>(), "ZeRO-{stage} on {tag}");
        assert_eq!(final_params(&resumed), final_params(&straight), "ZeRO-{stage} on {tag}");
        let _ = (std::fs::remove_dir_all(&a), std::fs::remove_dir_all(&b));
    }
}

/// The losses and gradient norms of an 8-step run on `mesh` (the lines of
/// a `[mesh]` table) under `extra` settings.
fn losses_and_norms(name: &str, mesh: &str, extra: &str) -> Vec<(f64, Option<f64>, bool)> {
    let out = scratch(name);
    let text = format!("[mesh]\n{mesh}\n[batch]\nmicro_batch = 2\n{extra}");
    train(config(&out, &text, &["run.steps=8"]), 0..0);
    read_metrics(out.join("metrics.jsonl")).unwrap().iter().map(|m| (m.loss, m.grad_norm, m.skipped)).collect()
}

/// metrics.jsonl logs the gradient communication in all and the part the
/// backward did not hide: both zero on one replica, and with replicas a
/// positive total that covers the exposed part, with and without ZeRO.
#[test]
fn metrics_log_total_and_exposed_communication() {
    for (what, text) in [("dp1", "[mesh]\ndp = 1\n"), ("dp2", "[mesh]\ndp = 2\n"), ("zero2", "[mesh]\ndp = 2\n[zero]\nstage = 2\n")] {
        let out = scratch(&format!("comm-{what}"));
        train(config(&out, &format!("{text}[batch]\nmicro_batch = 2\n"), &["run.steps=4"]), 0..0);
        for m in read_metrics(out.join("metrics.jsonl")).unwrap() {
            if what == "dp1" {
                assert_eq!((m.comm_s, m.exposed_comm_s), (0.0, 0.0), "{what}, step {}", m.step);
            } else {
                assert!(m.comm_s > 0.0 && m.comm_s >= m.exposed_comm_s && m.comm_s <= m.step_time_s, "{what}, step {}: {m:?}", m.step);
            }
        }
        let _ = std::fs::remove_dir_all(&out);
    }
}

/// PowerSGD (rank 2, with error feedback) on dp2, and on dp2 × tp2 × pp2:
/// the loss falls as it does with gradients sent whole (the mean of the
/// last 5 of 40 steps within 10 % of it) for a fraction of the gradient
/// bytes, which metrics.jsonl logs.
#[test]
fn powersgd_trains_like_uncompressed_gradients_for_fewer_bytes() {
    for (what, mesh) in [("dp2", "dp = 2"), ("dp2-tp2-pp2", "dp = 2\ntp = 2\npp = 2")] {
        let run = |compression: &str| {
            let out = scratch(&format!("powersgd-{what}-{compression}"));
            let text = format!("[mesh]\n{mesh}\ngrad_compression = \"{compression}\"\npowersgd_rank = 2\n[batch]\nmicro_batch = 4\ngrad_accum = 2\n");
            train(config(&out, &text, &["run.steps=40", "optim.lr=1e-2"]), 0..0);
            let m = read_metrics(out.join("metrics.jsonl")).unwrap();
            let _ = std::fs::remove_dir_all(&out);
            m
        };
        let (whole, factored) = (run("none"), run("powersgd"));
        let tail = |m: &[tessera::observe::StepMetrics]| m[m.len() - 5..].iter().map(|m| m.loss).sum::<f64>() / 5.0;
        let (a, b) = (tail(&whole), tail(&factored));
        assert!(b < 0.8 * factored[0].loss, "{what}: PowerSGD learns: {} -> {b}", factored[0].loss);
        assert!((b - a).abs() <= 0.1 * a, "{what}: last losses {b} with PowerSGD, {a} without");
        let (bw, bf) = (whole[0].grad_bytes, factored[0].grad_bytes);
        assert!(bf > 0 && bf * 2 < bw, "{what}: {bf} gradient bytes with PowerSGD, {bw} without");
    }
}

/// Local SGD / DiLoCo (`[local_sgd]`, every 4 steps) on dp2, on
/// dp2 × tp2 × pp2 and on dp2 × ep2 with experts: the replicas exchange
/// nothing for three steps in four, and at each meeting send every
/// parameter once, the bytes synchronous training sends every step; the
/// loss falls as far as it does with gradients all-reduced every step (the
/// mean of the last 5 of 40 steps at most 15 % above).
#[test]
fn local_sgd_meets_every_h_steps_and_trains_like_synchronous_training() {
    let gpt = |text: &str, out: &Path| train(config(out, text, &["run.steps=40", "optim.lr=1e-2", "checkpoint.every=8"]), 0..0);
    let moe_run = |text: &str, out: &Path| train_moe(config(out, text, &["run.steps=40", "optim.lr=1e-2", "checkpoint.every=8"]));
    type Run<'a> = &'a dyn Fn(&str, &Path) -> RunSummary;
    let cases: [(&str, &str, Run); 3] = [("dp2", "dp = 2", &gpt), ("dp2-tp2-pp2", "dp = 2\ntp = 2\npp = 2", &gpt), ("dp2-ep2", "dp = 2\nep = 2", &moe_run)];
    for (what, mesh, run) in cases {
        let metrics = |local: &str| {
            let out = scratch(&format!("local-sgd-{what}-{}", local.len()));
            run(&format!("[mesh]\n{mesh}\n[batch]\nmicro_batch = 4\ngrad_accum = 2\n{local}"), &out);
            let m = read_metrics(out.join("metrics.jsonl")).unwrap();
            let _ = std::fs::remove_dir_all(&out);
            m
        };
        let (sync, local) = (metrics(""), metrics("[local_sgd]\nevery = 4\n"));
        let every_step = sync[0].grad_bytes;
        assert!(every_step > 0 && sync.iter().all(|m| m.grad_bytes == every_step), "{what}: synchronous training sends the same bytes every step");
        for m in &local {
            let want = if m.step % 4 == 0 { every_step } else { 0 };
            assert_eq!(m.grad_bytes, want, "{what}, step {}: the replicas meet on every fourth step only", m.step);
        }
        let tail = |m: &[tessera::observe::StepMetrics]| m[m.len() - 5..].iter().map(|m| m.loss).sum::<f64>() / 5.0;
        let (a, b) = (tail(&sync), tail(&local));
        assert!(b < 0.8 * local[0].loss, "{what}: Local SGD learns: {} -> {b}", local[0].loss);
        assert!(b <= 1.15 * a, "{what}: last losses {b} with Local SGD, {a} synchronous");
        eprintln!("{what}: last losses {b:.4} with Local SGD, {a:.4} synchronous");
    }
}

/// The trainer's wiring of Local SGD, against runs of one rank: replica
/// `r` of a dp2 run trains apart on its own data, as a one-rank run fed
/// replica `r`'s batches does; at the meeting (averaging: `η = 1, μ = 0`)
/// every replica takes the mean of the two, which the final checkpoint
/// (replica 0's) must hold.
#[test]
fn local_sgd_averaging_leaves_the_mean_of_replicas_trained_apart() {
    let run = |name: &str, text: &str, feed: Option<usize>| {
        let out = scratch(name);
        let cfg = config(&out, text, &["run.steps=3", "batch.micro_batch=4"]);
        let micro_batch = cfg.batch.micro_batch;
        let trainer = Trainer::new(
            cfg,
            ModelFacts { vocab: VOCAB, flops_per_token: 1e5 },
            |_cx: &Cx, _, _| Gpt::with_qkv_bias(VOCAB, 16, 2, 2, false),
            move |replica| {
                // A one-rank run fed replica `r` of two's batches.
                let replica = feed.map_or(replica, |index| Replica { index, count: 2 });
                Ok(Box::new(Counting { replica, micro_batch, drawn: 0, poisoned: 0..0 }) as Box<dyn Batches>)
            },
        )
        .unwrap();
        let params = final_params(&trainer.run().unwrap());
        let _ = std::fs::remove_dir_all(&out);
        params
    };
    let apart: Vec<_> = (0..2).map(|r| run(&format!("local-sgd-apart-{r}"), "", Some(r))).collect();
    let met = run("local-sgd-met", "[mesh]\ndp = 2\n[local_sgd]\nevery = 3\nouter_lr = 1.0\nouter_momentum = 0.0\n[checkpoint]\nevery = 3\n", None);
    let mut moved = 0.0f32;
    for (((name, got), (_, a)), (_, b)) in met.iter().zip(&apart[0]).zip(&apart[1]) {
        for ((g, x), y) in got.iter().zip(a).zip(b) {
            let mean = (x + y) / 2.0;
            assert!((g - mean).abs() <= 1e-6 * (1.0 + mean.abs()), "{name}: {g} where the mean of the replicas is {mean} ({x}, {y})");
            moved = moved.max((x - y).abs());
        }
    }
    assert!(moved > 1e-3, "the replicas' data differ, and so do their parameters before the meeting ({moved})");
}

/// A loss spike between meetings rolls every replica back together to the
/// checkpoint of the last meeting, whose parameters they all restart from.
#[test]
fn a_loss_spike_under_local_sgd_rolls_every_replica_back_to_the_last_meeting() {
    let out = scratch("local-sgd-spike");
    // Draws 58 and 59 of every replica (step 30) are scrambled.
    let text =
        "[mesh]\ndp = 2\n[local_sgd]\nevery = 4\n[batch]\nmicro_batch = 8\n[checkpoint]\nevery = 4\n[stability]\nspike_factor = 1.8\nwindow = 10\nwarmup = 5\n";
    let summary = train(config(&out, text, &["run.steps=36", "optim.lr=1e-2"]), 58..60);
    let metrics = read_metrics(out.join("metrics.jsonl")).unwrap();
    let anomaly = metrics.iter().find(|m| m.events.iter().any(|e| matches!(e, Event::Anomaly { .. }))).expect("the spike is flagged");
    assert_eq!(anomaly.step, 30);
    let rollback = anomaly.events.iter().find_map(|e| match e {
        Event::Rollback { to_step, .. } => Some(*to_step),
        _ => None,
    });
    assert_eq!(rollback, Some(28), "back to the checkpoint of the step-28 meeting");
    assert_eq!(metrics.last().unwrap().step, 36);
    assert!(metrics.iter().filter(|m| m.step > 30).all(|m| !m.skipped && m.loss.is_finite()));
    // The final checkpoint holds the last meeting's parameters and reloads.
    assert!(!final_params(&summary).is_empty());
    let _ = std::fs::remove_dir_all(&out);
}

/// ZeRO 1/2/3 under data parallelism alone and combined with tensor (with
/// sequence parallelism) and pipeline parallelism: the same steps as
/// without ZeRO on the same mesh, with clipping, fp16 loss scaling and
/// overflows.
#[test]
fn zero_clips_and_scales_the_loss_as_plain_data_parallelism_does() {
    // A threshold that bites at every step, and fp16 with dynamic loss scaling.
    // ZeRO applies the loss scale and the clipping factor inside its update,
    // data parallelism to the gradients first: one f32 rounding apart, which
    // f32 activations keep at ~1e-8 and fp16 ones round up to a half-precision
    // step (~1e-3) now and then.
    let fp16 = "[precision]\ncompute = \"fp16\"\n";
    let cases = [
        ("clipping", "[optim]\nclip = 0.05\n".to_string(), 1e-5),
        ("fp16", format!("{fp16}[optim]\nclip = 0.05\n"), 1e-3),
        // A scale so large that the first steps overflow and are skipped.
        ("fp16-overflow", format!("{fp16}initial_scale = 4e6\n"), 1e-3),
    ];
    let meshes = [("dp2", "dp = 2"), ("dp2-tp2-sp-pp2", "dp = 2\ntp = 2\nsp = true\npp = 2")];
    for ((what, settings, tolerance), (tag, mesh)) in cases.iter().flat_map(|c| meshes.map(|m| (c, m))) {
        let (what, tolerance) = (format!("{what}-{tag}"), *tolerance);
        let plain = losses_and_norms(&format!("zero-{what}-dp"), mesh, settings);
        if what.starts_with("fp16-overflow") {
            assert!(plain.iter().any(|s| s.2) && plain.iter().any(|s| !s.2), "{what}: some steps overflow, some do not: {plain:?}");
        } else {
            assert!(plain.iter().all(|(_, n, _)| n.is_some_and(|n| n > 0.05)), "{what}: the threshold must bite: {plain:?}");
        }
        for stage in 1..=3 {
            let zero = losses_and_norms(&format!("zero-{what}-{stage}"), mesh, &format!("{settings}[zero]\nstage = {stage}\n"));
            for (step, ((l0, n0, s0), (l1, n1, s1))) in plain.iter().zip(&zero).enumerate() {
                let close = |a: f64, b: f64| (a - b).abs() <= tolerance * a.abs().max(1e-3);
                assert!(close(*l0, *l1), "{what}, ZeRO-{stage}, step {}: loss {l1} where data parallelism gives {l0}", step + 1);
                assert_eq!(s0, s1, "{what}, ZeRO-{stage}, step {}: skipped or not as data parallelism", step + 1);
                // Every stage logs the norm, measured over its shards (none on an overflow).
                match (n0, n1) {
                    (Some(n0), Some(n1)) => assert!(close(*n0, *n1), "{what}, ZeRO-{stage}, step {}: norm {n1} where data parallelism gives {n0}", step + 1),
                    (None, None) => assert!(*s0, "a step without a norm overflowed"),
                    _ => panic!("{what}, ZeRO-{stage}, step {}: norm {n1:?} where data parallelism gives {n0:?}", step + 1),
                }
            }
        }
    }
}

#[test]
fn gradient_accumulation_equals_one_big_batch() {
    let (a, b) = (scratch("accum"), scratch("big"));
    let accum = train(config(&a, "[batch]\nmicro_batch = 2\ngrad_accum = 3\n", &["run.steps=4"]), 0..0);
    let big = train(config(&b, "[batch]\nmicro_batch = 6\ngrad_accum = 1\n", &["run.steps=4"]), 0..0);
    let (pa, pb) = (final_params(&accum), final_params(&big));
    for ((_, x), (_, y)) in accum.losses.iter().zip(&big.losses) {
        assert!((x - y).abs() <= 1e-5 * y.abs(), "loss {x} vs {y}");
    }
    for ((name, x), (_, y)) in pa.iter().zip(&pb) {
        let err = x.iter().zip(y).map(|(p, q)| (p - q).abs()).fold(0.0f32, f32::max);
        assert!(err < 1e-5, "{name}: {err}");
    }
    let _ = (std::fs::remove_dir_all(&a), std::fs::remove_dir_all(&b));
}

#[test]
fn a_loss_spike_rolls_back_and_skips_the_bad_data() {
    let out = scratch("spike");
    // Draws 58 and 59 (step 30) are scrambled: that step's loss jumps far above the average.
    let cfg = config(
        &out,
        "[batch]\nmicro_batch = 8\n[checkpoint]\nevery = 4\n[stability]\nspike_factor = 1.8\nwindow = 10\nwarmup = 5\n",
        &["run.steps=36", "optim.lr=1e-2"],
    );
    let summary = train(cfg, 58..60);
    let metrics = read_metrics(out.join("metrics.jsonl")).unwrap();
    let anomaly = metrics.iter().find(|m| m.events.iter().any(|e| matches!(e, Event::Anomaly { .. }))).expect("the spike is flagged");
    assert_eq!(anomaly.step, 30, "grad_accum 2: draws 58 and 59 are step 30");
    assert!(anomaly.skipped);
    // The event names the step of the line it is on.
    let detail = anomaly.events.iter().find_map(|e| match e {
        Event::Anomaly { detail } => Some(detail.clone()),
        _ => None,
    });
    assert!(detail.as_deref().is_some_and(|d| d.starts_with("step 30:")), "{detail:?}");
    let rollback = anomaly.events.iter().find_map(|e| match e {
        Event::Rollback { to_step, skipped_batches } => Some((*to_step, *skipped_batches)),
        _ => None,
    });
    assert_eq!(rollback, Some((28, 4)), "back to the step-28 checkpoint, skipping the draws of steps 29 and 30");
    // The run then replays steps 29 and 30 on fresh data and finishes healthy.
    assert_eq!(metrics.iter().filter(|m| m.step == 30).count(), 2);
    assert_eq!(metrics.last().unwrap().step, 36);
    assert!(metrics.iter().filter(|m| m.events.iter().any(|e| matches!(e, Event::Anomaly { .. }))).count() == 1);
    assert!(summary.events.iter().any(|(_, e)| matches!(e, Event::Rollback { .. })));
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn fp16_training_scales_the_loss_and_learns() {
    let out = scratch("fp16");
    let summary = train(config(&out, "[precision]\ncompute = \"fp16\"\ninitial_scale = 1024.0\n[batch]\nmicro_batch = 4\n", &["run.steps=12"]), 0..0);
    let metrics = read_metrics(out.join("metrics.jsonl")).unwrap();
    assert!(metrics.iter().all(|m| m.loss_scale == Some(1024.0)));
    let l = &summary.losses;
    assert!(l.last().unwrap().1 < l[0].1, "{l:?}");
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn bf16_training_keeps_f32_masters_and_learns() {
    let out = scratch("bf16");
    let summary = train(config(&out, "[precision]\ncompute = \"bf16\"\n[batch]\nmicro_batch = 4\n", &["run.steps=12"]), 0..0);
    let metrics = read_metrics(out.join("metrics.jsonl")).unwrap();
    assert!(metrics.iter().all(|m| m.loss_scale.is_none() && !m.skipped), "bf16 needs no loss scaling");
    let l = &summary.losses;
    assert!(l.last().unwrap().1 < l[0].1, "{l:?}");
    // The checkpoint holds f32 master weights.
    let manifest: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(summary.checkpoint.join("manifest.json")).unwrap()).unwrap();
    let dtypes: Vec<&str> = manifest["tensors"].as_array().unwrap().iter().filter_map(|t| t["dtype"].as_str()).collect();
    assert!(!dtypes.is_empty() && dtypes.iter().all(|d| *d == "f32"), "{dtypes:?}");
    let _ = std::fs::remove_dir_all(&out);
}

/// The MoE model of the expert-parallel tests (two layers of four experts),
/// holding the experts of expert-parallel rank `e` of `ep`.
fn moe(e: usize, ep: usize) -> tessera::Result<MoeGpt> {
    MoeGpt::new(VOCAB, 16, 2, 2, 4, e, ep)
}

/// Trains [`moe`] as `cfg` says on the counting task (as [`train`] does the GPT).
fn train_moe(cfg: TrainConfig) -> RunSummary {
    let micro_batch = cfg.batch.micro_batch;
    let trainer = Trainer::new(
        cfg,
        ModelFacts { vocab: VOCAB, flops_per_token: 1e5 },
        |_cx: &Cx, e, ep| moe(e, ep),
        move |replica| Ok(Box::new(Counting { replica, micro_batch, drawn: 0, poisoned: 0..0 }) as Box<dyn Batches>),
    )
    .unwrap();
    trainer.run().unwrap()
}

/// The `(step, loss)` of every step and the gradient norms of an MoE run
/// configured by `text` and `overrides`, in a scratch directory `name`
/// removed afterwards.
fn moe_losses_and_norms(name: &str, text: &str, overrides: &[&str]) -> (Vec<(u64, f64)>, Vec<f64>) {
    let out = scratch(name);
    let summary = train_moe(config(&out, text, overrides));
    let norms: Vec<f64> = read_metrics(out.join("metrics.jsonl")).unwrap().iter().map(|m| m.grad_norm.unwrap()).collect();
    let _ = std::fs::remove_dir_all(&out);
    (summary.losses, norms)
}

/// Expert parallelism in the trainer: the experts of each MoE layer dealt
/// over the ep ranks, tokens dispatched by all-to-all, the experts'
/// gradients summed over the data-parallel group and every other over all
/// replicas, in buckets overlapped with the backward (64-byte buckets: many
/// of each kind), the global norm counting each expert once; and with ZeRO,
/// which shards over the data-parallel group and sums the rest over the
/// expert-parallel group on its shard. Every layout
/// sees the same four sequences a step and must take the steps one rank
/// takes, with the same gradient norms.
#[test]
fn expert_parallel_training_matches_one_rank() {
    let run = |name: &str, mesh: [usize; 4]| {
        let [dp, ep, tp, zero] = mesh;
        let sets = [
            format!("mesh.dp={dp}"),
            format!("mesh.ep={ep}"),
            format!("mesh.tp={tp}"),
            format!("zero.stage={zero}"),
            format!("batch.micro_batch={}", 4 / (dp * ep)),
        ];
        let mut overrides: Vec<&str> = sets.iter().map(String::as_str).collect();
        overrides.extend(["run.steps=3", "mesh.bucket_bytes=64"]);
        // Clipping bites (the norms are about 1.25): a norm that differed
        // between the expert-parallel ranks would scale their shared
        // parameters differently.
        moe_losses_and_norms(name, "[batch]\ngrad_accum = 1\n[optim]\nclip = 0.5\n", &overrides)
    };
    let (one, one_norms) = run("moe-ep1", [1, 1, 1, 0]);
    assert_eq!(one.len(), 3);
    // dp × ep × tp and the ZeRO stage.
    for mesh in [[1, 2, 1, 0], [2, 2, 1, 0], [1, 4, 1, 0], [2, 2, 2, 0], [2, 2, 1, 1], [2, 2, 1, 2], [2, 2, 2, 3], [1, 2, 1, 3]] {
        let (losses, norms) = run(&format!("moe-{mesh:?}"), mesh);
        for (((step, a), (_, b)), (na, nb)) in one.iter().zip(&losses).zip(one_norms.iter().zip(&norms)) {
            assert!((a - b).abs() <= 1e-6 * a.abs(), "dp×ep×tp, ZeRO {mesh:?}, step {step}: loss {b}, one rank {a}");
            assert!((na - nb).abs() <= 1e-6 * na.abs(), "dp×ep×tp, ZeRO {mesh:?}, step {step}: gradient norm {nb}, one rank {na}");
        }
    }
}

/// FP8 with the experts split: the dense layers' products run in FP8 on
/// every expert-parallel rank (the experts' stay in the compute dtype), and
/// their scales are reduced over all data replicas, so dp × ep layouts take
/// the steps one rank takes, to the rounding of sums over another split.
#[test]
fn fp8_with_expert_parallelism_trains_like_one_rank() {
    let run = |name: &str, sets: &[&str]| {
        let mut overrides = vec!["run.steps=4"];
        overrides.extend(sets);
        moe_losses_and_norms(name, "[batch]\ngrad_accum = 1\n[precision]\nfp8 = true\n", &overrides)
    };
    let (one, one_norms) = run("fp8-moe-one", &["batch.micro_batch=4"]);
    let (plain, _) = moe_losses_and_norms("fp8-moe-plain", "[batch]\ngrad_accum = 1\n", &["run.steps=4", "batch.micro_batch=4"]);
    assert!(one != plain, "FP8 rounds the dense products");
    for sets in [&["mesh.ep=2", "batch.micro_batch=2"][..], &["mesh.dp=2", "mesh.ep=2", "batch.micro_batch=1"][..]] {
        let (losses, norms) = run(&format!("fp8-moe-{}", sets.join("-")), sets);
        assert_eq!(losses.len(), one.len());
        for (((step, a), (_, b)), (na, nb)) in one.iter().zip(&losses).zip(one_norms.iter().zip(&norms)) {
            assert!((a - b).abs() <= 1e-5 * a.abs(), "{sets:?}, step {step}: loss {b}, one rank {a}");
            assert!((na - nb).abs() <= 1e-4 * na.abs(), "{sets:?}, step {step}: gradient norm {nb}, one rank {na}");
        }
    }
}

/// Every technique in one run, chosen in the TOML: an MoE model on
/// dp2 × ep2 × tp2 (with sequence parallelism) × pp2, ZeRO-3, full
/// recompute, two microbatches accumulated per step and clipping that
/// bites, takes the steps one rank takes (losses and gradient norms).
#[test]
fn every_technique_in_one_run_trains_like_one_rank() {
    let run = |name: &str, text: &str| moe_losses_and_norms(name, text, &["run.steps=3"]);
    let common = "[optim]\nclip = 0.5\n[batch]\ngrad_accum = 2\n";
    let (one, one_norms) = run("all-one", &format!("{common}micro_batch = 4\n"));
    let everything = format!("{common}micro_batch = 1\n[mesh]\ndp = 2\nep = 2\ntp = 2\nsp = true\npp = 2\n[zero]\nstage = 3\n[recompute]\nmode = \"full\"\n");
    let (all, all_norms) = run("all-techniques", &everything);
    assert!(one_norms.iter().all(|&n| n > 0.5), "clipping must bite: {one_norms:?}");
    assert_eq!(all.len(), one.len());
    for (((step, a), (_, b)), (na, nb)) in one.iter().zip(&all).zip(one_norms.iter().zip(&all_norms)) {
        assert!((a - b).abs() <= 1e-5 * a.abs(), "step {step}: loss {b} with every technique, {a} on one rank");
        assert!((na - nb).abs() <= 1e-5 * na.abs(), "step {step}: gradient norm {nb} with every technique, {na} on one rank");
    }
}

/// An MoE run with expert parallelism and ZeRO (each stage) stopped and
/// resumed equals the uninterrupted run: the shards of every expert and of
/// the shared parameters are saved and restored, and the final checkpoint
/// reshards onto one rank with every expert.
#[test]
fn expert_parallel_zero_training_resumes_bit_for_bit() {
    let run = |out: &std::path::Path, stage: usize, stop: Option<u64>| {
        let mut overrides =
            vec!["run.steps=6".to_string(), "mesh.dp=2".into(), "mesh.ep=2".into(), format!("zero.stage={stage}"), "batch.micro_batch=1".into()];
        overrides.extend(stop.map(|s| format!("run.stop_after={s}")));
        train_moe(config(out, "[batch]\ngrad_accum = 1\n", &overrides.iter().map(String::as_str).collect::<Vec<_>>()))
    };
    let params = |summary: &RunSummary| {
        let cx = Cx::new(Device::cpu());
        let model = tessera::module::build(moe(0, 1).unwrap(), &cx).unwrap();
        tessera::ckpt::Checkpointer::new(summary.checkpoint.parent().unwrap(), 10).unwrap().load(&summary.checkpoint, &model, None, &cx).unwrap();
        tessera::module::distinct_params(&model)
            .unwrap()
            .into_iter()
            .map(|n| (n.names[0].clone(), n.param.value().unwrap().to_vec::<f32>().unwrap()))
            .collect::<Vec<_>>()
    };
    for stage in 1..=3 {
        let (a, b) = (scratch(&format!("moe-zero{stage}-straight")), scratch(&format!("moe-zero{stage}-resumed")));
        let straight = run(&a, stage, None);
        let first = run(&b, stage, Some(3));
        let resumed = run(&b, stage, None);
        assert_eq!(resumed.resumed_from, 3);
        let losses: Vec<f64> = first.losses.iter().chain(&resumed.losses).map(|l| l.1).collect();
        assert_eq!(losses, straight.losses.iter().map(|l| l.1).collect::<Vec<_>>(), "ZeRO-{stage}");
        let (p, q) = (params(&resumed), params(&straight));
        assert!(p.iter().any(|(name, _)| name.contains(".experts.3.")), "every expert is in the checkpoint");
        assert_eq!(p, q, "ZeRO-{stage}");
        let _ = (std::fs::remove_dir_all(&a), std::fs::remove_dir_all(&b));
    }
}

/// `mesh.device = "cuda"` puts rank r on GPU r with NCCL between them. On
/// one GPU the run learns the same task as on the CPU, its losses within
/// the GPU kernels' rounding of the CPU's; without a GPU the configuration
/// is refused with an error naming the key (never a panic).
#[test]
fn a_run_on_a_gpu_follows_the_cpu_run() {
    let text = "[batch]\nmicro_batch = 4\n";
    if tessera::backend::cuda::testing::cuda_or_skip("trainer::a_run_on_a_gpu_follows_the_cpu_run").is_none() {
        let out = scratch("no-gpu");
        let cfg = config(&out, text, &["run.steps=2", "mesh.device=\"cuda\""]);
        let facts = ModelFacts { vocab: VOCAB, flops_per_token: 1e5 };
        let trainer = Trainer::new(
            cfg,
            facts,
            |_cx: &Cx, _, _| Gpt::with_qkv_bias(VOCAB, 16, 2, 2, false),
            |replica| Ok(Box::new(Counting { replica, micro_batch: 4, drawn: 0, poisoned: 0..0 }) as Box<dyn Batches>),
        )
        .unwrap();
        let e = trainer.run().unwrap_err().to_string();
        assert!(e.contains("mesh.device") && e.contains("GPU 0"), "{e}");
        let _ = std::fs::remove_dir_all(&out);
        return;
    }
    gpu_follows_cpu("ranks", text);
}

/// Trains `text` for 8 steps on the CPU and on GPU 0: the GPU run's losses
/// within the kernels' rounding of the CPU's, its parameters finite.
fn gpu_follows_cpu(name: &str, text: &str) {
    let steps = ["run.steps=8", "run.trace_steps=0"];
    let (a, b) = (scratch(&format!("{name}-cpu")), scratch(&format!("{name}-gpu")));
    let cpu = train(config(&a, text, &steps), 0..0);
    let gpu = train(config(&b, text, &[steps[0], steps[1], "mesh.device=\"cuda\""]), 0..0);
    assert_eq!(gpu.losses.len(), cpu.losses.len());
    for ((step, g), (_, c)) in gpu.losses.iter().zip(&cpu.losses) {
        assert!((g - c).abs() <= 1e-3 * c.abs().max(1.0), "step {step}: loss {g} on the GPU, {c} on the CPU");
    }
    assert!(final_params(&gpu).iter().all(|(_, v)| v.iter().all(|x| x.is_finite())));
    let _ = (std::fs::remove_dir_all(&a), std::fs::remove_dir_all(&b));
}

/// ZeRO-3 with its optimizer state, master weights and parameter shard on
/// the host (rows copied to the GPU ahead of each use), and the inputs that
/// fully recomputed layers keep offloaded too: on one GPU the run follows
/// the same configuration on the CPU (where offload is bit for bit the run
/// without it) within the kernels' rounding.
#[test]
fn a_run_on_a_gpu_with_offload_follows_the_cpu_run() {
    if tessera::backend::cuda::testing::cuda_or_skip("trainer::a_run_on_a_gpu_with_offload_follows_the_cpu_run").is_none() {
        return;
    }
    gpu_follows_cpu("offload", "[batch]\nmicro_batch = 4\n[zero]\nstage = 3\noffload = true\n[recompute]\nmode = \"full\"\noffload = true\n");
}

/// Two pipeline stages on two GPUs (activations and their gradients pass
/// between them as messages) learn like the same mesh of CPU ranks.
#[test]
fn a_pipeline_on_two_gpus_follows_the_cpu_run() {
    const TEST: &str = "trainer::a_pipeline_on_two_gpus_follows_the_cpu_run";
    if tessera::backend::cuda::testing::cuda_or_skip(TEST).is_none() {
        return;
    }
    if let Err(e) = Device::cuda(1) {
        return tessera::backend::cuda::report_skip(TEST, &format!("needs 2 CUDA devices: {e}"));
    }
    let text = "[mesh]\npp = 2\n[batch]\nmicro_batch = 2\ngrad_accum = 2\n";
    let steps = ["run.steps=6", "run.trace_steps=0"];
    let (a, b) = (scratch("pp-cpu"), scratch("pp-gpu"));
    let cpu = train(config(&a, text, &steps), 0..0);
    let gpu = train(config(&b, text, &[steps[0], steps[1], "mesh.device=\"cuda\""]), 0..0);
    for ((step, g), (_, c)) in gpu.losses.iter().zip(&cpu.losses) {
        assert!((g - c).abs() <= 1e-3 * c.abs().max(1.0), "step {step}: loss {g} on the GPUs, {c} on the CPU");
    }
    assert_eq!(gpu.losses.len(), 6);
    let _ = (std::fs::remove_dir_all(&a), std::fs::remove_dir_all(&b));
}

/// A rank that panics (here: its data source) ends the run with an error
/// naming it, on every rank, instead of leaving its peers waiting.
#[test]
fn a_panicking_rank_ends_the_run_with_an_error() {
    struct Broken(Counting);
    impl Batches for Broken {
        fn next_batch(&mut self, device: &Device) -> tessera::Result<(Tensor, Tensor)> {
            if self.0.replica.index == 1 && self.0.drawn == 3 {
                panic!("the data source of replica 1 broke");
            }
            self.0.next_batch(device)
        }
        fn cursor(&self) -> serde_json::Value {
            self.0.cursor()
        }
        fn restore(&mut self, cursor: &serde_json::Value) -> tessera::Result<()> {
            self.0.restore(cursor)
        }
    }
    let out = scratch("panic");
    let cfg = config(&out, "[mesh]\ndp = 2\n[batch]\nmicro_batch = 2\n", &["run.steps=6", "run.trace_steps=0"]);
    let facts = ModelFacts { vocab: VOCAB, flops_per_token: 1e5 };
    let trainer = Trainer::new(
        cfg,
        facts,
        |_cx: &Cx, _, _| Gpt::with_qkv_bias(VOCAB, 16, 2, 2, false),
        |replica| Ok(Box::new(Broken(Counting { replica, micro_batch: 2, drawn: 0, poisoned: 0..0 })) as Box<dyn Batches>),
    )
    .unwrap();
    let e = trainer.run().unwrap_err().to_string();
    assert!(e.contains("panicked"), "{e}");
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn unfinished_checkpoints_of_dead_jobs_are_removed_and_reported() {
    let out = scratch("leftovers");
    let root = out.join("checkpoints");
    // A pid above the kernel's limit (4194304) names a job that cannot run.
    let leftover = root.join("step-7.tmp-4999999");
    std::fs::create_dir_all(&leftover).unwrap();
    std::fs::write(leftover.join("pp0-tp0.safetensors"), vec![0u8; 64]).unwrap();
    train(config(&out, "[batch]\nmicro_batch = 2\n", &["run.steps=2"]), 0..0);
    assert!(!leftover.exists(), "the leftover is removed");
    let metrics = read_metrics(out.join("metrics.jsonl")).unwrap();
    let dir = leftover.display().to_string();
    assert!(metrics[0].events.contains(&Event::Cleaned { dir }), "{:?}", metrics[0].events);
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn a_second_job_on_the_same_run_directory_fails_at_once_naming_the_first() {
    let out = scratch("two-jobs");
    let first_cfg = config(&out, "[batch]\nmicro_batch = 2\n", &["run.steps=400"]);
    let second_cfg = config(&out, "[batch]\nmicro_batch = 2\n", &["run.steps=2"]);
    let lock = out.join(tessera::train::LOCK_FILE);
    std::thread::scope(|s| {
        let first = s.spawn(move || train(first_cfg, 0..0));
        // Wait until the first job holds the directory.
        let t0 = std::time::Instant::now();
        while std::fs::read_to_string(&lock).map_or(true, |h| h.trim().is_empty()) {
            assert!(t0.elapsed().as_secs() < 60, "the first job never took the lock");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let facts = ModelFacts { vocab: VOCAB, flops_per_token: 1e5 };
        let started = std::time::Instant::now();
        let second = Trainer::new(
            second_cfg,
            facts,
            |_cx: &Cx, _, _| Gpt::with_qkv_bias(VOCAB, 16, 2, 2, false),
            |replica| Ok(Box::new(Counting { replica, micro_batch: 2, drawn: 0, poisoned: 0..0 }) as Box<dyn Batches>),
        )
        .unwrap()
        .run();
        let e = second.expect_err("the second job is refused").to_string();
        assert!(e.contains("in use by pid") && e.contains(&std::process::id().to_string()), "{e}");
        assert!(started.elapsed().as_secs() < 5, "refused at once, not after waiting");
        let summary = first.join().unwrap();
        assert_eq!(summary.losses.len(), 400, "the first job is not disturbed");
    });
    let metrics = read_metrics(out.join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.iter().map(|m| m.step).collect::<Vec<_>>(), (1..=400).collect::<Vec<_>>(), "one job's lines, whole");
    let _ = std::fs::remove_dir_all(&out);
}

/// Flips the last byte of every rank file of the checkpoint in `dir`.
fn damage(dir: &Path) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            let mut bytes = std::fs::read(&path).unwrap();
            let last = bytes.len() - 1;
            bytes[last] ^= 0x01;
            std::fs::write(&path, bytes).unwrap();
        }
    }
}

#[test]
fn damaged_checkpoints_are_never_deleted_nor_skipped_in_silence() {
    let out = scratch("damaged");
    let text = "[batch]\nmicro_batch = 2\n[checkpoint]\nevery = 2\nkeep = 2\n";
    train(config(&out, text, &["run.steps=4"]), 0..0);
    let root = out.join("checkpoints");
    let (step2, step4) = (root.join("step-2"), root.join("step-4"));
    assert!(step2.is_dir() && step4.is_dir());

    // The newest is damaged: the run resumes from step 2, sets step 4 aside
    // (reported on stderr and on its first metrics line), and its own saves
    // never delete it.
    damage(&step4);
    let summary = train(config(&out, text, &["run.steps=8"]), 0..0);
    assert_eq!(summary.resumed_from, 2);
    let aside: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("damaged-step-4-"))
        .collect();
    assert_eq!(aside.len(), 1, "step 4 is set aside once");
    assert!(std::fs::read_to_string(aside[0].join(tessera::ckpt::REASON_FILE)).unwrap().contains("safetensors"));
    // The first run's lines of steps 3 and 4, which the resumed run
    // replays, are replaced by the replay's: one line per step.
    let metrics = read_metrics(out.join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.iter().map(|m| m.step).collect::<Vec<_>>(), (1..=8).collect::<Vec<_>>());
    let line = &metrics[2];
    assert!(line.events.iter().any(|e| matches!(e, Event::SetAside { dir, .. } if dir.ends_with("step-4"))), "{:?}", line.events);
    assert!(line.events.contains(&Event::Resumed { from_step: 2, dropped_lines: 2 }), "{:?}", line.events);

    // Every checkpoint damaged: the run refuses to start over (naming each)
    // and deletes or truncates nothing.
    for (_, dir) in tessera::ckpt::Checkpointer::open(&root, 10).unwrap().steps().unwrap() {
        damage(&dir);
    }
    let lines = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let e = try_train(config(&out, text, &["run.steps=10"]), false).expect_err("refused").to_string();
    assert!(e.contains("none can be loaded") && e.contains("step-8") && e.contains("step-6") && e.contains("--fresh"), "{e}");
    assert_eq!(std::fs::read_to_string(out.join("metrics.jsonl")).unwrap(), lines, "metrics are not truncated");
    assert!(root.join("step-8").is_dir() && root.join("step-6").is_dir(), "nothing is deleted");

    // A run that would not resume would prune them: refused too.
    let e = try_train(config(&out, text, &["run.steps=10", "checkpoint.resume=false"]), false).expect_err("refused").to_string();
    assert!(e.contains("would not resume from and would delete"), "{e}");

    // Told to start over, it does.
    let summary = try_train(config(&out, text, &["run.steps=2"]), true).unwrap();
    assert_eq!((summary.resumed_from, summary.losses.len()), (0, 2));
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn a_resume_does_not_trust_an_edited_manifest() {
    let out = scratch("edited");
    let text = "[batch]\nmicro_batch = 2\n[checkpoint]\nevery = 2\nkeep = 2\n";
    train(config(&out, text, &["run.steps=4"]), 0..0);
    let manifest = out.join("checkpoints").join("step-4").join("manifest.json");
    let mut json: serde_json::Value = serde_json::from_slice(&std::fs::read(&manifest).unwrap()).unwrap();
    json["extra"]["cursor"] = serde_json::json!(0);
    std::fs::write(&manifest, serde_json::to_vec_pretty(&json).unwrap()).unwrap();
    let summary = train(config(&out, text, &["run.steps=6"]), 0..0);
    assert_eq!(summary.resumed_from, 2, "step 4's edited cursor is not trusted; step 2 is");
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn a_run_that_cannot_fit_in_memory_is_refused_before_it_allocates() {
    let out = scratch("too-big");
    let cfg = config(&out, "[batch]\nmicro_batch = 2\n", &["run.steps=1"]);
    let facts = ModelFacts { vocab: VOCAB, flops_per_token: 1e5 };
    // About 100 billion parameters: shapes only until the ranks materialise them.
    let err = Trainer::new(
        cfg,
        facts,
        |_cx: &Cx, _, _| Gpt::with_qkv_bias(VOCAB, 65_536, 2, 2, false),
        |replica| Ok(Box::new(Counting { replica, micro_batch: 2, drawn: 0, poisoned: 0..0 }) as Box<dyn Batches>),
    )
    .unwrap()
    .run()
    .expect_err("refused")
    .to_string();
    assert!(err.contains("needs at least") && err.contains("GiB") && err.contains("parameters"), "{err}");
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn a_configuration_that_cannot_run_is_refused_before_the_run_directory_exists() {
    let scratch = scratch("preflight");
    let out = scratch.path().join("run");
    let refused = |toml: &str, key: &str, says: &str| {
        let e = try_train(config(&out, toml, &["run.steps=1"]), false).expect_err("refused");
        assert!(matches!(&e, Error::Config { key: k, .. } if k == key), "{toml}: {e:?}");
        assert!(e.to_string().contains(says), "{toml}: {e}");
        assert!(!out.exists(), "{toml}: the run directory was created");
    };
    // The two-layer model cannot fill 2 stages of 2 chunks, nor 3 stages.
    refused("[mesh]\npp = 2\nschedule = \"interleaved\"\nchunks = 2\n[batch]\ngrad_accum = 2\n", "mesh.pp", "2 layers, too few for 4 pipeline stages");
    refused("[mesh]\npp = 3\n[batch]\ngrad_accum = 3\n", "mesh.pp", "too few for 3 pipeline stages");
    // The model's two attention heads cannot be split over four ranks.
    refused("[mesh]\ntp = 4\n", "mesh.tp", "cannot be split over a tensor-parallel group of 4");
    // Interleaving sends microbatches through the chunks in groups of pp.
    refused("[mesh]\npp = 2\nschedule = \"interleaved\"\nchunks = 2\n[batch]\ngrad_accum = 3\n", "batch.grad_accum", "not a multiple of the 2 stages");
}

/// The trainer runs ZB-H1 (`mesh.schedule = "zb-h1"`) to the same losses
/// and gradient norms as 1F1B: the split backward delivers the same
/// gradients, with data parallelism's buckets sent once the weight halves
/// made them final.
#[test]
fn zero_bubble_h1_trains_like_one_f_one_b() {
    let mesh = "dp = 2\ntp = 2\npp = 2";
    let extra = "grad_accum = 4\n";
    let ofob = losses_and_norms("sched-1f1b", mesh, extra);
    let zb = losses_and_norms("sched-zb-h1", &format!("{mesh}\nschedule = \"zb-h1\""), extra);
    assert_eq!(zb.len(), 8);
    assert_eq!(zb, ofob);
}

/// Context parallelism in the trainer: each sequence split over the cp
/// ranks (their chunks of tokens and targets), attention around the ring,
/// gradients averaged over data × context ranks. Every layout takes the
/// steps one rank takes, with the same gradient norms; with ZeRO it also
/// stops and resumes bit for bit, and a checkpoint saved on cp2 resumes on
/// one rank.
#[test]
fn context_parallel_training_matches_one_rank_and_resumes() {
    let close = |a: &[(f64, Option<f64>, bool)], b: &[(f64, Option<f64>, bool)], what: &str| {
        assert_eq!(a.len(), b.len(), "{what}");
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x.0 - y.0).abs() <= 1e-5 * x.0.abs(), "{what}, step {}: loss {} vs {}", i + 1, y.0, x.0);
            let (nx, ny) = (x.1.unwrap(), y.1.unwrap());
            assert!((nx - ny).abs() <= 1e-4 * nx, "{what}, step {}: gradient norm {ny} vs {nx}", i + 1);
        }
    };
    let one = losses_and_norms("cp-one", "cp = 1", "");
    close(&one, &losses_and_norms("cp2", "cp = 2", ""), "cp2");
    close(&one, &losses_and_norms("cp4-tp2-sp", "cp = 4\ntp = 2\nsp = true", ""), "cp4 tp2 sp");
    let dp2 = losses_and_norms("cp-dp2", "dp = 2", "");
    close(&dp2, &losses_and_norms("cp2-dp2-pp2-zero", "cp = 2\ndp = 2\npp = 2", "grad_accum = 2\n[zero]\nstage = 2\n"), "cp2 dp2 pp2 ZeRO-2");

    let (a, b) = (scratch("cp2-zero-straight"), scratch("cp2-zero-resumed"));
    let text = "[mesh]\ncp = 2\ndp = 2\n[zero]\nstage = 1\n[optim]\nclip = 0.0\n[batch]\nmicro_batch = 2\n";
    let straight = train(config(&a, text, &["run.steps=8"]), 0..0);
    train(config(&b, text, &["run.steps=8", "run.stop_after=4"]), 0..0);
    let resumed = train(config(&b, text, &["run.steps=8"]), 0..0);
    assert_eq!(resumed.resumed_from, 4);
    assert_eq!(final_params(&resumed), final_params(&straight), "ZeRO-1 on cp2 × dp2, resumed");
    // The same checkpoint on one rank with the global batch in one microbatch.
    let single = "[optim]\nclip = 0.0\n[batch]\nmicro_batch = 4\n";
    let one_rank = train(config(&b, single, &["run.steps=9"]), 0..0);
    assert_eq!(one_rank.resumed_from, 8);
    let _ = (std::fs::remove_dir_all(&a), std::fs::remove_dir_all(&b));
}

/// Context parallelism with experts, tensor and sequence parallelism, ZeRO-3
/// and full recompute in one run takes one rank's steps.
#[test]
fn context_parallelism_with_experts_and_zero3_trains_like_one_rank() {
    let run = |name: &str, text: &str| moe_losses_and_norms(name, text, &["run.steps=3"]);
    let common = "[optim]\nclip = 0.5\n[batch]\ngrad_accum = 2\n";
    let (one, one_norms) = run("cp-moe-one", &format!("{common}micro_batch = 4\n"));
    let all = format!("{common}micro_batch = 2\n[mesh]\ncp = 2\nep = 2\ntp = 2\nsp = true\n[zero]\nstage = 3\n[recompute]\nmode = \"full\"\n");
    let (got, got_norms) = run("cp-moe-all", &all);
    assert_eq!(got.len(), one.len());
    for (((step, a), (_, b)), (na, nb)) in one.iter().zip(&got).zip(one_norms.iter().zip(&got_norms)) {
        assert!((a - b).abs() <= 1e-5 * a.abs(), "step {step}: loss {b} on cp2 ep2 tp2, {a} on one rank");
        assert!((na - nb).abs() <= 1e-5 * na.abs(), "step {step}: gradient norm {nb} on cp2 ep2 tp2, {na} on one rank");
    }
}

/// Optimizer offload (ZeRO-Offload) and activation offload change where
/// state lives, never a value: runs with them equal the runs without bit
/// for bit, at every stage, with tensor and pipeline parallelism and in
/// bf16; an offloaded run resumes bit for bit, and its checkpoint resumes
/// without offload too.
#[test]
fn offloaded_training_equals_training_on_the_device_and_resumes() {
    let cases = [("dp2", "dp = 2", 1, ""), ("dp2", "dp = 2", 2, "[precision]\ncompute = \"bf16\"\n"), ("dp2-tp2-pp2", "dp = 2\ntp = 2\npp = 2", 3, "")];
    for (tag, mesh, stage, extra) in cases {
        let base = format!("[mesh]\n{mesh}\n[zero]\nstage = {stage}\n[batch]\nmicro_batch = 2\ngrad_accum = 2\n{extra}");
        let dirs = ["off", "optimizer", "both"].map(|what| scratch(&format!("offload-{stage}-{tag}-{what}")));
        let plain = train(config(&dirs[0], &base, &["run.steps=4"]), 0..0);
        let on = ["run.steps=4", "zero.offload=true", "recompute.mode=\"full\"", "recompute.offload=true"];
        let full = train(config(&dirs[1], &base, &on[..3]), 0..0);
        let offloaded = train(config(&dirs[2], &base, &on), 0..0);
        let losses = |r: &RunSummary| r.losses.iter().map(|l| l.1).collect::<Vec<_>>();
        assert_eq!(losses(&offloaded), losses(&plain), "ZeRO-{stage} on {tag}: losses");
        assert_eq!(final_params(&offloaded), final_params(&plain), "ZeRO-{stage} on {tag}: parameters");
        assert_eq!(final_params(&full), final_params(&plain), "ZeRO-{stage} on {tag}: optimizer offload alone");
    }
    let (a, b) = (scratch("offload-straight"), scratch("offload-resumed"));
    let text = "[mesh]\ndp = 2\n[zero]\nstage = 3\noffload = true\n[optim]\nclip = 0.0\n[batch]\nmicro_batch = 2\n";
    let straight = train(config(&a, text, &["run.steps=8"]), 0..0);
    train(config(&b, text, &["run.steps=8", "run.stop_after=4"]), 0..0);
    let resumed = train(config(&b, text, &["run.steps=8"]), 0..0);
    assert_eq!(resumed.resumed_from, 4);
    assert_eq!(final_params(&resumed), final_params(&straight), "ZeRO-3 offloaded, resumed");
    // The offloaded checkpoint, continued on the device.
    let on_device = train(config(&b, text, &["run.steps=9", "zero.offload=false"]), 0..0);
    assert_eq!(on_device.resumed_from, 8);
    // And a checkpoint written on the device, continued offloaded.
    let offloaded_again = train(config(&b, text, &["run.steps=10"]), 0..0);
    assert_eq!(offloaded_again.resumed_from, 9);
    let _ = (std::fs::remove_dir_all(&a), std::fs::remove_dir_all(&b));
}
