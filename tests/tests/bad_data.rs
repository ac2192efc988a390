//! Bad data stays excluded: the windows a rollback passes over are never
//! served again, so a run of many epochs over a dataset with a bad region
//! finishes; and the default spike rule catches a 600× jump in the loss
//! after a long flat stretch.

mod common;
use common::models::Gpt;
use common::training::{config, scratch, trajectory, SEQ, VOCAB};
use std::collections::HashSet;
use std::path::Path;
use tessera::data::{Cursor, Dataset, Sampler, ShardWriter};
use tessera::module::Cx;
use tessera::observe::{read_metrics, Event};
use tessera::train::{Batches, ModelFacts, RunSummary, TrainConfig, Trainer};

/// Windows in the dataset.
const WINDOWS: u64 = 48;

/// A dataset of `WINDOWS` windows of `SEQ + 1` tokens counting up (mod the
/// vocabulary), easy to learn, except the windows in `bad`, whose tokens
/// are scrambled.
fn dataset(dir: &Path, bad: &[u64]) -> Dataset {
    let total = WINDOWS as usize * SEQ + 1;
    let mut tokens: Vec<u32> = (0..total).map(|i| (i % VOCAB) as u32).collect();
    for &w in bad {
        // Every token of the window but its first and last (which its
        // neighbours share) is noise.
        for i in 1..SEQ {
            let p = w as usize * SEQ + i;
            tokens[p] = (noise(p as u64) % VOCAB as u64) as u32;
        }
    }
    let mut w = ShardWriter::create(dir, VOCAB, None, total).unwrap();
    w.push(&tokens).unwrap();
    w.finish(None).unwrap();
    Dataset::open(dir).unwrap()
}

/// A hash of `n` (SplitMix64's finaliser).
fn noise(n: u64) -> u64 {
    let mut z = n.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn run(cfg: TrainConfig, data: &Dataset) -> tessera::Result<RunSummary> {
    let (global, seed) = (cfg.batch.micro_batch * cfg.mesh.dp, cfg.data.seed);
    let facts = ModelFacts { vocab: VOCAB, flops_per_token: 1e5 };
    Trainer::new(
        cfg,
        facts,
        |_cx: &Cx, _, _| Gpt::with_qkv_bias(VOCAB, 16, 2, 2, false),
        move |replica| Ok(Box::new(Sampler::new(data, global, SEQ, replica.index, replica.count, seed)?) as Box<dyn Batches>),
    )?
    .run()
}

/// The windows the final checkpoint's cursor will never serve again, found
/// by drawing a whole epoch from it.
fn served_after(summary: &RunSummary, data: &Dataset, global: usize) -> HashSet<u64> {
    let manifest = tessera::ckpt::read_manifest(&summary.checkpoint).unwrap();
    let cursor = Cursor::from_json(&manifest.extra["data"]).unwrap();
    let mut s = Sampler::new(data, global, SEQ, 0, 1, cursor.seed).unwrap();
    s.restore(Cursor { position: 0, epoch: cursor.epoch + 1, ..cursor }).unwrap();
    let mut served = HashSet::new();
    for _ in 0..WINDOWS as usize / global {
        if s.next_ids().is_err() {
            break;
        }
        served.extend(s.last_batch().iter().map(|w| w.index));
    }
    served
}

#[test]
fn a_multi_epoch_run_over_a_bad_region_finishes_and_never_sees_it_again() {
    let out = scratch("bad-region");
    let bad = [10, 30];
    // 12 steps an epoch. A first job learns the clean data for 6 epochs;
    // the next continues for 6 more over the same windows with two of
    // them turned to noise (a new data mix with a bad region).
    let text = "[batch]\nmicro_batch = 4\ngrad_accum = 1\n[checkpoint]\nevery = 2\n[stability]\nwarmup = 5\n";
    let data_dir = out.join("data");
    run(config(&out, text, &["run.steps=72", "optim.lr=2e-2"]), &dataset(&data_dir, &[])).expect("the clean epochs");
    std::fs::remove_dir_all(&data_dir).unwrap();
    let data = dataset(&data_dir, &bad);
    // A bad window served again in each epoch would cost a rollback each
    // time, more than the five a run allows.
    let summary = run(config(&out, text, &["run.steps=144", "optim.lr=2e-2"]), &data).expect("the run finishes");
    let rollbacks: Vec<u64> = summary.events.iter().filter_map(|(step, e)| matches!(e, Event::Rollback { .. }).then_some(*step)).collect();
    assert!(!rollbacks.is_empty() && rollbacks.len() <= bad.len(), "one rollback per bad window at most: {rollbacks:?}");
    // Nothing spikes after the last rollback, and the bad windows are out
    // for good: the final cursor never serves them.
    let lines = read_metrics(out.join("metrics.jsonl")).unwrap();
    let last = lines.iter().rposition(|m| m.events.iter().any(|e| matches!(e, Event::Rollback { .. }))).unwrap();
    let after = &lines[last + 1..];
    assert!(after.len() > 40 && after.iter().all(|m| !m.skipped), "{} healthy steps after the last rollback", after.len());
    let served = served_after(&summary, &data, 4);
    assert!(bad.iter().all(|w| !served.contains(w)), "served {served:?}");
    assert!(served.len() >= 4 * 8, "the good data is still served: {}", served.len());
    let _ = std::fs::remove_dir_all(&out);
}

/// The exclusions are part of the run's state: the bad-region run, stopped
/// and resumed at every step of its second job, takes the same steps, rolls
/// back the same way and ends with the same cursor as without stopping.
#[test]
fn a_run_over_a_bad_region_resumed_at_every_step_equals_the_uninterrupted_run() {
    let text = "[batch]\nmicro_batch = 4\ngrad_accum = 1\n[checkpoint]\nevery = 2\n[stability]\nwarmup = 5\n";
    let (a, b) = (scratch("bad-straight"), scratch("bad-stepwise"));
    let mut cursors = Vec::new();
    for (out, stepwise) in [(&a, false), (&b, true)] {
        let dir = out.join("data");
        run(config(out, text, &["run.steps=72", "optim.lr=2e-2"]), &dataset(&dir, &[])).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        let data = dataset(&dir, &[10, 30]);
        // One job per step, each stopping a step further, or one job.
        let stops: Vec<u64> = if stepwise { (73..=144).collect() } else { vec![144] };
        let mut summary = None;
        for k in stops {
            summary = Some(run(config(out, text, &["run.steps=144", "optim.lr=2e-2", &format!("run.stop_after={k}")]), &data).unwrap());
        }
        let summary = summary.unwrap();
        cursors.push(tessera::ckpt::read_manifest(&summary.checkpoint).unwrap().extra["data"].clone());
    }
    assert_eq!(trajectory(&b), trajectory(&a));
    assert_eq!(cursors[0], cursors[1]);
    assert!(!cursors[0]["excluded_spans"].as_array().unwrap().is_empty());
    let _ = (std::fs::remove_dir_all(&a), std::fs::remove_dir_all(&b));
}

/// Counting sequences from a different start each draw, all but draw
/// `bad`, whose targets are noise.
struct LateNoise {
    rows: usize,
    drawn: u64,
    bad: u64,
}

impl Batches for LateNoise {
    fn next_batch(&mut self, device: &tessera::Device) -> tessera::Result<(tessera::Tensor, tessera::Tensor)> {
        let (mut xs, mut ys) = (Vec::new(), Vec::new());
        for r in 0..self.rows as u64 {
            let start = noise(self.drawn * 31 + r) as usize;
            xs.extend((0..SEQ).map(|i| ((start + i) % VOCAB) as u32));
            ys.extend((0..SEQ).map(|i| if self.drawn == self.bad { (noise(1000 + i as u64) % VOCAB as u64) as u32 } else { ((start + i + 1) % VOCAB) as u32 }));
        }
        self.drawn += 1;
        Ok((tessera::Tensor::from_vec(xs, [self.rows, SEQ], device)?, tessera::Tensor::from_vec(ys, [self.rows, SEQ], device)?))
    }
    fn cursor(&self) -> tessera::ckpt::serde_json::Value {
        self.drawn.into()
    }
    fn restore(&mut self, cursor: &tessera::ckpt::serde_json::Value) -> tessera::Result<()> {
        self.drawn = cursor.as_u64().unwrap_or(0);
        Ok(())
    }
}

#[test]
fn the_default_rule_catches_a_600x_jump_after_a_long_flat_stretch() {
    let out = scratch("flat-then-jump");
    // Default [stability] settings. The task is learnt to a flat, tiny
    // loss; draw 150 is noise.
    let cfg = config(&out, "[batch]\nmicro_batch = 2\ngrad_accum = 1\n[checkpoint]\nevery = 10\n", &["run.steps=160", "optim.lr=2e-2", "optim.warmup=5"]);
    let facts = ModelFacts { vocab: VOCAB, flops_per_token: 1e5 };
    let summary = Trainer::new(
        cfg,
        facts,
        |_cx: &Cx, _, _| Gpt::with_qkv_bias(VOCAB, 16, 2, 2, false),
        |_| Ok(Box::new(LateNoise { rows: 2, drawn: 0, bad: 150 }) as Box<dyn Batches>),
    )
    .unwrap()
    .run()
    .unwrap();
    let lines = read_metrics(out.join("metrics.jsonl")).unwrap();
    let flagged: Vec<_> = lines.iter().filter(|m| m.events.iter().any(|e| matches!(e, Event::Anomaly { .. }))).collect();
    assert_eq!(flagged.len(), 1, "only the jump is flagged: {:?}", flagged.iter().map(|m| m.step).collect::<Vec<_>>());
    let spike = flagged[0];
    assert_eq!(spike.step, 151);
    // The flat stretch before it, and the size of the jump.
    let flat: Vec<f64> = lines[100..150].iter().map(|m| m.loss).collect();
    let level = flat.iter().sum::<f64>() / flat.len() as f64;
    let spread = flat.iter().fold(0.0f64, |a, &l| a.max((l - level).abs()));
    assert!(spread < 0.5 * level, "a flat stretch: {level:.2e} ± {spread:.1e}");
    assert!(spike.loss > 600.0 * level, "the jump is only {:.0}×", spike.loss / level);
    assert!(spike.skipped && spike.events.iter().any(|e| matches!(e, Event::Rollback { to_step: 150, .. })), "{:?}", spike.events);
    assert!(summary.losses.last().unwrap().1 < 10.0 * level, "the run goes on healthy");
    let _ = std::fs::remove_dir_all(&out);
}
