//! Where GPT-2's parameters are stored in a Hugging Face `GPT2LMHeadModel` checkpoint.

use super::{Gpt2, Gpt2Config};
use crate::error::Result;
use crate::hf::{Conversion, HfConfig, HfModel, HfParam, QkvHeads, QkvStorage};
use crate::vocab::padded_vocab;
use tessera::module::Cx;

impl HfConfig for Gpt2Config {
    const FIELDS: &'static [&'static str] = super::config::KNOWN;
    fn from_json(value: &serde_json::Value) -> Result<Self> {
        Gpt2Config::from_json(value)
    }

    fn to_json(&self) -> serde_json::Value {
        Gpt2Config::to_json(self)
    }

    fn validate(&self) -> Result<()> {
        Gpt2Config::validate(self)
    }
}

impl HfModel for Gpt2 {
    type Config = Gpt2Config;
    const BASE_PREFIX: &'static str = "transformer.";

    /// Pads the vocabulary when the tensor-parallel degree of `cx` does not divide it.
    fn from_config(config: &Gpt2Config, cx: &Cx) -> Result<Gpt2> {
        Gpt2::new(config)?.with_vocab_padded_to(padded_vocab(config.vocab_size, cx.groups().tp.size()))
    }

    /// Tessera's names are Hugging Face's without `transformer.`; the
    /// `Conv1D` weights are stored transposed, and `c_attn` holds all query,
    /// key and value heads one after the other where Tessera packs them per head.
    fn with_vocab_padded_to(self, padded: usize) -> Result<Gpt2> {
        Gpt2::with_vocab_padded_to(self, padded)
    }

    fn hf_param(config: &Gpt2Config, name: &str) -> HfParam {
        if name == "lm_head.weight" {
            return HfParam::one(name, Conversion::Vocab { stored: config.vocab_size });
        }
        if name == "wte.weight" {
            return HfParam::one(format!("transformer.{name}"), Conversion::Vocab { stored: config.vocab_size });
        }
        let heads = QkvHeads { q: config.n_head, kv: config.n_head, dim: config.head_dim() };
        let conversion = if name.ends_with(".attn.c_attn.weight") {
            Conversion::Qkv { heads, storage: QkvStorage::Fused { transposed: true } }
        } else if name.ends_with(".attn.c_attn.bias") {
            Conversion::Qkv { heads, storage: QkvStorage::Fused { transposed: false } }
        } else if name.ends_with(".c_proj.weight") || name.ends_with(".c_fc.weight") {
            Conversion::Transpose
        } else {
            Conversion::Identity
        };
        HfParam::one(format!("transformer.{name}"), conversion)
    }

    fn skips(&self, config: &Gpt2Config, tensor: &str) -> bool {
        skipped(config, tensor)
    }
}

/// Tensors of a GPT-2 checkpoint that fill no parameter: older checkpoints
/// carry each block's causal mask (`attn.bias`, `attn.masked_bias`); a tied
/// checkpoint may carry the head's copy of the embedding.
pub(super) fn skipped(config: &Gpt2Config, tensor: &str) -> bool {
    tensor.ends_with(".attn.bias") || tensor.ends_with(".attn.masked_bias") || (config.tie_word_embeddings && tensor == "lm_head.weight")
}
