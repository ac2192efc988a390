//! Mixtral's Hugging Face configuration (`MixtralConfig`).

use crate::config::{check_model_type, identity, positive, positive_real, serde_via_json, Fields, Writer};
use crate::error::{Error, Result};
use crate::llama::{check_silu, read_heads, read_rope_theta, write_rope_theta, AttentionConfig};
use serde_json::{Map, Value};

/// The fields of a Hugging Face `MixtralConfig` that shape the model: those
/// of [`LlamaConfig`](crate::llama::LlamaConfig) and the experts.
///
/// Deserialising reads a `config.json` (fields it lacks take Hugging Face's
/// defaults, those of Mixtral 8x7B) and validates it; every other field is
/// kept in [`extra`](Self::extra) and written back by serialisation.
/// `router_aux_loss_coef` and `output_router_logits` are kept but not
/// applied: the load-balancing loss is off (see
/// [`Moe::with_aux_loss`](tessera::nn::Moe::with_aux_loss) for Tessera's).
#[derive(Clone, Debug, PartialEq)]
pub struct MixtralConfig {
    /// Tokens in the vocabulary (`vocab_size`).
    pub vocab_size: usize,
    /// Width of the residual stream (`hidden_size`).
    pub hidden_size: usize,
    /// Width of each expert's hidden layer (`intermediate_size`).
    pub intermediate_size: usize,
    /// Transformer blocks (`num_hidden_layers`).
    pub num_hidden_layers: usize,
    /// Query heads (`num_attention_heads`).
    pub num_attention_heads: usize,
    /// Key/value heads (`num_key_value_heads`; absent means one per query head).
    pub num_key_value_heads: usize,
    /// Values per head (`head_dim`; absent means `hidden_size / num_attention_heads`).
    pub head_dim: usize,
    /// The experts' gate activation (`hidden_act`); only `silu` is supported.
    pub hidden_act: String,
    /// The longest sequence, the size of the RoPE table (`max_position_embeddings`).
    pub max_position_embeddings: usize,
    /// `eps` of every RMSNorm (`rms_norm_eps`).
    pub rms_norm_eps: f64,
    /// The RoPE base (`rope_theta`, or `rope_parameters.rope_theta`).
    pub rope_theta: f64,
    /// Whether the output head shares the token embedding (`tie_word_embeddings`).
    pub tie_word_embeddings: bool,
    /// Experts per layer (`num_local_experts`).
    pub num_local_experts: usize,
    /// Experts each token is routed to (`num_experts_per_tok`).
    pub num_experts_per_tok: usize,
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
    "num_local_experts",
    "num_experts_per_tok",
];

impl Default for MixtralConfig {
    /// Hugging Face's defaults: Mixtral 8x7B.
    fn default() -> Self {
        MixtralConfig {
            vocab_size: 32000,
            hidden_size: 4096,
            intermediate_size: 14336,
            num_hidden_layers: 32,
            num_attention_heads: 32,
            num_key_value_heads: 8,
            head_dim: 128,
            hidden_act: "silu".into(),
            max_position_embeddings: 4096 * 32,
            rms_norm_eps: 1e-5,
            rope_theta: 1e6,
            tie_word_embeddings: false,
            num_local_experts: 8,
            num_experts_per_tok: 2,
            extra: identity("mixtral", "MixtralForCausalLM"),
        }
    }
}

impl MixtralConfig {
    /// A small Mixtral for tests and experiments: `vocab` tokens, width `d`,
    /// `heads` query heads over `kv_heads` key/value heads, `experts`
    /// experts of width `hidden` of which each token uses `top_k`, `layers`
    /// blocks, sequences of up to `max_pos` tokens, an untied head, Hugging
    /// Face's defaults otherwise.
    #[allow(clippy::too_many_arguments)]
    pub fn tiny(
        vocab: usize,
        d: usize,
        heads: usize,
        kv_heads: usize,
        hidden: usize,
        experts: usize,
        top_k: usize,
        layers: usize,
        max_pos: usize,
    ) -> MixtralConfig {
        MixtralConfig {
            vocab_size: vocab,
            hidden_size: d,
            intermediate_size: hidden,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim: d / heads.max(1),
            max_position_embeddings: max_pos,
            num_local_experts: experts,
            num_experts_per_tok: top_k,
            ..MixtralConfig::default()
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
        positive("num_local_experts", self.num_local_experts)?;
        if !(1..=self.num_local_experts).contains(&self.num_experts_per_tok) {
            return Err(Error::config(
                "num_experts_per_tok",
                format!("{} experts per token from {} experts; choose 1 to num_local_experts", self.num_experts_per_tok, self.num_local_experts),
            ));
        }
        check_model_type(&self.extra, "mixtral")?;
        let f = Fields::new(&self.extra);
        if f.get("router_jitter_noise", 0.0f64)? != 0.0 {
            return Err(Error::config("router_jitter_noise", "only 0 is supported: the router's input is not perturbed"));
        }
        if let Some(window) = f.opt::<usize>("sliding_window")? {
            if window < self.max_position_embeddings {
                return Err(Error::config(
                    "sliding_window",
                    format!("a window of {window} tokens is not supported: attention sees every earlier token; use null (or at least max_position_embeddings)"),
                ));
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
    pub fn from_json(value: &Value) -> Result<MixtralConfig> {
        let f = Fields::of(value)?;
        let d = MixtralConfig::default();
        let (heads, kv_heads, head_dim) = read_heads(&f, d.hidden_size, d.num_attention_heads, Some(d.num_key_value_heads))?;
        let config = MixtralConfig {
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
            num_local_experts: f.get("num_local_experts", d.num_local_experts)?,
            num_experts_per_tok: f.get("num_experts_per_tok", d.num_experts_per_tok)?,
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
            .set("tie_word_embeddings", self.tie_word_embeddings)
            .set("num_local_experts", self.num_local_experts)
            .set("num_experts_per_tok", self.num_experts_per_tok);
        write_rope_theta(w, self.rope_theta, &self.extra).keep(&self.extra)
    }
}

serde_via_json!(MixtralConfig);
