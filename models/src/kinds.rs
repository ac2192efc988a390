//! Models chosen by name: a training configuration's `[model]` table to
//! the model a [`Trainer`](tessera::train::Trainer) builds on each rank.
//!
//! `model.kind` names one of the [`ModelKind`]s (`gpt2` when absent). The
//! model is then either described by the table itself, whose other keys are
//! the fields of that model's Hugging Face `config.json`, or, with
//! `model.from = "DIR"`, read from a Hugging Face model directory: its
//! `config.json` gives the architecture (the table may repeat a field only
//! with the same value) and its weights are the starting point, read on each
//! rank for the shard that rank holds, whatever the mesh.
//!
//! The kinds are different Rust types, so a program's training code is
//! generic over the model and receives it through a [`ModelJob`]:
//!
//! ```
//! use tessera::train::TrainConfig;
//! use tessera_models::kinds::{self, KindModel, ModelJob, ModelSpec};
//!
//! struct Describe;
//! impl ModelJob for Describe {
//!     type Output = String;
//!     fn run<M: KindModel>(self, spec: ModelSpec<M>) -> tessera_models::Result<String> {
//!         let (layers, width) = M::depth_and_width(spec.config());
//!         Ok(format!("{} with {layers} layers of width {width}", spec.kind()))
//!     }
//! }
//!
//! let cfg = TrainConfig::parse("[model]\nkind = \"llama\"\nhidden_size = 64\nnum_hidden_layers = 2\nnum_attention_heads = 4\nintermediate_size = 128", &[])?;
//! let text = kinds::with_configured_model(&cfg, 16, Describe)?;
//! assert_eq!(text, "llama with 2 layers of width 64");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use crate::error::{Error, Result};
use crate::gpt2::{Gpt2, Gpt2Config, MoeGpt2, MoeGpt2Config, MOE_GPT2_MODEL_TYPE};
use crate::hf::{self, HfConfig, HfModel};
use crate::llama::{Llama, LlamaConfig};
use crate::mixtral::{Mixtral, MixtralConfig};
use crate::vocab::padded_vocab;
use serde_json::Value;
use std::fmt;
use std::path::{Path, PathBuf};
use tessera::ckpt::{self, Checkpointer};
use tessera::module::{self, CostSettings, Cx, ModelCost, Replicated, SplitHidden, Staged};
use tessera::observe::transformer_flops_per_token;
use tessera::train::{Job, ModelFacts, RankDevice, TrainConfig};

/// The file in a run directory that records the model the run trains
/// ([`ModelSpec::write_record`]), from which a checkpoint of the run is
/// rebuilt (evaluation, `tessera export`).
pub const RECORD_FILE: &str = "model.json";

/// The model kinds a training configuration can name (`model.kind`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ModelKind {
    /// GPT-2 ([`Gpt2`]).
    Gpt2,
    /// Llama ([`Llama`]).
    Llama,
    /// Mixtral ([`Mixtral`]): Llama with a mixture of experts in every block.
    Mixtral,
    /// GPT-2 with a mixture of experts in every block ([`MoeGpt2`]).
    MoeGpt2,
}

impl ModelKind {
    /// Every kind, in the order messages list them.
    pub const ALL: [ModelKind; 4] = [ModelKind::Gpt2, ModelKind::Llama, ModelKind::Mixtral, ModelKind::MoeGpt2];

    /// The name `model.kind` gives it (also its Hugging Face `model_type`).
    pub fn name(self) -> &'static str {
        match self {
            ModelKind::Gpt2 => "gpt2",
            ModelKind::Llama => "llama",
            ModelKind::Mixtral => "mixtral",
            ModelKind::MoeGpt2 => MOE_GPT2_MODEL_TYPE,
        }
    }

    /// Whether its blocks hold experts that `mesh.ep` can split over ranks.
    pub fn has_experts(self) -> bool {
        matches!(self, ModelKind::Mixtral | ModelKind::MoeGpt2)
    }

    /// The kind named `name`; an error (for the setting `key`) lists the
    /// kinds there are and the closest one.
    pub fn parse(name: &str, key: &str) -> Result<ModelKind> {
        if let Some(kind) = ModelKind::ALL.into_iter().find(|k| k.name() == name) {
            return Ok(kind);
        }
        let names: Vec<&str> = ModelKind::ALL.iter().map(|k| k.name()).collect();
        let hint = tessera::train::closest(name, &names).map(|c| format!("did you mean \"{c}\"? ")).unwrap_or_default();
        Err(setting(key, format!("unknown model kind {name:?}; {hint}the kinds are {}", choices())))
    }
}

impl fmt::Display for ModelKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// `"gpt2", "llama" or "mixtral"`, for messages.
fn choices() -> String {
    let names: Vec<String> = ModelKind::ALL.iter().map(|k| format!("\"{}\"", k.name())).collect();
    let (last, rest) = names.split_last().expect("there are kinds");
    format!("{} or {last}", rest.join(", "))
}

/// An error in the training configuration's setting `key`.
fn setting(key: &str, detail: impl Into<String>) -> Error {
    Error::Tessera(tessera::Error::config(key, detail))
}

/// A model a training configuration can name: a [`HfModel`] the trainer can
/// run (token ids in, vocabulary-parallel logits out, split over pipeline
/// stages), built for a rank of any mesh.
pub trait KindModel: HfModel<Config: Send + Sync> + Staged<In = Replicated, Out = SplitHidden> + 'static {
    /// Its kind.
    const KIND: ModelKind;
    /// The `config.json` field of the longest sequence it takes.
    const POSITIONS: &'static str;
    /// The parameter holding the token embedding (its rows are the vocabulary).
    const EMBEDDING: &'static str;
    /// Its Hugging Face class (`architectures` in `config.json`).
    const ARCHITECTURE: &'static str;

    /// The model `config` describes for a rank of a tensor-parallel group of
    /// `tp` ranks (the vocabulary padded when `tp` does not divide it) that
    /// holds the experts of rank `ep_rank` of an expert-parallel group of
    /// `ep_degree`; not yet materialised. A model without experts refuses
    /// an expert-parallel degree above one.
    fn for_rank(config: &Self::Config, tp: usize, ep_rank: usize, ep_degree: usize) -> Result<Self>;

    /// Tokens in the vocabulary (`vocab_size`).
    fn vocab_size(config: &Self::Config) -> usize;

    /// The longest sequence the model takes.
    fn positions(config: &Self::Config) -> usize;

    /// Blocks and the width of the residual stream.
    fn depth_and_width(config: &Self::Config) -> (usize, usize);

    /// Experts per layer and experts per token, for a model with experts.
    fn experts(config: &Self::Config) -> Option<(usize, usize)> {
        let _ = config;
        None
    }
}

/// Refuses an expert-parallel degree above one for a model without experts.
fn dense(kind: ModelKind, ep_degree: usize) -> Result<()> {
    if ep_degree > 1 {
        return Err(setting(
            "mesh.ep",
            format!(
                "mesh.ep = {ep_degree} splits a model's experts over ranks, and a {kind} has no experts; train a kind with experts (model.kind = \"mixtral\" or \"gpt2_moe\"), or set mesh.ep = 1 and raise mesh.dp for more data replicas"
            ),
        ));
    }
    Ok(())
}

impl KindModel for Gpt2 {
    const KIND: ModelKind = ModelKind::Gpt2;
    const POSITIONS: &'static str = "n_positions";
    const EMBEDDING: &'static str = "wte.weight";
    const ARCHITECTURE: &'static str = "GPT2LMHeadModel";

    fn for_rank(config: &Gpt2Config, tp: usize, _ep_rank: usize, ep_degree: usize) -> Result<Gpt2> {
        dense(Self::KIND, ep_degree)?;
        Gpt2::new(config)?.with_vocab_padded_to(padded_vocab(config.vocab_size, tp))
    }

    fn vocab_size(config: &Gpt2Config) -> usize {
        config.vocab_size
    }

    fn positions(config: &Gpt2Config) -> usize {
        config.n_positions
    }

    fn depth_and_width(config: &Gpt2Config) -> (usize, usize) {
        (config.n_layer, config.n_embd)
    }
}

impl KindModel for Llama {
    const KIND: ModelKind = ModelKind::Llama;
    const POSITIONS: &'static str = "max_position_embeddings";
    const EMBEDDING: &'static str = "embed_tokens.weight";
    const ARCHITECTURE: &'static str = "LlamaForCausalLM";

    fn for_rank(config: &LlamaConfig, tp: usize, _ep_rank: usize, ep_degree: usize) -> Result<Llama> {
        dense(Self::KIND, ep_degree)?;
        Llama::new(config)?.with_vocab_padded_to(padded_vocab(config.vocab_size, tp))
    }

    fn vocab_size(config: &LlamaConfig) -> usize {
        config.vocab_size
    }

    fn positions(config: &LlamaConfig) -> usize {
        config.max_position_embeddings
    }

    fn depth_and_width(config: &LlamaConfig) -> (usize, usize) {
        (config.num_hidden_layers, config.hidden_size)
    }
}

impl KindModel for Mixtral {
    const KIND: ModelKind = ModelKind::Mixtral;
    const POSITIONS: &'static str = "max_position_embeddings";
    const EMBEDDING: &'static str = "embed_tokens.weight";
    const ARCHITECTURE: &'static str = "MixtralForCausalLM";

    fn for_rank(config: &MixtralConfig, tp: usize, ep_rank: usize, ep_degree: usize) -> Result<Mixtral> {
        if ep_degree == 0 || !config.num_local_experts.is_multiple_of(ep_degree) {
            return Err(indivisible_experts(config.num_local_experts, ep_degree));
        }
        Mixtral::with_expert_parallel(config, ep_rank, ep_degree)?.with_vocab_padded_to(padded_vocab(config.vocab_size, tp))
    }

    fn vocab_size(config: &MixtralConfig) -> usize {
        config.vocab_size
    }

    fn positions(config: &MixtralConfig) -> usize {
        config.max_position_embeddings
    }

    fn depth_and_width(config: &MixtralConfig) -> (usize, usize) {
        (config.num_hidden_layers, config.hidden_size)
    }

    fn experts(config: &MixtralConfig) -> Option<(usize, usize)> {
        Some((config.num_local_experts, config.num_experts_per_tok))
    }
}

/// The error of an expert-parallel degree that does not divide the experts.
fn indivisible_experts(experts: usize, ep_degree: usize) -> Error {
    let divisors: Vec<String> = (1..=experts).filter(|d| experts.is_multiple_of(*d)).map(|d| d.to_string()).collect();
    setting(
        "mesh.ep",
        format!(
            "mesh.ep = {ep_degree} does not divide the {experts} experts of each layer (num_local_experts), so the ranks cannot hold equal shares; choose mesh.ep among {}",
            divisors.join(", ")
        ),
    )
}

impl KindModel for MoeGpt2 {
    const KIND: ModelKind = ModelKind::MoeGpt2;
    const POSITIONS: &'static str = "n_positions";
    const EMBEDDING: &'static str = "wte.weight";
    const ARCHITECTURE: &'static str = "MoeGpt2LMHeadModel";

    fn for_rank(config: &MoeGpt2Config, tp: usize, ep_rank: usize, ep_degree: usize) -> Result<MoeGpt2> {
        if ep_degree == 0 || !config.num_local_experts.is_multiple_of(ep_degree) {
            return Err(indivisible_experts(config.num_local_experts, ep_degree));
        }
        MoeGpt2::with_expert_parallel(config, ep_rank, ep_degree)?.with_vocab_padded_to(padded_vocab(config.gpt2.vocab_size, tp))
    }

    fn vocab_size(config: &MoeGpt2Config) -> usize {
        config.gpt2.vocab_size
    }

    fn positions(config: &MoeGpt2Config) -> usize {
        config.gpt2.n_positions
    }

    fn depth_and_width(config: &MoeGpt2Config) -> (usize, usize) {
        (config.gpt2.n_layer, config.gpt2.n_embd)
    }

    fn experts(config: &MoeGpt2Config) -> Option<(usize, usize)> {
        Some((config.num_local_experts, config.num_experts_per_tok))
    }
}

/// A model of kind `M` as a training run builds it: its config, and the
/// Hugging Face directory its weights start from, if any.
pub struct ModelSpec<M: KindModel> {
    config: M::Config,
    from: Option<PathBuf>,
}

// By hand: a derive would require the model type itself to be `Clone` and `Debug`.
impl<M: KindModel> Clone for ModelSpec<M> {
    fn clone(&self) -> Self {
        ModelSpec { config: self.config.clone(), from: self.from.clone() }
    }
}

impl<M: KindModel> fmt::Debug for ModelSpec<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ModelSpec").field("kind", &M::KIND).field("from", &self.from).field("config", &self.config.to_json()).finish()
    }
}

impl<M: KindModel> ModelSpec<M> {
    /// A model of `config` with random initial weights (`from` = `None`) or
    /// the weights of the Hugging Face directory `from`, whose config this
    /// must be.
    pub fn new(config: M::Config, from: Option<PathBuf>) -> ModelSpec<M> {
        ModelSpec { config, from }
    }

    /// Its kind.
    pub fn kind(&self) -> ModelKind {
        M::KIND
    }

    /// Its Hugging Face config (the vocabulary unpadded).
    pub fn config(&self) -> &M::Config {
        &self.config
    }

    /// The Hugging Face directory the weights start from.
    pub fn pretrained(&self) -> Option<&Path> {
        self.from.as_deref()
    }

    /// The model for a rank: `cx`'s tensor-parallel degree (the vocabulary
    /// padded if it does not divide it), the experts of expert-parallel rank
    /// `ep_rank` of `ep_degree`, and with a pretrained directory, its
    /// weights read for this rank when the model is materialised. Not yet
    /// materialised: this is the `build` a [`Trainer`](tessera::train::Trainer)
    /// takes.
    pub fn build(&self, cx: &Cx, ep_rank: usize, ep_degree: usize) -> tessera::Result<M> {
        let built = (|| {
            let mut model = M::for_rank(&self.config, cx.tp().size(), ep_rank, ep_degree)?;
            if let Some(dir) = &self.from {
                hf::load_when_materialized(&mut model, &self.config, dir)?;
            }
            Ok(model)
        })();
        built.map_err(|e: Error| match e {
            Error::Tessera(e) => e,
            other => tessera::Error::config(if self.from.is_some() { "model.from" } else { "model" }, other.to_string()),
        })
    }

    /// What the model costs for `settings` (see
    /// [`Module::describe`](tessera::module::Module::describe)): the model as
    /// a rank of a tensor-parallel group of `settings.tp` builds it (the
    /// vocabulary padded), with every expert, described without allocating.
    pub fn describe(&self, settings: CostSettings) -> Result<ModelCost> {
        let model = M::for_rank(&self.config, settings.tp, 0, 1)?;
        Ok(tessera::module::describe(&model, settings)?)
    }

    /// The vocabulary the model has on a tensor-parallel group of `tp`
    /// ranks, padding included: the trainer's [`ModelFacts::vocab`].
    pub fn padded_vocab(&self, tp: usize) -> usize {
        padded_vocab(M::vocab_size(&self.config), tp)
    }

    /// What a training program says before it starts, a line each: what is
    /// trained (from scratch or from which directory, its size, its
    /// experts), on which ranks and mesh, with which schedule and batch;
    /// first, for an elastic job that runs another number of processes than
    /// its mesh has, how it was fitted to them.
    pub fn banner(&self, cfg: &TrainConfig, job: &Job) -> Result<Vec<String>> {
        let (params, active) = self.param_counts()?;
        let (layers, width) = M::depth_and_width(self.config());
        let experts = match M::experts(self.config()) {
            Some((e, k)) => format!(", {e} experts of which each token uses {k} ({active} parameters active per token)"),
            None => String::new(),
        };
        let origin = match self.pretrained() {
            Some(dir) => format!("fine-tuning {} from {}", self.kind(), dir.display()),
            None => format!("training {}", self.kind()),
        };
        let m = &cfg.mesh;
        let ranks = match (m.rank_device()?, job.processes()) {
            (RankDevice::Cuda, Some(_)) => "GPUs (one process each)",
            (RankDevice::Cuda, None) => "GPUs",
            (_, Some(_)) => "CPU ranks (one process each)",
            _ => "CPU ranks",
        };
        let mut lines = Vec::new();
        if let Some((dp, accum)) = job.resized() {
            lines.push(format!(
                "elastic: {} processes run the mesh with dp{dp} and {accum} microbatches per step (the configuration's dp{} × {}), keeping the global batch",
                job.processes().unwrap_or(1),
                m.dp,
                cfg.batch.grad_accum
            ));
        }
        let cfg = job.fit(cfg);
        let m = &cfg.mesh;
        lines.push(format!(
            "{origin} ({params} parameters, {layers} layers, hidden {width}{experts}) on {} {ranks}: dp{} × ep{} × pp{} × tp{}{} ({} schedule, {} microbatches of {} × {} tokens per replica and step)",
            m.world_size(),
            m.dp,
            m.ep,
            m.pp,
            m.tp,
            if m.sp && m.tp > 1 { " with sequence parallelism" } else { "" },
            m.schedule,
            cfg.batch.grad_accum,
            cfg.batch.micro_batch,
            cfg.batch.seq_len
        ));
        Ok(lines)
    }

    /// Parameters in all (every expert counted, a tied weight once) and
    /// those one token uses (`top_k` of the experts of each layer).
    pub fn param_counts(&self) -> Result<(usize, usize)> {
        let probe = M::for_rank(&self.config, 1, 0, 1)?;
        let share = M::experts(&self.config).map_or(1.0, |(experts, top_k)| top_k as f64 / experts as f64);
        let mut in_experts = std::collections::HashSet::new();
        module::visit_params(&probe, |e| {
            if e.expert.is_some() {
                in_experts.insert(e.param.id());
            }
            Ok(())
        })?;
        let (mut total, mut active) = (0usize, 0.0f64);
        for p in module::distinct_params(&probe)? {
            let n = p.param.global_shape().elem_count();
            total += n;
            active += if in_experts.contains(&p.param.id()) { n as f64 * share } else { n as f64 };
        }
        Ok((total, active.round() as usize))
    }

    /// What the trainer needs to know about the model on a tensor-parallel
    /// group of `tp` ranks training sequences of `seq_len` tokens: the padded
    /// vocabulary, and the training FLOPs per token (of the parameters a
    /// token uses: a mixture of experts runs `top_k` of its experts).
    pub fn facts(&self, tp: usize, seq_len: usize) -> Result<ModelFacts> {
        let (_, active) = self.param_counts()?;
        let (layers, width) = M::depth_and_width(&self.config);
        Ok(ModelFacts { vocab: self.padded_vocab(tp), flops_per_token: transformer_flops_per_token(active, layers, seq_len, width) })
    }

    /// Checks the model against the run before anything is built: the
    /// sequences fit its positions, the data's ids fit its vocabulary, the
    /// expert-parallel degree splits its experts (a model without experts
    /// takes none), the tensor-parallel degree its heads and widths, the
    /// pipeline its layers, and a pretrained directory holds every weight
    /// with the shape the config implies. Each error names the setting to
    /// change. Nothing is allocated or read but file headers.
    pub fn check_run(&self, cfg: &TrainConfig, data_vocab: usize) -> Result<()> {
        let positions = M::positions(&self.config);
        if cfg.batch.seq_len > positions {
            let fix = match &self.from {
                Some(_) => "shorten batch.seq_len".to_string(),
                None => format!("shorten batch.seq_len, or raise model.{} (it defaults to batch.seq_len)", M::POSITIONS),
            };
            return Err(setting(
                "batch.seq_len",
                format!("sequences of {} tokens are longer than the model's {positions} positions (`{}`); {fix}", cfg.batch.seq_len, M::POSITIONS),
            ));
        }
        let vocab = M::vocab_size(&self.config);
        if data_vocab > vocab {
            let fix = match &self.from {
                Some(dir) => format!("the data must be tokenized with the tokenizer of {} (tessera prepare --tokenizer DIR/tokenizer.json)", dir.display()),
                None => format!("raise model.vocab_size to at least {data_vocab}, or leave it out (the data's vocabulary is used)"),
            };
            return Err(setting(
                if self.from.is_some() { "model.from" } else { "model.vocab_size" },
                format!("the data has {data_vocab} token ids and the model a vocabulary of {vocab}; {fix}"),
            ));
        }
        M::for_rank(&self.config, 1, 0, cfg.mesh.ep)?;
        // The trainer checks the mesh against the model too, but only once
        // the run directory exists (a program has written its data there):
        // a degree that cannot split the model is refused before that.
        let (tp, pp) = (cfg.mesh.tp, cfg.mesh.pp);
        let model = M::for_rank(&self.config, tp, 0, 1)?;
        if tp > 1 {
            module::check_tp_degree(&model, tp).map_err(|e| setting("mesh.tp", e.to_string()))?;
        }
        let chunks = cfg.mesh.schedule_kind()?.chunks();
        if model.split_layers() < pp * chunks {
            return Err(setting(
                "mesh.pp",
                format!(
                    "the model has {} layers, too few for {} pipeline stages (mesh.pp = {pp}, {chunks} chunk(s) each); lower mesh.pp or mesh.chunks, or give the model more layers",
                    model.split_layers(),
                    pp * chunks
                ),
            ));
        }
        if let Some(dir) = &self.from {
            // Every tensor of the directory, checked against the model now
            // (headers only): a missing or mismatched file is refused here,
            // not when the ranks start.
            let mut model = M::for_rank(&self.config, 1, 0, 1)?;
            hf::load_when_materialized(&mut model, &self.config, dir).map_err(|e| setting("model.from", e.to_string()))?;
        }
        Ok(())
    }

    /// The model as a run directory records it (`model.json`): its kind, its
    /// Hugging Face config and the directory it started from. What `tessera
    /// export` and evaluation rebuild the model from.
    pub fn record(&self) -> Value {
        serde_json::json!({
            "kind": M::KIND.name(),
            "from": self.from.as_ref().map(|d| d.display().to_string()),
            "config": self.config.to_json(),
        })
    }

    /// Writes [`record`](Self::record) to `run_dir`/[`RECORD_FILE`] (atomically).
    pub fn write_record(&self, run_dir: &Path) -> Result<()> {
        let path = run_dir.join(RECORD_FILE);
        let text = serde_json::to_string_pretty(&self.record()).expect("a JSON value serialises") + "\n";
        tessera::file::write_atomic(&path, text.as_bytes()).map_err(|source| Error::Io { path: path.display().to_string(), doing: "cannot write it", source })
    }

    /// The model on the rank of `cx`, its share of `cx`'s tensor-parallel
    /// group and every expert, with the weights of the Tessera checkpoint in
    /// `dir` (written from any mesh; a vocabulary padded for tensor
    /// parallelism keeps its padding, which export leaves out). Collective:
    /// every rank of the group loads at once.
    pub fn load_checkpoint(&self, dir: &Path, cx: &Cx) -> Result<M> {
        let manifest = ckpt::read_manifest(dir)?;
        let vocab = M::vocab_size(&self.config);
        let rows = manifest.params.iter().find(|p| p.is_named(M::EMBEDDING)).and_then(|p| p.global_shape.first().copied()).unwrap_or(vocab);
        let tp = cx.tp().size();
        if !rows.is_multiple_of(tp) {
            return Err(Error::Tessera(tessera::Error::config(
                "tp",
                format!(
                    "the checkpoint in `{}` holds a vocabulary of {rows} ids, which {tp} tensor-parallel ranks cannot split; \
                     load it on a number of ranks that divides {rows}, or export it (`tessera export`) and load the exported \
                     directory, whose vocabulary is padded for any number of ranks",
                    dir.display()
                ),
            )));
        }
        let mut model = M::for_rank(&self.config, tp, 0, 1)?;
        if rows != padded_vocab(vocab, tp) {
            model = model.with_vocab_padded_to(rows)?;
        }
        let model = module::build(model, cx)?;
        let root =
            dir.parent().ok_or_else(|| Error::File { path: dir.display().to_string(), detail: "a checkpoint directory has a parent (its root)".into() })?;
        Checkpointer::open(root, 1)?.load(dir, &model, None, cx)?;
        Ok(model)
    }
}

/// Training (or anything else) done with a model whatever its kind: a
/// program's code, generic over the model type, that
/// [`with_configured_model`] and [`with_recorded_model`] call with the kind
/// they read.
pub trait ModelJob {
    /// What the job returns.
    type Output;
    /// Does the job with `spec`.
    fn run<M: KindModel>(self, spec: ModelSpec<M>) -> Result<Self::Output>;
}

/// Reads the `[model]` table of `cfg` and runs `job` with the model it
/// describes. `data_vocab` is the vocabulary of the training data.
///
/// * `kind`: `gpt2` (when absent), `llama`, `mixtral` or `gpt2_moe`;
///   anything else is an error listing the kinds.
/// * Without `from`, the other keys are fields of that kind's Hugging Face
///   config (a misspelt one is an error naming the closest field). The
///   vocabulary is `vocab_size` if given, else the data's rounded up to a
///   multiple of 8 per tensor-parallel rank (ids the data never uses, left
///   unmasked); the positions (`n_positions` / `max_position_embeddings`)
///   default to `batch.seq_len`.
/// * With `from = "DIR"`, DIR is a Hugging Face model directory: its
///   `config.json` gives the architecture and `kind` (from `model_type`;
///   `kind` may be left out), and a field repeated in the table must have the
///   file's value. The weights are read when each rank materialises its model.
///
/// Then the model is checked against the run ([`ModelSpec::check_run`]).
pub fn with_configured_model<J: ModelJob>(cfg: &TrainConfig, data_vocab: usize, job: J) -> Result<J::Output> {
    let table = &cfg.model;
    let kind = match table.get("kind") {
        None => None,
        Some(v) => match v.as_str() {
            Some(name) => Some(ModelKind::parse(name, "model.kind")?),
            None => return Err(setting("model.kind", format!("{v} is not a model kind; write a string: {}", choices()))),
        },
    };
    let from = match table.get("from") {
        None => None,
        Some(v) => match v.as_str() {
            Some(dir) if !dir.is_empty() => Some(PathBuf::from(dir)),
            _ => {
                return Err(setting(
                    "model.from",
                    format!("{v} is not a directory; write the path of a Hugging Face model directory (config.json and *.safetensors) as a string"),
                ))
            }
        },
    };
    let fields: Value = serde_json::to_value(table).map_err(|e| setting("model", e.to_string()))?;
    match from {
        Some(dir) => {
            let file = read_json(&dir.join("config.json"))
                .map_err(|e| setting("model.from", format!("{e}; point model.from at a Hugging Face model directory (config.json and model.safetensors)")))?;
            let stored = match file.get("model_type").and_then(Value::as_str) {
                Some(t) => Some(ModelKind::parse(t, "model.from").map_err(|_| {
                    setting(
                        "model.from",
                        format!("{}/config.json is a model of type {t:?}, which Tessera does not train; the kinds are {}", dir.display(), choices()),
                    )
                })?),
                None => None,
            };
            let kind = match (kind, stored) {
                (Some(k), Some(s)) if k != s => {
                    return Err(setting(
                        "model.kind",
                        format!(
                            "\"{k}\" conflicts with {}/config.json, which holds a {s} (model_type); leave model.kind out or set it to \"{s}\"",
                            dir.display()
                        ),
                    ))
                }
                (k, s) => k.or(s).ok_or_else(|| {
                    setting("model.kind", format!("{}/config.json names no model_type; say which kind it is: model.kind = {}", dir.display(), choices()))
                })?,
            };
            match kind {
                ModelKind::Gpt2 => job.run(pretrained::<Gpt2>(cfg, &dir, &file, &fields, data_vocab)?),
                ModelKind::Llama => job.run(pretrained::<Llama>(cfg, &dir, &file, &fields, data_vocab)?),
                ModelKind::Mixtral => job.run(pretrained::<Mixtral>(cfg, &dir, &file, &fields, data_vocab)?),
                ModelKind::MoeGpt2 => job.run(pretrained::<MoeGpt2>(cfg, &dir, &file, &fields, data_vocab)?),
            }
        }
        None => match kind.unwrap_or(ModelKind::Gpt2) {
            ModelKind::Gpt2 => job.run(described::<Gpt2>(cfg, &fields, data_vocab)?),
            ModelKind::Llama => job.run(described::<Llama>(cfg, &fields, data_vocab)?),
            ModelKind::Mixtral => job.run(described::<Mixtral>(cfg, &fields, data_vocab)?),
            ModelKind::MoeGpt2 => job.run(described::<MoeGpt2>(cfg, &fields, data_vocab)?),
        },
    }
}

/// Runs `job` with the model a run directory's `model.json` records (see
/// [`ModelSpec::record`]).
pub fn with_recorded_model<J: ModelJob>(record: &Value, job: J) -> Result<J::Output> {
    let bad = |detail: &str| Error::File { path: "model.json".into(), detail: detail.into() };
    let kind = ModelKind::parse(record.get("kind").and_then(Value::as_str).ok_or_else(|| bad("has no `kind` string"))?, "kind")?;
    let config = record.get("config").ok_or_else(|| bad("has no `config` object"))?;
    let from = record.get("from").and_then(Value::as_str).map(PathBuf::from);
    match kind {
        ModelKind::Gpt2 => job.run(ModelSpec::<Gpt2>::new(Gpt2Config::from_json(config)?, from)),
        ModelKind::Llama => job.run(ModelSpec::<Llama>::new(LlamaConfig::from_json(config)?, from)),
        ModelKind::Mixtral => job.run(ModelSpec::<Mixtral>::new(MixtralConfig::from_json(config)?, from)),
        ModelKind::MoeGpt2 => job.run(ModelSpec::<MoeGpt2>::new(MoeGpt2Config::from_json(config)?, from)),
    }
}

/// Reads a JSON file, naming it when it is missing or malformed.
fn read_json(path: &Path) -> Result<Value> {
    let bytes = std::fs::read(path).map_err(|source| Error::Io { path: path.display().to_string(), doing: "cannot read it", source })?;
    serde_json::from_slice(&bytes).map_err(|e| Error::File { path: path.display().to_string(), detail: format!("not valid JSON: {e}") })
}

/// The model the `[model]` table describes field by field.
fn described<M: KindModel>(cfg: &TrainConfig, fields: &Value, data_vocab: usize) -> Result<ModelSpec<M>> {
    let keys: Vec<&str> = fields.as_object().into_iter().flat_map(|m| m.keys()).map(String::as_str).filter(|k| *k != "kind").collect();
    check_keys::<M>(&keys)?;
    let mut json = fields.clone();
    let map = json.as_object_mut().expect("a table is a JSON object");
    map.remove("kind");
    if !map.contains_key("vocab_size") {
        // A multiple of 8 per tensor-parallel rank, as Megatron pads: the
        // extra ids are ones the data never uses, learned down like any
        // absent token, and not masked (the main job's trajectory, which
        // reaches its accuracy this way, depends on it).
        let step = 8 * cfg.mesh.tp.max(1);
        map.insert("vocab_size".into(), Value::from(data_vocab.div_ceil(step) * step));
    }
    if !map.contains_key(M::POSITIONS) {
        map.insert(M::POSITIONS.into(), Value::from(cfg.batch.seq_len));
    }
    // What Hugging Face reads to know the model's class, for the export.
    map.insert("model_type".into(), Value::from(M::KIND.name()));
    map.insert("architectures".into(), Value::from(vec![M::ARCHITECTURE]));
    let config = M::Config::from_json(&json).map_err(in_model_table)?;
    let spec = ModelSpec::new(config, None);
    spec.check_run(cfg, data_vocab)?;
    Ok(spec)
}

/// Checks that every key of the `[model]` table is `kind`, `from` or a field
/// of `M`'s config: a misspelt one would otherwise leave the model at its
/// default in silence. The error names the closest key and every key there is.
fn check_keys<M: KindModel>(keys: &[&str]) -> Result<()> {
    let fields = <M::Config as HfConfig>::FIELDS;
    for key in keys.iter().filter(|k| !matches!(**k, "kind" | "from")) {
        if !fields.contains(key) {
            let mut known = vec!["kind", "from"];
            known.extend_from_slice(fields);
            let hint = tessera::train::closest(key, &known).map(|c| format!("did you mean `{c}`? ")).unwrap_or_default();
            let all: Vec<String> = known.iter().map(|f| format!("`{f}`")).collect();
            return Err(setting(&format!("model.{key}"), format!("a {} has no such setting; {hint}its settings are {}", M::KIND, all.join(", "))));
        }
    }
    Ok(())
}

/// A config error of the `[model]` table, named as the table's key.
fn in_model_table(e: Error) -> Error {
    match e {
        Error::Config { field, detail } => setting(&format!("model.{field}"), detail),
        other => other,
    }
}

/// The model of the Hugging Face directory `dir` (whose `config.json` is
/// `file`), with the `[model]` table's `fields` checked against it.
fn pretrained<M: KindModel>(cfg: &TrainConfig, dir: &Path, file: &Value, fields: &Value, data_vocab: usize) -> Result<ModelSpec<M>> {
    let config: M::Config = hf::read_config(dir)?;
    let keys: Vec<&str> = fields.as_object().into_iter().flat_map(|m| m.keys()).map(String::as_str).filter(|k| !matches!(*k, "kind" | "from")).collect();
    check_keys::<M>(&keys)?;
    for key in keys {
        // The field as the model reads it: the file with the table's value in
        // its place must describe the same model.
        let mut merged = file.clone();
        merged[key] = fields[key].clone();
        let same = M::Config::from_json(&merged).is_ok_and(|c| c.to_json() == config.to_json());
        if !same {
            let theirs = file.get(key).map_or("nothing (the default)".to_string(), |v| v.to_string());
            return Err(setting(
                &format!("model.{key}"),
                format!(
                    "{} conflicts with {}/config.json, which gives {theirs}; a run that starts from a pretrained model takes its architecture from that file: remove model.{key}",
                    fields[key],
                    dir.display()
                ),
            ));
        }
    }
    let spec = ModelSpec::new(config, Some(dir.to_path_buf()));
    spec.check_run(cfg, data_vocab)?;
    Ok(spec)
}
