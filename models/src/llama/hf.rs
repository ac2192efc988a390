//! Where Llama's parameters are stored in a Hugging Face `LlamaForCausalLM` checkpoint.

use super::{Llama, LlamaConfig};
use crate::error::Result;
use crate::hf::{Conversion, HfConfig, HfModel, HfParam, QkvHeads, QkvStorage};
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

    fn from_config(config: &LlamaConfig, _cx: &Cx) -> Result<Llama> {
        Llama::new(config)
    }

    fn hf_param(config: &LlamaConfig, name: &str) -> HfParam {
        let heads = QkvHeads { q: config.num_attention_heads, kv: config.num_key_value_heads, dim: config.head_dim };
        attention_param(heads, name).unwrap_or_else(|| HfParam::one(base_name(name), Conversion::Identity))
    }

    fn skips(&self, config: &LlamaConfig, tensor: &str) -> bool {
        skipped(config.tie_word_embeddings, tensor)
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
