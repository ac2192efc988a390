//! The model a serving command runs (`tessera generate`, `tessera
//! perplexity`): a Hugging Face directory (`config.json`, `*.safetensors`,
//! `tokenizer.json`) or a training run `tessera train` wrote (its newest
//! intact checkpoint; the tokenizer of the pretrained model it started
//! from, if any), loaded on the CPU, its linear layers' weights optionally
//! quantized.

use anyhow::{bail, Context};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tessera::ckpt::{self, Checkpointer};
use tessera::module::{Cx, Module, Replicated, SplitHidden};
use tessera::nn::quantize_linears;
use tessera::ops::QuantFormat;
use tessera::serve::prompt::{ModelTokenizer, TOKENIZER_FILE};
use tessera::Device;
use tessera_models::hf;
use tessera_models::kinds::{self, KindModel, ModelJob, ModelKind, ModelSpec, RECORD_FILE};

/// What a command does with the loaded model, whichever architecture it is.
pub trait UseModel {
    type Output;
    /// Runs with the model, its context (on a CPU device), its tokenizer if
    /// it has one, and its context length in tokens.
    fn run<M: Module<In = Replicated, Out = SplitHidden> + 'static>(
        self,
        model: M,
        cx: Cx,
        tokenizer: Option<ModelTokenizer>,
        context: usize,
    ) -> anyhow::Result<Self::Output>;
}

/// What a command does with a model it loads itself, once per rank of a
/// tensor-parallel group, whichever architecture it is.
pub trait UseLoader {
    type Output;
    /// Runs with the way to load the model.
    fn run<M: Module<In = Replicated, Out = SplitHidden> + 'static>(self, loader: Loader<M>) -> anyhow::Result<Self::Output>;
}

/// Loads a model's shard for the rank of a context.
type LoadOn<M> = Arc<dyn Fn(&Cx) -> anyhow::Result<M> + Send + Sync>;

/// How to load a model on a rank: each rank calls [`load`](Self::load)
/// with its own context, and gets its shard (collectively: every rank of
/// the group loads at once).
pub struct Loader<M> {
    load: LoadOn<M>,
    quantize: Option<QuantFormat>,
    /// The model's tokenizer, if it has one.
    pub tokenizer: Option<ModelTokenizer>,
    /// Its context length in tokens.
    pub context: usize,
}

impl<M: Module> Loader<M> {
    /// The model's shard for the rank of `cx`, its linear layers' weights
    /// quantized if asked (rank 0 says how, on stderr).
    pub fn load(&self, cx: &Cx) -> anyhow::Result<M> {
        let model = (self.load)(cx)?;
        if let Some(format) = self.quantize {
            let r = quantize_linears(&model, cx, format).with_context(|| format!("quantizing the model's linear layers to {format}"))?;
            if cx.tp().rank() == 0 {
                let mib = |b: usize| b as f64 / (1 << 20) as f64;
                let ranks = cx.tp().size();
                eprintln!(
                    "quantized {} linear weights to {format}: {:.1} MiB -> {:.1} MiB{}{}",
                    r.quantized.len(),
                    mib(r.bytes_before),
                    mib(r.bytes_after),
                    if ranks > 1 { format!(" on each of {ranks} ranks") } else { String::new() },
                    if r.skipped.is_empty() {
                        String::new()
                    } else {
                        format!(
                            " ({} kept as they were: {})",
                            r.skipped.len(),
                            r.skipped.iter().map(|(n, why)| format!("{n}, {why}")).collect::<Vec<_>>().join("; ")
                        )
                    }
                );
            }
        }
        Ok(model)
    }
}

/// Loads the model in `dir` on one CPU rank, quantizes its linear layers'
/// weights when `quantize` says so (a summary goes to stderr), and hands
/// it to `user`.
pub fn with_model<U: UseModel>(dir: &Path, quantize: Option<QuantFormat>, user: U) -> anyhow::Result<U::Output> {
    with_loader(dir, quantize, OneRank(user))
}

/// A [`UseModel`] as a [`UseLoader`]: the model loaded on one CPU rank.
struct OneRank<U>(U);

impl<U: UseModel> UseLoader for OneRank<U> {
    type Output = U::Output;

    fn run<M: Module<In = Replicated, Out = SplitHidden> + 'static>(self, loader: Loader<M>) -> anyhow::Result<U::Output> {
        let cx = Cx::new(Device::cpu());
        let model = loader.load(&cx)?;
        self.0.run(model, cx, loader.tokenizer, loader.context)
    }
}

/// Reads what the model in `dir` is (and checks its files are there) and
/// hands `user` the way to load it, its weights quantized when `quantize`
/// says so.
pub fn with_loader<U: UseLoader>(dir: &Path, quantize: Option<QuantFormat>, user: U) -> anyhow::Result<U::Output> {
    if !dir.is_dir() {
        bail!("`{}` is not a directory; --model takes a Hugging Face model directory or a training run's directory", dir.display());
    }
    if dir.join(RECORD_FILE).is_file() {
        return from_run(dir, quantize, user);
    }
    let config = dir.join("config.json");
    if !config.is_file() {
        bail!(
            "`{}` has neither config.json (a Hugging Face model) nor {RECORD_FILE} (a run `tessera train` wrote); point --model at one of them",
            dir.display()
        );
    }
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&config).with_context(|| format!("reading `{}`", config.display()))?)
        .with_context(|| format!("`{}` is not valid JSON", config.display()))?;
    let kind = json.get("model_type").and_then(|t| t.as_str()).with_context(|| format!("`{}` names no model_type", config.display()))?;
    let kind = ModelKind::parse(kind, "model_type").with_context(|| format!("the model in `{}`", dir.display()))?;
    let tokenizer = tokenizer_of(Some(dir))?;
    fn from_hf<M: hf::HfModel + Module<In = Replicated, Out = SplitHidden> + 'static>(
        dir: &Path,
        quantize: Option<QuantFormat>,
        tokenizer: Option<ModelTokenizer>,
        context: usize,
    ) -> Loader<M> {
        let dir = dir.to_path_buf();
        Loader { load: Arc::new(move |cx: &Cx| Ok(hf::load_pretrained::<M>(&dir, cx)?.model)), quantize, tokenizer, context }
    }
    match kind {
        ModelKind::Gpt2 => user.run(from_hf::<tessera_models::gpt2::Gpt2>(dir, quantize, tokenizer, positions(&json, "n_positions"))),
        ModelKind::Llama => user.run(from_hf::<tessera_models::llama::Llama>(dir, quantize, tokenizer, positions(&json, "max_position_embeddings"))),
        ModelKind::Mixtral => user.run(from_hf::<tessera_models::mixtral::Mixtral>(dir, quantize, tokenizer, positions(&json, "max_position_embeddings"))),
        ModelKind::MoeGpt2 => user.run(from_hf::<tessera_models::gpt2::MoeGpt2>(dir, quantize, tokenizer, positions(&json, "n_positions"))),
    }
}

/// The context length a config gives (2048 when it gives none).
fn positions(json: &serde_json::Value, key: &str) -> usize {
    json.get(key).and_then(|v| v.as_u64()).map_or(2048, |v| v as usize)
}

/// The tokenizer of `dir` if it has one.
fn tokenizer_of(dir: Option<&Path>) -> anyhow::Result<Option<ModelTokenizer>> {
    match dir {
        Some(d) if d.join(TOKENIZER_FILE).is_file() => Ok(Some(ModelTokenizer::from_dir(d)?)),
        _ => Ok(None),
    }
}

/// A training run: its recorded model, loaded from the newest intact checkpoint.
fn from_run<U: UseLoader>(dir: &Path, quantize: Option<QuantFormat>, user: U) -> anyhow::Result<U::Output> {
    let record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join(RECORD_FILE))?).with_context(|| format!("`{}` is not valid JSON", dir.join(RECORD_FILE).display()))?;
    let root = dir.join("checkpoints");
    let checkpoint = Checkpointer::open(&root, usize::MAX)
        .with_context(|| format!("`{}` holds no checkpoints", root.display()))?
        .latest_valid()?
        .with_context(|| format!("`{}` holds no intact checkpoint (`tessera ckpt inspect` says what is wrong with the ones there)", root.display()))?;
    if !checkpoint.join(ckpt::MANIFEST).exists() {
        bail!("`{}` is not a checkpoint", checkpoint.display());
    }
    kinds::with_recorded_model(&record, FromRun { user, checkpoint, quantize })?
}

struct FromRun<U> {
    user: U,
    checkpoint: PathBuf,
    quantize: Option<QuantFormat>,
}

impl<U: UseLoader> ModelJob for FromRun<U> {
    type Output = anyhow::Result<U::Output>;

    fn run<M: KindModel>(self, spec: ModelSpec<M>) -> tessera_models::Result<anyhow::Result<U::Output>> {
        let go = || -> anyhow::Result<U::Output> {
            let tokenizer = tokenizer_of(spec.pretrained())?;
            let context = positions(&spec.record()["config"], M::POSITIONS);
            let checkpoint = self.checkpoint;
            let load = move |cx: &Cx| spec.load_checkpoint(&checkpoint, cx).with_context(|| format!("loading `{}`", checkpoint.display()));
            self.user.run(Loader { load: Arc::new(load), quantize: self.quantize, tokenizer, context })
        };
        Ok(go())
    }
}
