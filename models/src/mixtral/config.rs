//! Mixtral's Hugging Face configuration (`MixtralConfig`).

use crate::config::{self, check_experts, check_model_type, identity, serde_via_json};
use crate::error::{Error, Result};
use crate::llama::llama_fields;
use serde::{Deserialize, Serialize};
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

/// The fields of [`MixtralConfig`] (`extra` aside): the keys a training
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
    "num_local_experts",
    "num_experts_per_tok",
];

/// How `config.json` spells a [`MixtralConfig`]: serde derives the reading
/// and writing from it (see `gpt2/config.rs` for why through `remote`).
/// Fields absent from the file take [`MixtralConfig::default`], and
/// [`MixtralConfig::from_json`] applies the default `head_dim`, which
/// depends on other fields; every other key lands in `extra`.
#[derive(Deserialize, Serialize)]
#[serde(remote = "MixtralConfig", default = "MixtralConfig::default")]
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
    num_local_experts: usize,
    num_experts_per_tok: usize,
    #[serde(flatten, serialize_with = "config::write_extra::<MixtralConfig, _>")]
    extra: Map<String, Value>,
}

/// Fields of Hugging Face's Mixtral that change the computation, kept in
/// `extra` and checked (absent or null: Hugging Face's default).
#[derive(Deserialize)]
struct Switches {
    router_jitter_noise: Option<f64>,
    sliding_window: Option<usize>,
}

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
        self.validate_llama_fields()?;
        check_experts(self.num_local_experts, self.num_experts_per_tok)?;
        check_model_type(&self.extra, "mixtral")?;
        let switches: Switches = config::read_extra(&self.extra)?;
        if switches.router_jitter_noise.unwrap_or(0.0) != 0.0 {
            return Err(Error::config("router_jitter_noise", "only 0 is supported: the router's input is not perturbed"));
        }
        if let Some(window) = switches.sliding_window {
            if window < self.max_position_embeddings {
                return Err(Error::config(
                    "sliding_window",
                    format!("a window of {window} tokens is not supported: attention sees every earlier token; use null (or at least max_position_embeddings)"),
                ));
            }
        }
        Ok(())
    }

    /// Reads a config from its JSON object and validates it. (Unlike
    /// Llama's, Mixtral's key/value heads default to a number, 8, not to
    /// the query heads.)
    pub fn from_json(value: &Value) -> Result<MixtralConfig> {
        let config = MixtralConfig::read_json(value)?;
        config.validate()?;
        Ok(config)
    }
}

llama_fields!(MixtralConfig, ConfigJson, KNOWN);
serde_via_json!(MixtralConfig);
