//! GPT-2's Hugging Face configuration (`GPT2Config`).

use crate::config::{self, check_model_type, identity, positive, positive_real, serde_via_json};
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// The fields of a Hugging Face `GPT2Config` that shape the model.
///
/// Deserialising reads a `config.json` (fields it lacks take Hugging Face's
/// defaults, those of the 124M GPT-2) and validates it; every other field
/// (token ids, dropout rates, `architectures`, ...) is kept in
/// [`extra`](Self::extra) and written back by serialisation. Dropout rates
/// are not applied: the model has no dropout.
#[derive(Clone, Debug, PartialEq)]
pub struct Gpt2Config {
    /// Tokens in the vocabulary (`vocab_size`).
    pub vocab_size: usize,
    /// The longest sequence, the rows of the position table (`n_positions`).
    pub n_positions: usize,
    /// Width of the residual stream (`n_embd`).
    pub n_embd: usize,
    /// Transformer blocks (`n_layer`).
    pub n_layer: usize,
    /// Attention heads (`n_head`); must divide `n_embd`.
    pub n_head: usize,
    /// Width of the MLP's hidden layer (`n_inner`); `None` means `4 · n_embd`.
    pub n_inner: Option<usize>,
    /// The MLP's activation (`activation_function`): the tanh approximation
    /// of GELU, `gelu_new` (also accepted: `gelu_pytorch_tanh`, `gelu_fast`,
    /// the same function).
    pub activation_function: String,
    /// `eps` of every LayerNorm (`layer_norm_epsilon`).
    pub layer_norm_epsilon: f64,
    /// Whether the output head shares the token embedding (`tie_word_embeddings`).
    pub tie_word_embeddings: bool,
    /// Every other field of the file, kept as read.
    pub extra: Map<String, Value>,
}

/// The fields of [`Gpt2Config`] (`extra` aside): the keys a training
/// configuration's `[model]` table may set, and those whose null in
/// `config.json` means Hugging Face's default. A test checks that they are
/// the keys [`ConfigJson`] writes.
pub(crate) const KNOWN: &[&str] =
    &["vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "activation_function", "layer_norm_epsilon", "tie_word_embeddings"];

/// How `config.json` spells a [`Gpt2Config`]: serde derives the reading and
/// writing from it. `remote` makes the derive build and take apart a
/// `Gpt2Config` (the compiler checks every field is here), while
/// `Gpt2Config`'s own serde impls go through [`Gpt2Config::from_json`], which
/// also validates. Fields absent from the file take [`Gpt2Config::default`];
/// every other key lands in `extra`.
#[derive(Deserialize, Serialize)]
#[serde(remote = "Gpt2Config", default = "Gpt2Config::default")]
struct ConfigJson {
    vocab_size: usize,
    n_positions: usize,
    n_embd: usize,
    n_layer: usize,
    n_head: usize,
    n_inner: Option<usize>,
    activation_function: String,
    layer_norm_epsilon: f64,
    tie_word_embeddings: bool,
    #[serde(flatten, serialize_with = "config::write_extra::<Gpt2Config, _>")]
    extra: Map<String, Value>,
}

/// Switches of Hugging Face's GPT-2 that change the computation, kept in
/// `extra` and checked (absent or null: Hugging Face's default).
#[derive(Deserialize)]
struct Switches {
    scale_attn_weights: Option<bool>,
    scale_attn_by_inverse_layer_idx: Option<bool>,
    add_cross_attention: Option<bool>,
}

/// Activations that are GELU's tanh approximation under another name.
const TANH_GELU: &[&str] = &["gelu_new", "gelu_pytorch_tanh", "gelu_fast"];

impl Default for Gpt2Config {
    /// Hugging Face's defaults: the 124M-parameter GPT-2.
    fn default() -> Self {
        Gpt2Config {
            vocab_size: 50257,
            n_positions: 1024,
            n_embd: 768,
            n_layer: 12,
            n_head: 12,
            n_inner: None,
            activation_function: "gelu_new".into(),
            layer_norm_epsilon: 1e-5,
            tie_word_embeddings: true,
            extra: identity("gpt2", "GPT2LMHeadModel"),
        }
    }
}

impl Gpt2Config {
    /// A small GPT-2 for tests and experiments: `vocab` tokens, width `d`,
    /// `heads` heads, `layers` blocks, sequences of up to `max_pos` tokens,
    /// tied embeddings, Hugging Face's defaults otherwise.
    pub fn tiny(vocab: usize, d: usize, heads: usize, layers: usize, max_pos: usize) -> Gpt2Config {
        Gpt2Config { vocab_size: vocab, n_positions: max_pos, n_embd: d, n_layer: layers, n_head: heads, ..Gpt2Config::default() }
    }

    /// Width of the MLP's hidden layer.
    pub fn inner(&self) -> usize {
        self.n_inner.unwrap_or(4 * self.n_embd)
    }

    /// Values per attention head.
    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head.max(1)
    }

    /// Checks every field this model depends on; the error names the first
    /// bad field and what it would need to be.
    pub fn validate(&self) -> Result<()> {
        for (field, v) in
            [("vocab_size", self.vocab_size), ("n_positions", self.n_positions), ("n_embd", self.n_embd), ("n_layer", self.n_layer), ("n_head", self.n_head)]
        {
            positive(field, v)?;
        }
        if !self.n_embd.is_multiple_of(self.n_head) {
            return Err(Error::config(
                "n_head",
                format!("{} heads do not divide n_embd = {}; choose a head count that divides the width", self.n_head, self.n_embd),
            ));
        }
        if let Some(inner) = self.n_inner {
            positive("n_inner", inner)?;
        }
        if !TANH_GELU.contains(&self.activation_function.as_str()) {
            return Err(Error::config(
                "activation_function",
                format!("`{}` is not supported; GPT-2 here uses GELU's tanh approximation (`gelu_new`)", self.activation_function),
            ));
        }
        positive_real("layer_norm_epsilon", self.layer_norm_epsilon)?;
        check_model_type(&self.extra, "gpt2")?;
        let switches: Switches = config::read_extra(&self.extra)?;
        if !switches.scale_attn_weights.unwrap_or(true) {
            return Err(Error::config("scale_attn_weights", "false is not supported: attention scores are always scaled by 1/sqrt(head_dim)"));
        }
        if switches.scale_attn_by_inverse_layer_idx.unwrap_or(false) {
            return Err(Error::config("scale_attn_by_inverse_layer_idx", "true is not supported: scores are not scaled by layer index"));
        }
        if switches.add_cross_attention.unwrap_or(false) {
            return Err(Error::config("add_cross_attention", "true is not supported: this GPT-2 is a decoder-only language model"));
        }
        Ok(())
    }

    /// Reads a config from its JSON object and validates it.
    pub fn from_json(value: &Value) -> Result<Gpt2Config> {
        let config = config::read(value, KNOWN, |d| ConfigJson::deserialize(d))?;
        config.validate()?;
        Ok(config)
    }

    /// The config as a `config.json` object.
    pub fn to_json(&self) -> Value {
        ConfigJson::serialize(self, serde_json::value::Serializer).expect("a config serialises to JSON")
    }
}

serde_via_json!(Gpt2Config);
