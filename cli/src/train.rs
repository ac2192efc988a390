//! `tessera train`: run a training configuration: any model kind the
//! models crate knows, from scratch or from a Hugging Face directory, on the
//! bundled task or on prepared shards, on any mesh of CPU ranks (or GPUs).

use anyhow::{bail, Context};
use std::path::{Path, PathBuf};
use std::time::Instant;
use tessera::data::{arith, AnswerTargets, Dataset, Sampler};
use tessera::module::Cx;
use tessera::train::{Batches, Job as RunJob, RunLock, RunSummary, TrainConfig, Trainer};
use tessera::Device;
use tessera_models::kinds::{self, KindModel, ModelJob, ModelSpec};

/// Arguments of `tessera train`.
#[derive(clap::Args)]
pub struct Args {
    /// The training configuration, a TOML file (every key is described in
    /// docs/training.md; examples/configs/arith.toml is the main job).
    #[arg(long, value_name = "FILE")]
    config: PathBuf,
    /// Override a setting: `--set section.key=value` (repeatable; e.g.
    /// `--set mesh.tp=2`, `--set model.from=path/to/hf-model`).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// The run directory (`run.out`); a run finding checkpoints there resumes from the newest.
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Start over: delete the run directory's checkpoints first.
    #[arg(long)]
    fresh: bool,
    /// On the bundled task: how many held-out problems the final checkpoint
    /// answers at the end (0: no evaluation).
    #[arg(long, value_name = "N", default_value_t = 500)]
    eval: usize,
}

/// Where the data comes from.
enum Data {
    /// The bundled addition task, written into the run directory.
    Bundled(arith::Task),
    /// Shards `tessera prepare` wrote.
    Shards(PathBuf),
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(&args.config).map_err(|e| {
        anyhow::anyhow!(
            "cannot read the configuration `{}`: {e}; give the path of a TOML training configuration (examples/configs/arith.toml is one; docs/training.md lists every key)",
            args.config.display()
        )
    })?;
    let mut overrides = args.set.clone();
    if let Some(out) = &args.out {
        // A TOML basic string: JSON's quoting (\", \\, \uXXXX) is valid TOML.
        overrides.push(format!("run.out={}", serde_json::Value::from(out.display().to_string())));
    }
    let refs: Vec<&str> = overrides.iter().map(String::as_str).collect();
    let cfg = TrainConfig::parse(&text, &refs).with_context(|| format!("in the configuration `{}`", args.config.display()))?;

    // Everything that can be refused is refused before the run directory is made.
    let data = match cfg.data.source.as_str() {
        "bundled" => Data::Bundled(arith::Task::new(cfg.data.seed)),
        dir => Data::Shards(PathBuf::from(dir)),
    };
    if let Data::Bundled(task) = &data {
        let held = task.held_out_problems().len();
        if args.eval > held {
            bail!("--eval {}: the bundled task holds out {held} problems; ask for at most {held} (0 skips the evaluation)", args.eval);
        }
    }
    let (dataset, data_vocab) = match &data {
        Data::Bundled(task) => (None, task.tokenizer().vocab_size()),
        Data::Shards(dir) => {
            let d = Dataset::open(dir).with_context(|| format!("opening the training data (data.source = {:?})", cfg.data.source))?;
            let vocab = d.index().vocab_size;
            (Some(d), vocab)
        }
    };
    kinds::with_configured_model(&cfg, data_vocab, Job { args: &args, cfg: &cfg, data, dataset })?
}

/// The training run, generic over the model kind.
struct Job<'a> {
    args: &'a Args,
    cfg: &'a TrainConfig,
    data: Data,
    dataset: Option<Dataset>,
}

impl ModelJob for Job<'_> {
    type Output = anyhow::Result<()>;

    fn run<M: KindModel>(self, spec: ModelSpec<M>) -> tessera_models::Result<anyhow::Result<()>> {
        Ok(self.train(spec))
    }
}

impl Job<'_> {
    fn train<M: KindModel>(self, spec: ModelSpec<M>) -> anyhow::Result<()> {
        let cfg = self.cfg;
        let out = PathBuf::from(&cfg.run.out);
        // Threads of this process, or this process's rank of a launched job.
        let job = RunJob::for_config(cfg)?;
        // Once per run (on rank 0 while the other processes wait): the run
        // directory, its lock (one job per directory, from before anything
        // is written there), the bundled data, the model record.
        let lock = job.primary_first("preparing the run directory", || -> anyhow::Result<RunLock> {
            std::fs::create_dir_all(&out).with_context(|| format!("creating the run directory {}", out.display()))?;
            let lock = RunLock::acquire(&out)?;
            if let Data::Bundled(task) = &self.data {
                let dir = out.join("data");
                if Dataset::open(&dir).is_err() {
                    task.write_shards(&dir, 1 << 22).context("writing the bundled task's data")?;
                }
            }
            spec.write_record(&out)?;
            Ok(lock)
        })?;
        let dataset = match (&self.data, self.dataset) {
            (Data::Bundled(_), _) => Dataset::open(out.join("data"))?,
            (Data::Shards(_), Some(d)) => d,
            (Data::Shards(dir), None) => Dataset::open(dir)?,
        };

        let facts = spec.facts(cfg.mesh.tp, cfg.batch.seq_len)?;
        let bundled = matches!(self.data, Data::Bundled(_));
        let trainer = Trainer::new(
            cfg.clone(),
            facts,
            |cx: &Cx, ep_rank, ep| spec.build(cx, ep_rank, ep),
            |replica| {
                let global = cfg.batch.micro_batch * replica.count;
                let sampler = Sampler::new(&dataset, global, cfg.batch.seq_len, replica.index, replica.count, cfg.data.seed)?;
                Ok(if bundled { Box::new(AnswerTargets(sampler)) as Box<dyn Batches> } else { Box::new(sampler) })
            },
        )?
        .fresh(self.args.fresh)
        .with_job(job.clone())?;
        let trainer = match lock {
            Some(lock) => trainer.with_run_lock(lock),
            None => trainer,
        };

        if job.is_primary() {
            for line in spec.banner(cfg, &job)? {
                say!("{line}");
            }
            if bundled {
                say!(
                    "task: three-digit addition, every number written least significant digit first (123 + 45 = 168 is \"321+540=8610\"); loss on the answers"
                );
            }
        }
        let summary = trainer.run()?;
        if !summary.primary {
            // The report, the evaluation and the listing are rank 0's.
            return Ok(());
        }
        report(&summary, cfg);
        if let (Data::Bundled(task), true) = (&self.data, self.args.eval > 0) {
            evaluate(&spec, task, &summary, self.args.eval, &out)?;
        }
        let written: Vec<&str> = ["config.toml", kinds::RECORD_FILE, "metrics.jsonl", "trace.json", "loss.png", "eval.json", "checkpoints/"]
            .into_iter()
            .filter(|f| out.join(f).exists() || (*f == "checkpoints/" && trainer_checkpoints_exist(cfg, &out)))
            .collect();
        say!("run directory {}: {}", out.display(), written.join(", "));
        Ok(())
    }
}

/// Whether the run keeps checkpoints (in `checkpoint.dir`, which may lie outside the run directory).
fn trainer_checkpoints_exist(cfg: &TrainConfig, out: &Path) -> bool {
    let dir = Path::new(&cfg.checkpoint.dir);
    if dir.is_absolute() {
        dir.is_dir()
    } else {
        out.join(dir).is_dir()
    }
}

/// The loss, resumption and the events worth a line.
fn report(summary: &RunSummary, cfg: &TrainConfig) {
    for line in summary.report_lines(cfg.run.steps) {
        say!("{line}");
    }
}

/// Exact match of the final checkpoint on held-out problems of the bundled
/// task, on one rank (the checkpoint resharded from the training mesh);
/// writes `eval.json`.
fn evaluate<M: KindModel>(spec: &ModelSpec<M>, task: &arith::Task, summary: &RunSummary, n: usize, out: &Path) -> anyhow::Result<()> {
    let started = Instant::now();
    let mut cx = Cx::new(Device::cpu());
    cx.set_training(false);
    let model = spec.load_checkpoint(&summary.checkpoint, &cx).with_context(|| format!("loading {} for evaluation", summary.checkpoint.display()))?;
    let report = task.eval_batched(n, 100, |prompts| tessera_models::generate::greedy(&model, &mut cx, prompts, arith::ANSWER_LEN))?;
    say!(
        "exact match on {} held-out problems: {:.1}% ({} right), evaluated in {:.1}s",
        report.total,
        100.0 * report.accuracy,
        report.correct,
        started.elapsed().as_secs_f64()
    );
    let digits: Vec<String> = report.digit_accuracy.iter().map(|a| format!("{:.0}%", 100.0 * a)).collect();
    say!("per answer digit (least significant first): {}", digits.join(" "));
    let eval =
        serde_json::json!({ "held_out": report.total, "correct": report.correct, "exact_match": report.accuracy, "digit_accuracy": report.digit_accuracy });
    let path = out.join("eval.json");
    std::fs::write(&path, eval.to_string()).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}
