//! `tessera export`: a training run's checkpoint written back as a Hugging
//! Face model directory (`config.json` + `model.safetensors`).

use anyhow::{bail, Context};
use std::path::{Path, PathBuf};
use tessera::ckpt::{self, Checkpointer};
use tessera::module::Cx;
use tessera::train::TrainConfig;
use tessera::Device;
use tessera_models::hf;
use tessera_models::kinds::{self, KindModel, ModelJob, ModelSpec, RECORD_FILE};

/// Arguments of `tessera export`.
#[derive(clap::Args)]
#[command(group = clap::ArgGroup::new("source").args(["run", "checkpoint"]).required(true).multiple(true))]
pub struct Args {
    /// The run directory `tessera train` wrote (its `model.json` says which
    /// model it trained); its newest intact checkpoint is exported unless
    /// `--checkpoint` names another.
    #[arg(long, value_name = "DIR")]
    run: Option<PathBuf>,
    /// The checkpoint to export (`<run>/checkpoints/step-<N>`, or a
    /// checkpoint root: its newest intact checkpoint). Without `--run`, the
    /// run is the directory above it that holds `model.json`.
    #[arg(long, value_name = "DIR")]
    checkpoint: Option<PathBuf>,
    /// The Hugging Face directory to write (`config.json`, `model.safetensors`,
    /// and the pretrained model's tokenizer files when the run started from one).
    #[arg(long, value_name = "HF_DIR")]
    out: PathBuf,
}

/// Files of a Hugging Face model directory that are not weights and that a
/// fine-tuned model keeps: its tokenizer and generation defaults.
const KEPT_FILES: &[&str] =
    &["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json"];

pub fn run(args: Args) -> anyhow::Result<()> {
    let checkpoint = match (&args.checkpoint, &args.run) {
        (Some(dir), _) => resolve(dir)?,
        (None, Some(run)) => resolve(&checkpoint_root(run)?)?,
        (None, None) => unreachable!("clap requires --run or --checkpoint"),
    };
    let run = match &args.run {
        Some(run) => run.clone(),
        None => run_of(&checkpoint)?,
    };
    let record_path = run.join(RECORD_FILE);
    let text = std::fs::read_to_string(&record_path).map_err(|e| {
        anyhow::anyhow!(
            "cannot read `{}`: {e}; `tessera train` records the model of a run there: pass --run with the directory it trained in",
            record_path.display()
        )
    })?;
    let record: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("`{}` is not valid JSON", record_path.display()))?;
    kinds::with_recorded_model(&record, Export { checkpoint: &checkpoint, out: &args.out })
        .with_context(|| format!("the model recorded in `{}`", record_path.display()))?
}

/// `dir` itself when it holds a checkpoint, else the newest intact checkpoint under it.
fn resolve(dir: &Path) -> anyhow::Result<PathBuf> {
    if dir.join(ckpt::MANIFEST).exists() {
        return Ok(dir.to_path_buf());
    }
    let root = Checkpointer::open(dir, usize::MAX).with_context(|| format!("`{}` is neither a checkpoint nor a checkpoint root", dir.display()))?;
    match root.latest_valid()? {
        Some(dir) => Ok(dir),
        None => bail!("`{}` holds no intact checkpoint to export (`tessera ckpt inspect` says what is wrong with the ones there)", dir.display()),
    }
}

/// The checkpoint root of run directory `run`, as its `config.toml` sets it.
fn checkpoint_root(run: &Path) -> anyhow::Result<PathBuf> {
    let path = run.join("config.toml");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| anyhow::anyhow!("cannot read `{}`: {e}; --run takes the directory a training run wrote (run.out)", path.display()))?;
    let cfg = TrainConfig::parse(&text, &[]).with_context(|| format!("in `{}`", path.display()))?;
    let dir = Path::new(&cfg.checkpoint.dir);
    Ok(if dir.is_absolute() { dir.to_path_buf() } else { run.join(dir) })
}

/// The run directory a checkpoint belongs to: the nearest directory above it holding `model.json`.
fn run_of(checkpoint: &Path) -> anyhow::Result<PathBuf> {
    let absolute = std::path::absolute(checkpoint).with_context(|| format!("resolving `{}`", checkpoint.display()))?;
    match absolute.ancestors().skip(1).find(|d| d.join(RECORD_FILE).is_file()) {
        Some(run) => Ok(run.to_path_buf()),
        None => bail!(
            "no directory above `{}` holds `{RECORD_FILE}`, the record of the model a run trained; pass --run with the run directory",
            checkpoint.display()
        ),
    }
}

/// The export, generic over the model kind.
struct Export<'a> {
    checkpoint: &'a Path,
    out: &'a Path,
}

impl ModelJob for Export<'_> {
    type Output = anyhow::Result<()>;

    fn run<M: KindModel>(self, spec: ModelSpec<M>) -> tessera_models::Result<anyhow::Result<()>> {
        Ok(self.export(spec))
    }
}

impl Export<'_> {
    fn export<M: KindModel>(self, spec: ModelSpec<M>) -> anyhow::Result<()> {
        let manifest = ckpt::read_manifest(self.checkpoint)?;
        // One rank holds every parameter whole: what a Hugging Face file stores.
        let cx = Cx::new(Device::cpu());
        let model = spec.load_checkpoint(self.checkpoint, &cx).with_context(|| format!("loading the checkpoint `{}`", self.checkpoint.display()))?;
        hf::save_pretrained(&model, spec.config(), self.out).with_context(|| format!("writing `{}`", self.out.display()))?;
        let mut kept = Vec::new();
        if let Some(from) = spec.pretrained().filter(|d| d.is_dir()) {
            for name in KEPT_FILES {
                let src = from.join(name);
                if src.is_file() {
                    std::fs::copy(&src, self.out.join(name)).with_context(|| format!("copying {} into {}", src.display(), self.out.display()))?;
                    kept.push(*name);
                }
            }
        }
        let (params, _) = spec.param_counts()?;
        say!(
            "exported the {} of step {} (trained on {}; {params} parameters) to {}: config.json, model.safetensors{}",
            spec.kind(),
            manifest.step,
            manifest.mesh,
            self.out.display(),
            kept.iter().map(|k| format!(", {k}")).collect::<String>()
        );
        Ok(())
    }
}
