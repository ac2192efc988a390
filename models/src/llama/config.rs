//! Llama's Hugging Face configuration (`LlamaConfig`), and the attention and
//! rotary-embedding fields Mixtral shares with it.

use crate::config::{check_model_type, identity, positive, positive_real, serde_via_json, Fields, Writer};
use crate::error::{Error, Result};
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
        positive("vocab_size", self.vocab_size)?;
        positive("intermediate_size", self.intermediate_size)?;
        positive("num_hidden_layers", self.num_hidden_layers)?;
        self.attention().validate()?;
        check_silu(&self.hidden_act)?;
        positive_real("rms_norm_eps", self.rms_norm_eps)?;
        check_model_type(&self.extra, "llama")?;
        let f = Fields::new(&self.extra);
        for field in ["attention_bias", "mlp_bias"] {
            if f.get(field, false)? {
                return Err(Error::config(field, "true is not supported: Llama's projections have no bias here"));
            }
        }
        Ok(())
    }

    /// The attention and rotary-embedding fields.
    pub(crate) fn attention(&self) -> AttentionConfig<'_> {
        AttentionConfig {
            hidden_size: self.hidden_size,
            heads: self.num_attention_heads,
            kv_heads: self.num_key_value_heads,
            head_dim: self.head_dim,
            max_positions: self.max_position_embeddings,
            rope_theta: self.rope_theta,
            extra: &self.extra,
        }
    }

    /// Reads a config from its JSON object and validates it.
    pub fn from_json(value: &Value) -> Result<LlamaConfig> {
        let f = Fields::of(value)?;
        let d = LlamaConfig::default();
        let (heads, kv_heads, head_dim) = read_heads(&f, d.hidden_size, d.num_attention_heads, None)?;
        let config = LlamaConfig {
            vocab_size: f.get("vocab_size", d.vocab_size)?,
            hidden_size: f.get("hidden_size", d.hidden_size)?,
            intermediate_size: f.get("intermediate_size", d.intermediate_size)?,
            num_hidden_layers: f.get("num_hidden_layers", d.num_hidden_layers)?,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            hidden_act: f.get("hidden_act", d.hidden_act)?,
            max_position_embeddings: f.get("max_position_embeddings", d.max_position_embeddings)?,
            rms_norm_eps: f.get("rms_norm_eps", d.rms_norm_eps)?,
            rope_theta: read_rope_theta(&f, d.rope_theta)?,
            tie_word_embeddings: f.get("tie_word_embeddings", d.tie_word_embeddings)?,
            extra: f.rest(KNOWN),
        };
        config.validate()?;
        Ok(config)
    }

    /// The config as a `config.json` object.
    pub fn to_json(&self) -> Value {
        let w = Writer::new()
            .set("vocab_size", self.vocab_size)
            .set("hidden_size", self.hidden_size)
            .set("intermediate_size", self.intermediate_size)
            .set("num_hidden_layers", self.num_hidden_layers)
            .set("num_attention_heads", self.num_attention_heads)
            .set("num_key_value_heads", self.num_key_value_heads)
            .set("head_dim", self.head_dim)
            .set("hidden_act", &self.hidden_act)
            .set("max_position_embeddings", self.max_position_embeddings)
            .set("rms_norm_eps", self.rms_norm_eps)
            .set("tie_word_embeddings", self.tie_word_embeddings);
        write_rope_theta(w, self.rope_theta, &self.extra).keep(&self.extra)
    }
}

serde_via_json!(LlamaConfig);

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
        let f = Fields::new(self.extra);
        if let Some(rope) = f.opt::<Map<String, Value>>("rope_parameters")? {
            check_default_rope("rope_parameters.rope_type", Fields::new(&rope).opt::<String>("rope_type")?)?;
        }
        if let Some(scaling) = f.opt::<Map<String, Value>>("rope_scaling")? {
            let s = Fields::new(&scaling);
            check_default_rope("rope_scaling", s.opt::<String>("rope_type")?.or(s.opt::<String>("type")?))?;
        }
        if f.get("attention_dropout", 0.0f64)? != 0.0 {
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

/// `(num_attention_heads, num_key_value_heads, head_dim)`, with Hugging
/// Face's rules for the absent ones: key/value heads default to
/// `default_kv`, or to one per query head.
pub(crate) fn read_heads(f: &Fields<'_>, default_hidden: usize, default_heads: usize, default_kv: Option<usize>) -> Result<(usize, usize, usize)> {
    let hidden: usize = f.get("hidden_size", default_hidden)?;
    let heads: usize = f.get("num_attention_heads", default_heads)?;
    let kv_heads = f.get("num_key_value_heads", default_kv.unwrap_or(heads))?;
    let head_dim = match f.opt("head_dim")? {
        Some(d) => d,
        None if heads > 0 && hidden.is_multiple_of(heads) => hidden / heads,
        None => {
            return Err(Error::config(
                "num_attention_heads",
                format!("{heads} heads do not divide hidden_size = {hidden}; give `head_dim` or a head count that divides the width"),
            ))
        }
    };
    Ok((heads, kv_heads, head_dim))
}

/// The RoPE base: `rope_parameters.rope_theta` (newer files), else `rope_theta`, else `default`.
pub(crate) fn read_rope_theta(f: &Fields<'_>, default: f64) -> Result<f64> {
    if let Some(rope) = f.opt::<Map<String, Value>>("rope_parameters")? {
        if let Some(theta) = Fields::new(&rope).opt("rope_theta").map_err(|_| Error::config("rope_parameters.rope_theta", "must be a number"))? {
            return Ok(theta);
        }
    }
    f.get("rope_theta", default)
}

/// Writes the RoPE base where the file had it: inside `rope_parameters`
/// when the file has that object, as `rope_theta` otherwise.
pub(crate) fn write_rope_theta(w: Writer, theta: f64, extra: &Map<String, Value>) -> Writer {
    match extra.get("rope_parameters") {
        Some(Value::Object(rope)) => {
            let mut rope = rope.clone();
            rope.insert("rope_theta".into(), Value::from(theta));
            w.set("rope_parameters", rope)
        }
        _ => w.set("rope_theta", theta),
    }
}
