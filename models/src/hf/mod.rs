//! Hugging Face checkpoints: load a `config.json` + `model.safetensors`
//! directory into a model on each rank, and export a model in the same form.
//!
//! Each model maps its Tessera parameters (the dotted names of
//! [`distinct_params`](tessera::module::distinct_params)) to Hugging Face
//! tensors with a [`Conversion`] between their layouts ([`HfModel::hf_param`]):
//!
//! | model | Tessera parameter | Hugging Face tensors | conversion |
//! |---|---|---|---|
//! | GPT-2 | `h.{i}.attn.c_attn.weight` / `.bias` | `transformer.h.{i}.attn.c_attn.weight` / `.bias` | fused q/k/v (weight transposed) → packed per head |
//! | GPT-2 | `h.{i}.attn.c_proj.weight`, `h.{i}.mlp.c_fc.weight`, `h.{i}.mlp.c_proj.weight` | `transformer.` + same name | transposed (`Conv1D` is `[in, out]`) |
//! | GPT-2 | every other (`wte`, `wpe`, `ln_*`, biases) | `transformer.` + same name | identity |
//! | Llama, Mixtral | `layers.{i}.self_attn.qkv_proj.weight` | `model.layers.{i}.self_attn.{q,k,v}_proj.weight` | separate q/k/v → packed per key/value group |
//! | Mixtral | `layers.{i}.block_sparse_moe.router.weight` | `model.layers.{i}.block_sparse_moe.gate.weight` | identity |
//! | Mixtral | `layers.{i}.block_sparse_moe.experts.{e}.{gate,up,down}.weight` | `model.layers.{i}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight` | identity |
//! | Llama, Mixtral | every other | `model.` + same name | identity |
//! | all | `lm_head.weight` (untied only) | `lm_head.weight` | identity |
//!
//! Rotary embeddings need no permutation: Tessera's RoPE rotates the pairs
//! `(i, i + head_dim/2)` ("rotate half"), as Hugging Face's Llama does.
//! A tied head is the token embedding's parameter under a second name: it
//! is stored once, as Hugging Face does, and a `lm_head.weight` copy in a
//! tied checkpoint is ignored. Checkpoints of the bare base model (names
//! without `transformer.` / `model.`) load too.
//!
//! Loading reads the weights in f32, f16 or bf16 and converts them to the
//! model's master dtype; each rank converts a parameter whole and keeps only
//! its tensor-parallel shard (every rank reads the whole files). Every
//! tensor's presence, shape and dtype is checked, and tensors the model has
//! no parameter for are refused, before any parameter changes.
//!
//! Export writes f32 weights under Hugging Face's names and layouts, and
//! the config, from a model that holds every parameter whole: one with a
//! tensor-parallel degree and expert-parallel degree of one.

mod convert;
mod experts;
mod files;

pub use convert::{Conversion, QkvHeads, QkvStorage};
pub(crate) use experts::{check_every_expert_held, held_elsewhere};

use crate::error::{Error, Result};
use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;
use tessera::module::{self, Cx, InitialValues, Module, Shard};
use tessera::{DType, Device, Shape, Tensor};

/// The config file of a checkpoint directory.
const CONFIG: &str = "config.json";

/// Where a Tessera parameter is stored in a Hugging Face checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HfParam {
    /// The Hugging Face tensors' full names (with the base model's prefix), in order.
    pub tensors: Vec<String>,
    /// How their layout relates to the parameter's.
    pub conversion: Conversion,
}

impl HfParam {
    /// One tensor `name` with `conversion`.
    pub fn one(name: impl Into<String>, conversion: Conversion) -> HfParam {
        HfParam { tensors: vec![name.into()], conversion }
    }
}

/// A Hugging Face `config.json`, read and written field by field.
pub trait HfConfig: Clone + Sized {
    /// The fields that shape the model (what a training configuration's
    /// `[model]` table may set; a `config.json` may hold others too).
    const FIELDS: &'static [&'static str];
    /// Reads a config from its JSON object and validates it; an error names the bad field.
    fn from_json(value: &serde_json::Value) -> Result<Self>;
    /// The config as a JSON object (fields the model does not use included, as read).
    fn to_json(&self) -> serde_json::Value;
    /// Checks every field the model depends on.
    fn validate(&self) -> Result<()>;
}

/// Checks that every key of a training configuration's `[model]` table
/// (`kind` aside) is a field of `C`: a misspelt one (`n_layers`) would
/// otherwise leave the model at its default in silence. The error names the
/// key, the closest field, and every field there is.
///
/// ```
/// use tessera_models::gpt2::Gpt2Config;
/// use tessera_models::hf::check_fields;
///
/// assert!(check_fields::<Gpt2Config>(["kind", "n_layer", "n_embd"]).is_ok());
/// let e = check_fields::<Gpt2Config>(["n_layers"]).unwrap_err().to_string();
/// assert!(e.contains("did you mean `n_layer`?"));
/// ```
pub fn check_fields<'a, C: HfConfig>(keys: impl IntoIterator<Item = &'a str>) -> Result<()> {
    for key in keys.into_iter().filter(|k| *k != "kind") {
        if !C::FIELDS.contains(&key) {
            let hint = tessera::train::closest(key, C::FIELDS).map(|c| format!("did you mean `{c}`? ")).unwrap_or_default();
            let all: Vec<String> = C::FIELDS.iter().map(|f| format!("`{f}`")).collect();
            return Err(Error::config(key, format!("this model has no such setting; {hint}its settings are `kind`, {}", all.join(", "))));
        }
    }
    Ok(())
}

/// A model with a Hugging Face checkpoint format.
pub trait HfModel: Module + Sized {
    /// Its config.
    type Config: HfConfig;
    /// The prefix of the base model's tensors (`transformer.`, `model.`),
    /// which checkpoints of the bare base model leave out.
    const BASE_PREFIX: &'static str;

    /// The model `config` describes, for the rank of `cx` (a Mixtral holds
    /// the experts of its expert-parallel rank; a vocabulary the
    /// tensor-parallel degree does not divide is padded, see
    /// [`crate::vocab`]), not yet materialised.
    fn from_config(config: &Self::Config, cx: &Cx) -> Result<Self>;

    /// This model with its vocabulary padded to `padded` ids, the padding
    /// masked in the head (see [`crate::vocab`]). Before it is materialised.
    fn with_vocab_padded_to(self, padded: usize) -> Result<Self>;

    /// Where parameter `name` (its first name, for a tied one) is stored.
    fn hf_param(config: &Self::Config, name: &str) -> HfParam;

    /// Whether a checkpoint tensor that fills no parameter of this model is
    /// expected and skipped (a buffer older checkpoints carry, a tied head's
    /// copy, another expert-parallel rank's experts).
    fn skips(&self, config: &Self::Config, tensor: &str) -> bool;

    /// Checks that this model holds every parameter of the checkpoint it
    /// would export (a Mixtral split over expert-parallel ranks does not).
    fn check_exportable(&self) -> Result<()> {
        Ok(())
    }
}

/// A model loaded from a Hugging Face checkpoint, with its config.
pub struct Pretrained<M: HfModel> {
    /// The model, materialised for the rank it was loaded on.
    pub model: M,
    /// The checkpoint's config.
    pub config: M::Config,
}

/// Reads and validates `<dir>/config.json`.
pub fn read_config<C: HfConfig>(dir: impl AsRef<Path>) -> Result<C> {
    let path = dir.as_ref().join(CONFIG);
    let value: serde_json::Value =
        serde_json::from_slice(&files::read(&path)?).map_err(|e| Error::File { path: path.display().to_string(), detail: format!("not valid JSON: {e}") })?;
    C::from_json(&value)
}

/// Loads the checkpoint in `dir` (`config.json` and `model.safetensors`, or
/// the shards `model.safetensors.index.json` lists) as a model for the rank
/// of `cx`: built, materialised ([`module::build`]) and filled with this
/// rank's shard of every weight.
///
/// ```no_run
/// use tessera::module::Cx;
/// use tessera::Device;
/// use tessera_models::{hf, llama::Llama};
///
/// let cx = Cx::new(Device::cpu());
/// let llama = hf::load_pretrained::<Llama>("path/to/checkpoint", &cx)?;
/// println!("{} layers", llama.config.num_hidden_layers);
/// # Ok::<(), tessera_models::Error>(())
/// ```
pub fn load_pretrained<M: HfModel>(dir: impl AsRef<Path>, cx: &Cx) -> Result<Pretrained<M>> {
    let dir = dir.as_ref();
    let config: M::Config = read_config(dir)?;
    let weights = files::Weights::open(dir)?;
    // The checkpoint is checked against the model's declared shapes before
    // anything is allocated: a damaged or mismatched config.json (a missing
    // `hidden_size` defaults to thousands) must not cost gigabytes first.
    let mut model = M::from_config(&config, cx)?;
    model.tie_params()?;
    let plan = plan(&model, &config, &weights)?;
    module::materialize(&model, cx)?;
    fill(plan, &weights)?;
    Ok(Pretrained { model, config })
}

/// Fills an already materialised `model` (of `config`) with the weights of
/// the checkpoint in `dir`, each parameter with this rank's shard in its
/// current dtype. Nothing changes unless every tensor is there with the
/// expected shape and dtype and none is left over.
pub fn load_weights<M: HfModel>(model: &M, config: &M::Config, dir: impl AsRef<Path>) -> Result<()> {
    let weights = files::Weights::open(dir.as_ref())?;
    let plan = plan(model, config, &weights)?;
    fill(plan, &weights)
}

/// Where each parameter's value comes from: its Hugging Face tensors (the
/// keys found in the checkpoint, with their expected shapes).
struct Source {
    param: module::NamedParam,
    conversion: Conversion,
    tensors: Vec<(String, Vec<usize>)>,
}

/// Checks the checkpoint against `model`'s parameters (their global
/// shapes; `model` need not be materialised): every tensor there with the
/// expected shape and a readable dtype, none left over.
fn plan<M: HfModel>(model: &M, config: &M::Config, weights: &files::Weights) -> Result<Vec<Source>> {
    let mut used: HashSet<String> = HashSet::new();
    let mut plan = Vec::new();
    for p in module::distinct_params(model)? {
        let hf = M::hf_param(config, p.name());
        let shapes = hf.conversion.hf_shapes(p.param.global_shape().dims());
        let mut tensors = Vec::with_capacity(hf.tensors.len());
        for (tensor, shape) in hf.tensors.iter().zip(shapes) {
            // A checkpoint of the bare base model has no prefix.
            let bare = tensor.strip_prefix(M::BASE_PREFIX).filter(|b| !weights.contains(tensor) && weights.contains(b));
            let key = bare.unwrap_or(tensor);
            if !weights.contains(key) {
                return Err(Error::MissingTensor { path: weights.path(), tensor: tensor.clone(), param: p.name().to_string() });
            }
            weights.check(key, &shape)?;
            used.insert(key.to_string());
            tensors.push((key.to_string(), shape));
        }
        plan.push(Source { param: p, conversion: hf.conversion, tensors });
    }
    let unexpected: Vec<String> = weights.names().filter(|n| !used.contains(*n) && !model.skips(config, n)).map(String::from).collect();
    if !unexpected.is_empty() {
        return Err(Error::UnexpectedTensors { path: weights.path(), tensors: unexpected });
    }
    Ok(plan)
}

/// Reads every planned parameter's shard, then sets them all: nothing
/// changes unless every read succeeds.
fn fill(plan: Vec<Source>, weights: &files::Weights) -> Result<()> {
    let mut values: Vec<(tessera::module::Param, Tensor)> = Vec::with_capacity(plan.len());
    for source in plan {
        let param = &source.param.param;
        let current = param.value()?;
        let local = source.read(weights, param.global_shape(), param.shard(), current.dtype(), current.device())?;
        values.push((param.clone(), local));
    }
    for (p, v) in values {
        p.set_value(v)?;
    }
    Ok(())
}

impl Source {
    /// The `shard` of this parameter (of global shape `global`) in `dtype` on
    /// `device`: its tensors read and converted whole, the vocabulary's
    /// padding rows added, then this rank's slice taken.
    fn read(&self, weights: &files::Weights, global: &Shape, shard: Shard, dtype: DType, device: &Device) -> Result<Tensor> {
        let mut parts = Vec::with_capacity(self.tensors.len());
        for (key, shape) in &self.tensors {
            parts.push(weights.read(key, shape, dtype, device)?);
        }
        let whole = with_padding_rows(self.conversion.import(&parts)?, global.dims()[0])?;
        Ok(match shard {
            Shard::Full => whole,
            Shard::Split { dim, rank, degree } => {
                let len = whole.dims()[dim] / degree;
                whole.narrow(dim, rank * len, len)?.contiguous()?
            }
        })
    }
}

/// Makes `model` (of `config`, built for its rank and not yet materialised)
/// take its weights from the checkpoint in `dir` when it is materialised:
/// [`module::materialize`] (or [`module::build`]) then reads, on each rank,
/// exactly the parameters that rank holds (its pipeline stage's, its
/// experts') and keeps its tensor-parallel shard of each, instead of drawing
/// random values. This is how a trainer, which builds and materialises the
/// model on every rank itself, fine-tunes a checkpoint on any mesh.
///
/// The checkpoint is checked now, as [`load_weights`] checks it (every
/// tensor present with the shape the config implies and a readable dtype,
/// none left over), and nothing is read or allocated yet. The files stay
/// memory-mapped until every parameter that uses them is materialised (or
/// the model is dropped).
///
/// ```
/// use tessera::module::{self, Cx};
/// use tessera::Device;
/// use tessera_models::{hf, llama::Llama};
/// use tessera_models::hf::HfModel;
///
/// # let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/llama");
/// let cx = Cx::new(Device::cpu());
/// let config = hf::read_config(dir)?;
/// let mut model = Llama::from_config(&config, &cx)?;
/// hf::load_when_materialized(&mut model, &config, dir)?;
/// let model = module::build(model, &cx)?; // reads the weights now
/// # Ok::<(), tessera_models::Error>(())
/// ```
pub fn load_when_materialized<M: HfModel>(model: &mut M, config: &M::Config, dir: impl AsRef<Path>) -> Result<()> {
    let weights = Arc::new(files::Weights::open(dir.as_ref())?);
    // The plan names each parameter once: a tied head is the embedding's parameter.
    model.tie_params()?;
    for source in plan(model, config, &weights)? {
        let param = source.param.param.clone();
        param.set_initial_values(Arc::new(Deferred { source, weights: weights.clone() }));
    }
    Ok(())
}

/// A parameter's tensors in a checkpoint, read when the parameter is materialised.
struct Deferred {
    source: Source,
    weights: Arc<files::Weights>,
}

impl InitialValues for Deferred {
    fn read(&self, global: &Shape, shard: Shard, dtype: DType, device: &Device) -> tessera::Result<Tensor> {
        self.source.read(&self.weights, global, shard, dtype, device).map_err(|e| match e {
            Error::Tessera(e) => e,
            // A file that changed after it was checked.
            other => tessera::Error::Checkpoint { path: self.weights.path(), detail: format!("cannot read the initial values of a parameter: {other}") },
        })
    }
}

/// `t` with zero rows appended up to `rows` (a vocabulary table read into a
/// model whose vocabulary is padded; see [`crate::vocab`]).
fn with_padding_rows(t: Tensor, rows: usize) -> Result<Tensor> {
    let have = t.dims()[0];
    if have >= rows {
        return Ok(t);
    }
    let mut dims = t.dims().to_vec();
    dims[0] = rows - have;
    let zeros = Tensor::zeros(dims.clone(), t.dtype(), t.device())?;
    dims[0] = rows;
    Ok(Tensor::concat_flat(&[&t.contiguous()?, &zeros])?.reshape(dims)?)
}

/// Writes `model` (of `config`) to `dir` as a Hugging Face checkpoint:
/// `config.json` and `model.safetensors` (f32, Hugging Face's names and
/// layouts, each tensor once). The model must hold every parameter whole:
/// export from a single-rank model (load the checkpoint there first).
pub fn save_pretrained<M: HfModel>(model: &M, config: &M::Config, dir: impl AsRef<Path>) -> Result<()> {
    let dir = dir.as_ref();
    config.validate()?;
    model.check_exportable()?;
    let mut tensors = Vec::new();
    for p in module::distinct_params(model)? {
        if p.param.shard() != Shard::Full {
            return Err(Error::Export(format!(
                "parameter `{}` holds only this rank's shard ({:?}); export from a model on a single rank (tensor-parallel degree 1)",
                p.name(),
                p.param.shard()
            )));
        }
        let hf = M::hf_param(config, p.name());
        let value = p.param.value()?.to_dtype(DType::F32)?;
        tensors.extend(hf.tensors.into_iter().zip(hf.conversion.export(&value)?));
    }
    std::fs::create_dir_all(dir).map_err(|e| files::io_err(dir, "cannot create the directory", e))?;
    files::write(&dir.join(files::WEIGHTS), &tensors)?;
    let mut json = serde_json::to_string_pretty(&config.to_json()).expect("a JSON value serialises");
    json.push('\n');
    files::replace_file(&dir.join(CONFIG), json.as_bytes())
}
