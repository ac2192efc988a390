//! Where Llama's parameters are stored in a Hugging Face `LlamaForCausalLM` checkpoint.

use super::{Llama, LlamaConfig};
use crate::error::Result;
use crate::hf::{Conversion, HfConfig, HfModel, HfParam, QkvHeads, QkvStorage};
use crate::vocab::padded_vocab;
use tessera::module::Cx;

impl HfConfig for LlamaConfig {
    const FIELDS: &'static [&'static str] = super::config::KNOWN;
    fn from_json(value: &serde_json::Value) -> Result<Self> {
        LlamaConfig::from_json(value)
    }

    fn to_json(&self) -> serde_json::Value {
        LlamaConfig::to_json(self)
    }

    fn validate(&self) -> Result<()> {
        LlamaConfig::validate(self)
    }
}

impl HfModel for Llama {
    type Config = LlamaConfig;
    const BASE_PREFIX: &'static str = "model.";

    /// Pads the vocabulary when the tensor-parallel degree of `cx` does not divide it.
    fn from_config(config: &LlamaConfig, cx: &Cx) -> Result<Llama> {
        Llama::new(config)?.with_vocab_padded_to(padded_vocab(config.vocab_size, cx.groups().tp.size()))
    }

    fn with_vocab_padded_to(self, padded: usize) -> Result<Llama> {
        Llama::with_vocab_padded_to(self, padded)
    }

    fn hf_param(config: &LlamaConfig, name: &str) -> HfParam {
        let heads = QkvHeads { q: config.num_attention_heads, kv: config.num_key_value_heads, dim: config.head_dim };
        attention_param(heads, name).unwrap_or_else(|| HfParam::one(base_name(name), vocab_or_identity(name, config.vocab_size)))
    }

    fn skips(&self, config: &LlamaConfig, tensor: &str) -> bool {
        skipped(config.tie_word_embeddings, tensor)
    }
}

/// How a parameter stored as it is converts: the vocabulary tables (the
/// token embedding and the head) may be padded (see [`crate::vocab`]).
pub(crate) fn vocab_or_identity(name: &str, vocab: usize) -> Conversion {
    if name == "embed_tokens.weight" || name == "lm_head.weight" {
        Conversion::Vocab { stored: vocab }
    } else {
        Conversion::Identity
    }
}

/// The Hugging Face name of a parameter stored as it is: the head at the
/// top, everything else under `model.`.
pub(crate) fn base_name(name: &str) -> String {
    if name == "lm_head.weight" {
        name.to_string()
    } else {
        format!("model.{name}")
    }
}

/// The packed query/key/value projection `layers.{i}.self_attn.qkv_proj.weight`,
/// stored as Hugging Face's separate `q_proj`, `k_proj` and `v_proj`.
/// Rotary embeddings need no permutation: Tessera rotates the pairs
/// `(i, i + head_dim/2)` as Hugging Face's checkpoints expect.
pub(crate) fn attention_param(heads: QkvHeads, name: &str) -> Option<HfParam> {
    let layer = name.strip_suffix("self_attn.qkv_proj.weight")?;
    let tensors = ["q_proj", "k_proj", "v_proj"].map(|p| format!("model.{layer}self_attn.{p}.weight")).to_vec();
    Some(HfParam { tensors, conversion: Conversion::Qkv { heads, storage: QkvStorage::Separate } })
}

/// Tensors older checkpoints carry that hold no weight (RoPE's inverse
/// frequencies), and a tied head's copy of the embedding.
pub(crate) fn skipped(tied: bool, tensor: &str) -> bool {
    tensor.ends_with(".rotary_emb.inv_freq") || (tied && tensor == "lm_head.weight")
}
