//! GPT-2's Hugging Face configuration (`GPT2Config`).

use crate::config::{check_model_type, identity, positive, positive_real, serde_via_json, Fields, Writer};
use crate::error::{Error, Result};
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

/// The fields [`Gpt2Config`] reads (and the behaviour switches it checks).
pub(crate) const KNOWN: &[&str] =
    &["vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "activation_function", "layer_norm_epsilon", "tie_word_embeddings"];

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
        // Switches of Hugging Face's GPT-2 that change the computation.
        let f = Fields::new(&self.extra);
        if !f.get("scale_attn_weights", true)? {
            return Err(Error::config("scale_attn_weights", "false is not supported: attention scores are always scaled by 1/sqrt(head_dim)"));
        }
        if f.get("scale_attn_by_inverse_layer_idx", false)? {
            return Err(Error::config("scale_attn_by_inverse_layer_idx", "true is not supported: scores are not scaled by layer index"));
        }
        if f.get("add_cross_attention", false)? {
            return Err(Error::config("add_cross_attention", "true is not supported: this GPT-2 is a decoder-only language model"));
        }
        Ok(())
    }

    /// Reads a config from its JSON object and validates it.
    pub fn from_json(value: &Value) -> Result<Gpt2Config> {
        let f = Fields::of(value)?;
        let d = Gpt2Config::default();
        let config = Gpt2Config {
            vocab_size: f.get("vocab_size", d.vocab_size)?,
            n_positions: f.get("n_positions", d.n_positions)?,
            n_embd: f.get("n_embd", d.n_embd)?,
            n_layer: f.get("n_layer", d.n_layer)?,
            n_head: f.get("n_head", d.n_head)?,
            n_inner: f.opt("n_inner")?,
            activation_function: f.get("activation_function", d.activation_function)?,
            layer_norm_epsilon: f.get("layer_norm_epsilon", d.layer_norm_epsilon)?,
            tie_word_embeddings: f.get("tie_word_embeddings", d.tie_word_embeddings)?,
            extra: f.rest(KNOWN),
        };
        config.validate()?;
        Ok(config)
    }

    /// The config as a `config.json` object.
    pub fn to_json(&self) -> Value {
        Writer::new()
            .set("vocab_size", self.vocab_size)
            .set("n_positions", self.n_positions)
            .set("n_embd", self.n_embd)
            .set("n_layer", self.n_layer)
            .set("n_head", self.n_head)
            .set("n_inner", self.n_inner)
            .set("activation_function", &self.activation_function)
            .set("layer_norm_epsilon", self.layer_norm_epsilon)
            .set("tie_word_embeddings", self.tie_word_embeddings)
            .keep(&self.extra)
    }
}

serde_via_json!(Gpt2Config);
