//! Where Mixtral's parameters are stored in a Hugging Face `MixtralForCausalLM` checkpoint.

use super::{Mixtral, MixtralConfig};
use crate::error::Result;
use crate::hf::{check_every_expert_held, held_elsewhere, HfConfig, HfModel, HfParam, QkvHeads};
use crate::llama::hf::{attention_param, base_name, skipped, vocab_or_identity};
use crate::vocab::padded_vocab;
use tessera::module::Cx;

impl HfConfig for MixtralConfig {
    const FIELDS: &'static [&'static str] = super::config::KNOWN;
    fn from_json(value: &serde_json::Value) -> Result<Self> {
        MixtralConfig::from_json(value)
    }

    fn to_json(&self) -> serde_json::Value {
        MixtralConfig::to_json(self)
    }

    fn validate(&self) -> Result<()> {
        MixtralConfig::validate(self)
    }
}

/// Hugging Face's names of an expert's weights: `w1` is the gate, `w3` the
/// up projection, `w2` the down projection.
const EXPERT_WEIGHTS: [(&str, &str); 3] = [(".gate.weight", ".w1.weight"), (".up.weight", ".w3.weight"), (".down.weight", ".w2.weight")];

impl HfModel for Mixtral {
    type Config = MixtralConfig;
    const BASE_PREFIX: &'static str = "model.";

    /// Holds the experts of the expert-parallel rank of `cx`.
    fn from_config(config: &MixtralConfig, cx: &Cx) -> Result<Mixtral> {
        let ep = &cx.groups().ep;
        Mixtral::with_expert_parallel(config, ep.rank(), ep.size())?.with_vocab_padded_to(padded_vocab(config.vocab_size, cx.groups().tp.size()))
    }

    fn with_vocab_padded_to(self, padded: usize) -> Result<Mixtral> {
        Mixtral::with_vocab_padded_to(self, padded)
    }

    fn hf_param(config: &MixtralConfig, name: &str) -> HfParam {
        let heads = QkvHeads { q: config.num_attention_heads, kv: config.num_key_value_heads, dim: config.head_dim };
        if let Some(p) = attention_param(heads, name) {
            return p;
        }
        let mut hf = name.replace(".block_sparse_moe.router.", ".block_sparse_moe.gate.");
        if name.contains(".block_sparse_moe.experts.") {
            for (ours, theirs) in EXPERT_WEIGHTS {
                if let Some(stem) = name.strip_suffix(ours) {
                    hf = format!("{stem}{theirs}");
                }
            }
        }
        HfParam::one(base_name(&hf), vocab_or_identity(name, config.vocab_size))
    }

    /// Also skips the experts other expert-parallel ranks hold.
    fn skips(&self, config: &MixtralConfig, tensor: &str) -> bool {
        skipped(config.tie_word_embeddings, tensor) || held_elsewhere(tensor, ".block_sparse_moe.experts.", self.local_experts())
    }

    fn check_exportable(&self) -> Result<()> {
        check_every_expert_held(self.expert_parallel())
    }
}
