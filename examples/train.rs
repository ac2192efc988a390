//! The main job: train a small GPT on the bundled addition task on CPU ranks
//! with a hybrid mesh (data × tensor × pipeline parallelism), then prove it
//! learned: exact-match accuracy on held-out problems and a few samples.
//!
//! ```text
//! cargo run --release --example train                                   # defaults: examples/configs/arith.toml
//! cargo run --release --example train -- --dp 1 --tp 2 --pp 2 --steps 300
//! cargo run --release --example train -- --config my.toml --set optim.lr=1e-3 --set precision.compute=bf16
//! ```
//!
//! The run directory (`runs/arith` by default) receives `config.toml`,
//! `model.json`, `metrics.jsonl`, `trace.json` (open in ui.perfetto.dev),
//! `loss.png`, `eval.json` and `checkpoints/`. A second run with the same
//! directory resumes from its last checkpoint; `--fresh` starts over.
//!
//! `model.kind` chooses GPT-2, Llama or Mixtral and `model.from` starts from
//! a Hugging Face directory (`tessera_models::kinds` builds the model for
//! every rank); `tessera train` is the same run as a command, and
//! `tessera export --run runs/arith --out DIR` writes the result as a
//! Hugging Face directory.

use anyhow::{Context, Result};
use clap::Parser;
use std::path::{Path, PathBuf};
use std::time::Instant;
use tessera::data::{arith, AnswerTargets, Dataset, Sampler};
use tessera::module::Cx;
use tessera::serve::engine::{Engine, EngineConfig};
use tessera::serve::sampling::SamplingParams;
use tessera::train::{Batches, Job, RunLock, TrainConfig, Trainer};
use tessera::Device;
use tessera_models::kinds::{self, KindModel, ModelJob, ModelSpec};

/// Prints a line to stdout; when the reader has gone (`train | head`), the
/// program ends quietly and successfully (its checkpoints are atomic, and
/// the next run takes over the directory).
macro_rules! say {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        if writeln!(std::io::stdout(), $($t)*).is_err() {
            std::process::exit(0);
        }
    }};
}

/// The built-in configuration (also at examples/configs/arith.toml).
const DEFAULT_CONFIG: &str = include_str!("configs/arith.toml");

#[derive(Parser)]
#[command(about = "Train a small GPT on the bundled addition task with data, tensor and pipeline parallelism on CPU ranks")]
struct Args {
    /// A TOML configuration (see docs/training.md); the built-in one otherwise.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Override a setting: `--set section.key=value` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Run directory (run.out).
    #[arg(long)]
    out: Option<String>,
    /// Optimizer steps (run.steps).
    #[arg(long)]
    steps: Option<u64>,
    /// Data-parallel replicas (mesh.dp).
    #[arg(long)]
    dp: Option<usize>,
    /// Tensor-parallel degree (mesh.tp).
    #[arg(long)]
    tp: Option<usize>,
    /// Pipeline stages (mesh.pp).
    #[arg(long)]
    pp: Option<usize>,
    /// Held-out problems to evaluate at the end.
    #[arg(long, default_value_t = 500)]
    eval: usize,
    /// Start over: delete the run directory's checkpoints first.
    #[arg(long)]
    fresh: bool,
}

impl Args {
    /// Every override, flags last so they win over `--set`.
    fn overrides(&self) -> Vec<String> {
        let mut o = self.set.clone();
        let mut flag = |key: &str, v: Option<String>| {
            if let Some(v) = v {
                o.push(format!("{key}={v}"));
            }
        };
        flag("run.out", self.out.as_ref().map(|s| format!("{s:?}")));
        flag("run.steps", self.steps.map(|v| v.to_string()));
        flag("mesh.dp", self.dp.map(|v| v.to_string()));
        flag("mesh.tp", self.tp.map(|v| v.to_string()));
        flag("mesh.pp", self.pp.map(|v| v.to_string()));
        o
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    let text = match &args.config {
        Some(path) => std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?,
        None => DEFAULT_CONFIG.to_string(),
    };
    let overrides = args.overrides();
    let cfg = TrainConfig::parse(&text, &overrides.iter().map(String::as_str).collect::<Vec<_>>())?;
    let task = arith::Task::new(cfg.data.seed);
    // The vocabulary of the data decides the model's (unless the model comes from a Hugging Face directory).
    let data_vocab = match cfg.data.source.as_str() {
        "bundled" => task.tokenizer().vocab_size(),
        dir => Dataset::open(dir)?.index().vocab_size,
    };
    // `model.kind` (and `model.from`) choose the model: tessera-models builds it for every rank.
    kinds::with_configured_model(&cfg, data_vocab, Run { args: &args, cfg: &cfg, task })?
}

/// The training run, generic over the model kind the configuration names.
struct Run<'a> {
    args: &'a Args,
    cfg: &'a TrainConfig,
    task: arith::Task,
}

impl ModelJob for Run<'_> {
    type Output = Result<()>;

    fn run<M: KindModel>(self, spec: ModelSpec<M>) -> tessera_models::Result<Result<()>> {
        Ok(train(self.args, self.cfg, &self.task, spec))
    }
}

fn train<M: KindModel>(args: &Args, cfg: &TrainConfig, task: &arith::Task, spec: ModelSpec<M>) -> Result<()> {
    let out = PathBuf::from(&cfg.run.out);
    // Threads of this process, or this process's rank of a job started by `tessera launch` (or torchrun, srun, mpirun).
    let job = Job::for_config(cfg)?;
    let data_dir = match cfg.data.source.as_str() {
        "bundled" => out.join("data"),
        other => PathBuf::from(other),
    };
    // Once per run, on rank 0 while the other processes wait: the run directory and its lock (one job per directory,
    // from before the data is written), the bundled task's data, and what `tessera export` rebuilds the model from.
    let lock = job.primary_first("preparing the run directory", || -> Result<RunLock> {
        std::fs::create_dir_all(&out).with_context(|| format!("creating the run directory {}", out.display()))?;
        let lock = RunLock::acquire(&out)?;
        if cfg.data.source == "bundled" && Dataset::open(&data_dir).is_err() {
            task.write_shards(&data_dir, 1 << 22)?;
        }
        spec.write_record(&out)?;
        Ok(lock)
    })?;
    let data = Dataset::open(&data_dir)?;

    let trainer = Trainer::new(
        cfg.clone(),
        spec.facts(cfg.mesh.tp, cfg.batch.seq_len)?,
        // Each rank's model: its tensor-parallel shard, its experts, its weights when it starts from a pretrained one.
        |cx: &Cx, ep_rank, ep| spec.build(cx, ep_rank, ep),
        |replica| {
            let global = cfg.batch.micro_batch * replica.count;
            let sampler = Sampler::new(&data, global, cfg.batch.seq_len, replica.index, replica.count, cfg.data.seed)?;
            Ok(match cfg.data.source.as_str() {
                "bundled" => Box::new(AnswerTargets(sampler)) as Box<dyn Batches>,
                _ => Box::new(sampler),
            })
        },
    )?;
    let trainer = trainer.fresh(args.fresh).with_job(job.clone())?;
    let trainer = match lock {
        Some(lock) => trainer.with_run_lock(lock),
        None => trainer,
    };
    let summary = if job.is_primary() {
        for line in spec.banner(cfg, &job)? {
            say!("{line}");
        }
        if cfg.data.source == "bundled" {
            say!("task: three-digit addition, every number written least significant digit first (123 + 45 = 168 is \"321+540=8610\"); loss on the answers");
        }
        trainer.run()?
    } else {
        // Ranks other than 0 train, and leave the report and the evaluation to rank 0.
        trainer.run()?;
        return Ok(());
    };

    for line in summary.report_lines(cfg.run.steps) {
        say!("{line}");
    }
    if cfg.data.source != "bundled" {
        return Ok(());
    }

    // Evaluation on one rank, from the final checkpoint (resharded from the
    // training mesh), served by the inference engine: the trained model
    // struct itself, with a paged KV cache and continuous batching.
    let started = Instant::now();
    let cx = Cx::new(Device::cpu());
    let model = spec.load_checkpoint(&summary.checkpoint, &cx)?;
    let mut engine = Engine::new(model, cx, EngineConfig { max_num_seqs: 128, ..EngineConfig::new(cfg.batch.seq_len) })?;
    let greedy = SamplingParams { max_tokens: arith::ANSWER_LEN, ..SamplingParams::greedy() };
    let report = task.eval_batched(args.eval, 100, |prompts| engine.generate(prompts, &greedy))?;
    say!(
        "\nexact match on {} held-out problems: {:.1}% ({} right), evaluated in {:.1}s",
        report.total,
        100.0 * report.accuracy,
        report.correct,
        started.elapsed().as_secs_f64()
    );
    let digits: Vec<String> = report.digit_accuracy.iter().map(|a| format!("{:.0}%", 100.0 * a)).collect();
    say!("per answer digit (least significant first): {}", digits.join(" "));
    say!("samples (prompt -> answer, digits least significant first):");
    for s in &report.samples {
        say!("  {}{:<5} expected {:<5} {}", s.prompt, s.got, s.expected, if s.got == s.expected { "right" } else { "WRONG" });
    }
    let eval =
        serde_json::json!({ "held_out": report.total, "correct": report.correct, "exact_match": report.accuracy, "digit_accuracy": report.digit_accuracy });
    write(&out.join("eval.json"), &eval.to_string())?;
    say!("\nrun directory {}: config.toml, model.json, metrics.jsonl, trace.json, loss.png, eval.json, checkpoints/", out.display());
    Ok(())
}

fn write(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}
