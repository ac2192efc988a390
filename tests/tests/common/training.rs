//! A small training setup shared by the trainer's tests: a synthetic
//! counting task with resumable batches, a two-layer GPT, and helpers to
//! configure, run and read back runs.

use super::models::Gpt;
use std::path::Path;
use tessera::ckpt::serde_json;
use tessera::module::{self, Cx};
use tessera::observe::{read_metrics, Event, StepMetrics};
use tessera::prelude::*;
use tessera::testing::Scratch;
use tessera::train::{Batches, ModelFacts, Replica, RunSummary, TrainConfig, Trainer};

pub const VOCAB: usize = 16;
pub const SEQ: usize = 8;

pub fn scratch(name: &str) -> Scratch {
    Scratch::new(&format!("trainer-{name}"))
}

/// Sequence `n` of the synthetic task: counting from a start by a stride of
/// 1 to 3 (mod the vocabulary).
pub fn sequence(n: u64) -> (Vec<u32>, Vec<u32>) {
    let h = n.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 7;
    let (start, stride) = ((h % VOCAB as u64) as usize, 1 + (h / 31 % 3) as usize);
    let tok = |i: usize| ((start + i * stride) % VOCAB) as u32;
    ((0..SEQ).map(tok).collect(), (1..=SEQ).map(tok).collect())
}

/// Draw `k` of replica `r` holds sequences `(k · count + r) · b ..` of the global order.
pub struct Counting {
    pub replica: Replica,
    pub micro_batch: usize,
    pub drawn: u64,
    /// Draws whose targets are scrambled (bad data).
    pub poisoned: std::ops::Range<u64>,
}

impl Batches for Counting {
    fn next_batch(&mut self, device: &Device) -> tessera::Result<(Tensor, Tensor)> {
        let b = self.micro_batch as u64;
        let first = (self.drawn * self.replica.count as u64 + self.replica.index as u64) * b;
        let (mut xs, mut ys) = (Vec::new(), Vec::new());
        for n in first..first + b {
            let (x, y) = sequence(n);
            xs.extend(x);
            ys.extend(y);
        }
        if self.poisoned.contains(&self.drawn) {
            ys.iter_mut().enumerate().for_each(|(i, y)| *y = (*y + 5 + i as u32 * 7) % VOCAB as u32);
        }
        self.drawn += 1;
        Ok((Tensor::from_vec(xs, [self.micro_batch, SEQ], device)?, Tensor::from_vec(ys, [self.micro_batch, SEQ], device)?))
    }

    fn cursor(&self) -> serde_json::Value {
        serde_json::json!(self.drawn)
    }

    fn restore(&mut self, cursor: &serde_json::Value) -> tessera::Result<()> {
        self.drawn = cursor.as_u64().ok_or_else(|| tessera::Error::InvalidArgument { op: "Counting", detail: format!("bad cursor {cursor}") })?;
        Ok(())
    }
}

pub fn config(out: &Path, text: &str, overrides: &[&str]) -> TrainConfig {
    let out = format!("run.out={:?}", out.display().to_string());
    let mut all = vec![out.as_str(), "run.progress=false", "optim.lr=3e-3", "optim.warmup=2", "batch.seq_len=8"];
    all.extend_from_slice(overrides);
    TrainConfig::parse(text, &all).unwrap()
}

pub fn train(cfg: TrainConfig, poisoned: std::ops::Range<u64>) -> RunSummary {
    let micro_batch = cfg.batch.micro_batch;
    let facts = ModelFacts { vocab: VOCAB, flops_per_token: 1e5 };
    let trainer = Trainer::new(
        cfg,
        facts,
        |_cx: &Cx, _, _| Gpt::with_qkv_bias(VOCAB, 16, 2, 2, false),
        move |replica| Ok(Box::new(Counting { replica, micro_batch, drawn: 0, poisoned: poisoned.clone() }) as Box<dyn Batches>),
    )
    .unwrap();
    trainer.run().unwrap()
}

/// The final parameters of a run, read back from its final checkpoint on
/// one rank (resharded from the run's mesh).
pub fn final_params(summary: &RunSummary) -> Vec<(String, Vec<f32>)> {
    let cx = Cx::new(Device::cpu());
    let model = module::build(Gpt::with_qkv_bias(VOCAB, 16, 2, 2, false).unwrap(), &cx).unwrap();
    tessera::ckpt::Checkpointer::new(summary.checkpoint.parent().unwrap(), 10).unwrap().load(&summary.checkpoint, &model, None, &cx).unwrap();
    module::distinct_params(&model).unwrap().into_iter().map(|n| (n.names[0].clone(), n.param.value().unwrap().to_vec::<f32>().unwrap())).collect()
}

pub fn try_train(cfg: TrainConfig, fresh: bool) -> tessera::Result<RunSummary> {
    let micro_batch = cfg.batch.micro_batch;
    let facts = ModelFacts { vocab: VOCAB, flops_per_token: 1e5 };
    Trainer::new(
        cfg,
        facts,
        |_cx: &Cx, _, _| Gpt::with_qkv_bias(VOCAB, 16, 2, 2, false),
        move |replica| Ok(Box::new(Counting { replica, micro_batch, drawn: 0, poisoned: 0..0 }) as Box<dyn Batches>),
    )?
    .fresh(fresh)
    .run()
}

/// A metrics line's step, the bits of its loss, gradient norm and learning
/// rate, whether it was skipped, and its anomaly events.
pub type Line = (u64, u64, Option<u64>, u64, bool, Vec<Event>);

/// What must match between runs: each metrics line's numbers and the
/// anomalies and rollbacks on it (not times, nor checkpoint and resume
/// bookkeeping).
pub fn trajectory(out: &Path) -> Vec<Line> {
    let keep = |e: &Event| matches!(e, Event::Anomaly { .. } | Event::Rollback { .. } | Event::Overflow { .. });
    read_metrics(out.join("metrics.jsonl"))
        .unwrap()
        .iter()
        .map(|m: &StepMetrics| {
            (m.step, m.loss.to_bits(), m.grad_norm.map(f64::to_bits), m.lr.to_bits(), m.skipped, m.events.iter().filter(|e| keep(e)).cloned().collect())
        })
        .collect()
}
