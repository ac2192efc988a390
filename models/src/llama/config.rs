//! Llama's Hugging Face configuration (`LlamaConfig`), and the attention and
//! rotary-embedding fields Mixtral shares with it.

use crate::config::{self, check_model_type, identity, positive, serde_via_json};
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// The fields of a Hugging Face `LlamaConfig` that shape the model.
///
/// Deserialising reads a `config.json` (fields it lacks take Hugging Face's
/// defaults, those of Llama 2 7B) and validates it; every other field is
/// kept in [`extra`](Self::extra) and written back by serialisation. The
/// RoPE base is read from `rope_theta` or, as newer files write it, from
/// `rope_parameters.rope_theta`.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Tokens in the vocabulary (`vocab_size`).
    pub vocab_size: usize,
    /// Width of the residual stream (`hidden_size`).
    pub hidden_size: usize,
    /// Width of the SwiGLU MLP's hidden layer (`intermediate_size`).
    pub intermediate_size: usize,
    /// Transformer blocks (`num_hidden_layers`).
    pub num_hidden_layers: usize,
    /// Query heads (`num_attention_heads`).
    pub num_attention_heads: usize,
    /// Key/value heads (`num_key_value_heads`; absent means one per query head).
    pub num_key_value_heads: usize,
    /// Values per head (`head_dim`; absent means `hidden_size / num_attention_heads`).
    pub head_dim: usize,
    /// The MLP's gate activation (`hidden_act`); only `silu` is supported.
    pub hidden_act: String,
    /// The longest sequence, the size of the RoPE table (`max_position_embeddings`).
    pub max_position_embeddings: usize,
    /// `eps` of every RMSNorm (`rms_norm_eps`).
    pub rms_norm_eps: f64,
    /// The RoPE base (`rope_theta`).
    pub rope_theta: f64,
    /// Whether the output head shares the token embedding (`tie_word_embeddings`).
    pub tie_word_embeddings: bool,
    /// Every other field of the file, kept as read.
    pub extra: Map<String, Value>,
}

/// The fields of [`LlamaConfig`] (`extra` aside): the keys a training
/// configuration's `[model]` table may set, and those whose null in
/// `config.json` means Hugging Face's default. A test checks that they are
/// the keys [`ConfigJson`] writes.
pub(crate) const KNOWN: &[&str] = &[
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "tie_word_embeddings",
];

/// How `config.json` spells a [`LlamaConfig`]: serde derives the reading and
/// writing from it (see `gpt2/config.rs` for why through `remote`). Fields
/// absent from the file take [`LlamaConfig::default`], and
/// [`LlamaConfig::from_json`] applies the defaults that depend on other
/// fields; every other key lands in `extra`.
#[derive(Deserialize, Serialize)]
#[serde(remote = "LlamaConfig", default = "LlamaConfig::default")]
struct ConfigJson {
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: usize,
    head_dim: usize,
    hidden_act: String,
    max_position_embeddings: usize,
    rms_norm_eps: f64,
    rope_theta: f64,
    tie_word_embeddings: bool,
    #[serde(flatten, serialize_with = "config::write_extra::<LlamaConfig, _>")]
    extra: Map<String, Value>,
}

/// Switches of Hugging Face's Llama that add biases, kept in `extra` and
/// checked (absent or null: none).
#[derive(Deserialize)]
struct Biases {
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
}

impl Default for LlamaConfig {
    /// Hugging Face's defaults: Llama 2 7B.
    fn default() -> Self {
        LlamaConfig {
            vocab_size: 32000,
            hidden_size: 4096,
            intermediate_size: 11008,
            num_hidden_layers: 32,
            num_attention_heads: 32,
            num_key_value_heads: 32,
            head_dim: 128,
            hidden_act: "silu".into(),
            max_position_embeddings: 2048,
            rms_norm_eps: 1e-6,
            rope_theta: 10_000.0,
            tie_word_embeddings: false,
            extra: identity("llama", "LlamaForCausalLM"),
        }
    }
}

impl LlamaConfig {
    /// A small Llama for tests and experiments: `vocab` tokens, width `d`,
    /// `heads` query heads over `kv_heads` key/value heads, an MLP of width
    /// `hidden`, `layers` blocks, sequences of up to `max_pos` tokens, an
    /// untied head, Hugging Face's defaults otherwise.
    pub fn tiny(vocab: usize, d: usize, heads: usize, kv_heads: usize, hidden: usize, layers: usize, max_pos: usize) -> LlamaConfig {
        LlamaConfig {
            vocab_size: vocab,
            hidden_size: d,
            intermediate_size: hidden,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim: d / heads.max(1),
            max_position_embeddings: max_pos,
            ..LlamaConfig::default()
        }
    }

    /// Checks every field this model depends on; the error names the first
    /// bad field and what it would need to be.
    pub fn validate(&self) -> Result<()> {
        self.validate_llama_fields()?;
        check_model_type(&self.extra, "llama")?;
        let biases: Biases = config::read_extra(&self.extra)?;
        for (field, bias) in [("attention_bias", biases.attention_bias), ("mlp_bias", biases.mlp_bias)] {
            if bias.unwrap_or(false) {
                return Err(Error::config(field, "true is not supported: Llama's projections have no bias here"));
            }
        }
        Ok(())
    }

    /// Reads a config from its JSON object and validates it.
    pub fn from_json(value: &Value) -> Result<LlamaConfig> {
        let mut config = LlamaConfig::read_json(value)?;
        // Hugging Face's default key/value heads: one per query head.
        if !config::given(value, "num_key_value_heads") {
            config.num_key_value_heads = config.num_attention_heads;
        }
        config.validate()?;
        Ok(config)
    }
}

/// Implements, for a config with Llama's architecture fields (`LlamaConfig`
/// and `MixtralConfig`, whose fields of the same name mean the same and are
/// checked the same), what depends on those fields alone: the attention
/// view, their checks, and reading and writing `config.json` through the
/// config's derive `$json`, whose keys are `$known`. What differs (the
/// defaults, the experts, the switches each model refuses) stays with each
/// config.
macro_rules! llama_fields {
    ($config:ident, $json:ident, $known:ident) => {
        impl $config {
            /// The attention and rotary-embedding fields.
            pub(crate) fn attention(&self) -> $crate::llama::AttentionConfig<'_> {
                $crate::llama::AttentionConfig {
                    hidden_size: self.hidden_size,
                    heads: self.num_attention_heads,
                    kv_heads: self.num_key_value_heads,
                    head_dim: self.head_dim,
                    max_positions: self.max_position_embeddings,
                    rope_theta: self.rope_theta,
                    extra: &self.extra,
                }
            }

            /// Checks the architecture fields Llama and Mixtral share; the
            /// error names the first bad field and what it would need to be.
            fn validate_llama_fields(&self) -> $crate::Result<()> {
                $crate::config::positive("vocab_size", self.vocab_size)?;
                $crate::config::positive("intermediate_size", self.intermediate_size)?;
                $crate::config::positive("num_hidden_layers", self.num_hidden_layers)?;
                self.attention().validate()?;
                $crate::llama::check_silu(&self.hidden_act)?;
                $crate::config::positive_real("rms_norm_eps", self.rms_norm_eps)
            }

            /// Reads a config from its JSON object without validating it:
            /// the RoPE base where newer files nest it, and Hugging Face's
            /// `head_dim` when the file gives none (the width split over the heads).
            fn read_json(value: &serde_json::Value) -> $crate::Result<$config> {
                let value = $crate::llama::lift_rope_theta(value)?;
                let mut config = $crate::config::read(&value, $known, |d| $json::deserialize(d))?;
                if !$crate::config::given(&value, "head_dim") {
                    config.head_dim = $crate::llama::default_head_dim(config.hidden_size, config.num_attention_heads)?;
                }
                Ok(config)
            }

            /// The config as a `config.json` object.
            pub fn to_json(&self) -> serde_json::Value {
                let json = $json::serialize(self, serde_json::value::Serializer).expect("a config serialises to JSON");
                $crate::llama::nest_rope_theta(json)
            }
        }
    };
}
pub(crate) use llama_fields;

llama_fields!(LlamaConfig, ConfigJson, KNOWN);
serde_via_json!(LlamaConfig);

/// The attention and RoPE fields of `extra` that Llama and Mixtral check
/// (absent or null: Hugging Face's default).
#[derive(Deserialize)]
struct AttentionFields {
    rope_parameters: Option<RopeParameters>,
    rope_scaling: Option<RopeScaling>,
    attention_dropout: Option<f64>,
}

/// `rope_parameters`, where newer files write the RoPE base and type.
/// (`expecting`: an error says what the file needs, not this type's name.)
#[derive(Deserialize)]
#[serde(expecting = "a map")]
struct RopeParameters {
    rope_theta: Option<f64>,
    rope_type: Option<String>,
}

/// `rope_scaling`, where older files name a scaled RoPE (`type` in the oldest).
#[derive(Deserialize)]
#[serde(expecting = "a map")]
struct RopeScaling {
    rope_type: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
}

/// The attention fields Llama and Mixtral share, borrowed from either config.
pub(crate) struct AttentionConfig<'a> {
    pub hidden_size: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub max_positions: usize,
    pub rope_theta: f64,
    pub extra: &'a Map<String, Value>,
}

impl AttentionConfig<'_> {
    pub fn validate(&self) -> Result<()> {
        positive("hidden_size", self.hidden_size)?;
        positive("num_attention_heads", self.heads)?;
        positive("num_key_value_heads", self.kv_heads)?;
        positive("max_position_embeddings", self.max_positions)?;
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(Error::config(
                "num_key_value_heads",
                format!("{} key/value heads cannot be shared evenly by {} query heads; it must divide num_attention_heads", self.kv_heads, self.heads),
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return Err(Error::config("head_dim", format!("must be even and positive for rotary embeddings, got {}", self.head_dim)));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return Err(Error::config("rope_theta", format!("must be a finite number above 1 (usually 10000), got {}", self.rope_theta)));
        }
        let fields: AttentionFields = config::read_extra(self.extra)?;
        if let Some(rope) = fields.rope_parameters {
            check_default_rope("rope_parameters.rope_type", rope.rope_type)?;
        }
        if let Some(scaling) = fields.rope_scaling {
            check_default_rope("rope_scaling", scaling.rope_type.or(scaling.kind))?;
        }
        if fields.attention_dropout.unwrap_or(0.0) != 0.0 {
            return Err(Error::config("attention_dropout", "only 0 is supported: attention has no dropout here"));
        }
        Ok(())
    }
}

/// Only plain RoPE: scaled variants (linear, dynamic, YaRN, Llama 3) change the angles.
fn check_default_rope(field: &str, rope_type: Option<String>) -> Result<()> {
    match rope_type.as_deref() {
        None | Some("default") => Ok(()),
        Some(other) => Err(Error::config(field, format!("RoPE type `{other}` is not supported; only plain rotary embeddings (`default`) are"))),
    }
}

/// Only SiLU gates (SwiGLU).
pub(crate) fn check_silu(hidden_act: &str) -> Result<()> {
    if hidden_act != "silu" {
        return Err(Error::config("hidden_act", format!("`{hidden_act}` is not supported; the MLP gate is SiLU (`silu`)")));
    }
    Ok(())
}

/// Hugging Face's `head_dim` for a file that gives none: the width split over the heads.
pub(crate) fn default_head_dim(hidden: usize, heads: usize) -> Result<usize> {
    if heads > 0 && hidden.is_multiple_of(heads) {
        return Ok(hidden / heads);
    }
    Err(Error::config(
        "num_attention_heads",
        format!("{heads} heads do not divide hidden_size = {hidden}; give `head_dim` or a head count that divides the width"),
    ))
}

/// `value` with the RoPE base as newer files write it,
/// `rope_parameters.rope_theta`, moved to `rope_theta` for the derive to
/// read: it takes precedence, and a `rope_theta` beside it is not read.
pub(crate) fn lift_rope_theta(value: &Value) -> Result<Value> {
    /// The one field read here.
    #[derive(Deserialize)]
    struct Nested {
        rope_parameters: Option<RopeParameters>,
    }
    let mut value = value.clone();
    // Anything but an object is the derive's to report.
    if let Value::Object(map) = &mut value {
        let nested: Nested = config::read_extra(map)?;
        if let Some(theta) = nested.rope_parameters.and_then(|rope| rope.rope_theta) {
            map.insert("rope_theta".into(), Value::from(theta));
        }
    }
    Ok(value)
}

/// Writes the RoPE base where the file had it: inside `rope_parameters`
/// when the file has that object, as `rope_theta` otherwise.
pub(crate) fn nest_rope_theta(mut json: Value) -> Value {
    if json.get("rope_parameters").is_some_and(Value::is_object) {
        let theta = json.as_object_mut().and_then(|m| m.remove("rope_theta")).unwrap_or(Value::Null);
        json["rope_parameters"]["rope_theta"] = theta;
    }
    json
}
