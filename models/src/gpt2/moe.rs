//! GPT-2 with a mixture of experts: every block's MLP replaced by a
//! [`Moe`] of SwiGLU experts with top-k routing, as Mixtral does for Llama.
//!
//! Hugging Face has no such class: its checkpoint format here is GPT-2's
//! (same names and layouts, `transformer.` prefix) with the experts under
//! `transformer.h.{i}.moe.router.weight` and
//! `transformer.h.{i}.moe.experts.{e}.{gate,up,down}.weight`, and a
//! `config.json` of `model_type` `gpt2_moe` that adds `num_local_experts`
//! and `num_experts_per_tok` to GPT-2's fields. Tessera reads and writes it;
//! Transformers does not load it.

use super::{Gpt2, Gpt2Attention, Gpt2Config, Gpt2Lm};
use crate::config::check_experts;
use crate::error::{Error, Result};
use crate::hf::{check_every_expert_held, held_elsewhere, HfConfig, HfModel, HfParam};
use crate::vocab::padded_vocab;
use serde_json::Value;
use tessera::module::Cx;
use tessera::nn::{LayerNorm, Moe, Stack};
use tessera::prelude::*;

/// The `model_type` of a [`MoeGpt2Config`]'s `config.json`.
pub const MOE_GPT2_MODEL_TYPE: &str = "gpt2_moe";

/// One block of [`MoeGpt2`]: GPT-2's attention, then a mixture of experts.
/// The experts are replicated over the tensor-parallel group and split over
/// the expert-parallel group.
#[derive(Module)]
pub struct MoeGpt2Block {
    ln_1: LayerNorm,
    attn: Gpt2Attention,
    ln_2: LayerNorm,
    moe: Moe,
}

#[forward]
impl MoeGpt2Block {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        let h = x + all_reduce(self.attn(self.ln_1(x)));
        h + self.moe(self.ln_2(h))
    }
}

/// GPT-2 with a mixture of experts in every block: [`Gpt2Lm`] over
/// [`MoeGpt2Block`]s, token ids `[batch, seq]` to vocabulary-parallel
/// logits, pipeline stages and recompute as in [`Gpt2`]. Each expert is a
/// SwiGLU MLP of width `n_inner` (4 · `n_embd` by default); each token goes
/// to `num_experts_per_tok` of `num_local_experts` experts.
///
/// ```
/// use tessera::module::{self, Act, Cx, Module};
/// use tessera::{Device, Tensor};
/// use tessera_models::gpt2::{Gpt2Config, MoeGpt2, MoeGpt2Config};
///
/// let cx = &mut Cx::new(Device::cpu());
/// let config = MoeGpt2Config::new(Gpt2Config::tiny(64, 32, 4, 2, 16), 4, 2);
/// let model = module::build(MoeGpt2::new(&config)?, cx)?;
/// let ids = Tensor::from_vec(vec![1u32, 5, 9, 2], [1, 4], cx.device())?;
/// let (logits, _) = model.forward(cx, Act::new(ids))?;
/// assert_eq!(logits.tensor().dims(), &[1, 4, 64]);
/// # Ok::<(), tessera_models::Error>(())
/// ```
pub type MoeGpt2 = Gpt2Lm<MoeGpt2Block>;

impl Gpt2Lm<MoeGpt2Block> {
    /// The model `config` describes (validated first) with every expert on
    /// this rank, not yet materialised.
    pub fn new(config: &MoeGpt2Config) -> Result<MoeGpt2> {
        MoeGpt2::with_expert_parallel(config, 0, 1)
    }

    /// The model holding only the experts of rank `rank` of an
    /// expert-parallel group of `degree` ranks; `degree` must divide
    /// `num_local_experts`.
    pub fn with_expert_parallel(config: &MoeGpt2Config, rank: usize, degree: usize) -> Result<MoeGpt2> {
        config.validate()?;
        let g = &config.gpt2;
        let (d, eps) = (g.n_embd, g.layer_norm_epsilon);
        let block = |_| -> tessera::Result<MoeGpt2Block> {
            Ok(MoeGpt2Block {
                ln_1: LayerNorm::new(d, eps, true)?,
                attn: Gpt2Attention::new(g)?,
                ln_2: LayerNorm::new(d, eps, true)?,
                moe: Moe::new(d, g.inner(), config.num_local_experts, config.num_experts_per_tok)?.with_expert_parallel(rank, degree)?,
            })
        };
        Ok(Gpt2Lm::from_parts(g, Stack::from_fn(g.n_layer, block)?)?)
    }

    /// The global indices of the experts this rank holds (the same in every layer).
    pub fn local_experts(&self) -> std::ops::Range<usize> {
        self.h.layers()[0].moe.local_experts()
    }

    /// `(rank, degree)` of the expert-parallel split; `(0, 1)` when unsplit.
    pub fn expert_parallel(&self) -> (usize, usize) {
        self.h.layers()[0].moe.expert_parallel()
    }
}

/// The config of a [`MoeGpt2`]: GPT-2's, and the experts.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeGpt2Config {
    /// Every GPT-2 field (`n_inner` is each expert's width).
    pub gpt2: Gpt2Config,
    /// Experts per block (`num_local_experts`).
    pub num_local_experts: usize,
    /// Experts each token is routed to (`num_experts_per_tok`).
    pub num_experts_per_tok: usize,
}

/// The fields of a [`MoeGpt2Config`]: GPT-2's and the experts'.
const FIELDS: &[&str] = &[
    "vocab_size",
    "n_positions",
    "n_embd",
    "n_layer",
    "n_head",
    "n_inner",
    "activation_function",
    "layer_norm_epsilon",
    "tie_word_embeddings",
    "num_local_experts",
    "num_experts_per_tok",
];

impl MoeGpt2Config {
    /// GPT-2 `gpt2` with `experts` experts per block of which each token uses `top_k`.
    pub fn new(mut gpt2: Gpt2Config, experts: usize, top_k: usize) -> MoeGpt2Config {
        // The class is this config's (`to_json` writes it), not GPT-2's.
        gpt2.extra.remove("model_type");
        gpt2.extra.remove("architectures");
        MoeGpt2Config { gpt2, num_local_experts: experts, num_experts_per_tok: top_k }
    }

    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<()> {
        self.gpt2.validate()?;
        check_experts(self.num_local_experts, self.num_experts_per_tok)
    }

    /// Reads a config from its JSON object (GPT-2's fields, the experts'
    /// fields with defaults 8 and 2) and validates it.
    pub fn from_json(value: &Value) -> Result<MoeGpt2Config> {
        let Value::Object(map) = value else {
            return Err(Error::config("(top level)", "a config is a JSON object of fields"));
        };
        let count = |field: &str, default: usize| -> Result<usize> {
            match map.get(field) {
                None | Some(Value::Null) => Ok(default),
                Some(v) => v.as_u64().map(|n| n as usize).ok_or_else(|| Error::config(field, format!("cannot read {v}: a count of experts is a whole number"))),
            }
        };
        let (experts, top_k) = (count("num_local_experts", 8)?, count("num_experts_per_tok", 2)?);
        let mut gpt2 = map.clone();
        gpt2.remove("num_local_experts");
        gpt2.remove("num_experts_per_tok");
        match gpt2.get("model_type").and_then(Value::as_str) {
            None | Some(MOE_GPT2_MODEL_TYPE) => {
                // GPT-2's reader checks its own model type; this class is written back by `to_json`.
                gpt2.remove("model_type");
                gpt2.remove("architectures");
            }
            Some(other) => {
                return Err(Error::config(
                    "model_type",
                    format!("this is a config of model type \"{other}\", not `{MOE_GPT2_MODEL_TYPE}`; load it with the matching model"),
                ))
            }
        }
        let config = MoeGpt2Config::new(Gpt2Config::from_json(&Value::Object(gpt2))?, experts, top_k);
        config.validate()?;
        Ok(config)
    }

    /// The config as a `config.json` object.
    pub fn to_json(&self) -> Value {
        let mut json = self.gpt2.to_json();
        let map = json.as_object_mut().expect("a config is a JSON object");
        map.insert("model_type".into(), Value::from(MOE_GPT2_MODEL_TYPE));
        map.insert("architectures".into(), Value::from(vec!["MoeGpt2LMHeadModel"]));
        map.insert("num_local_experts".into(), Value::from(self.num_local_experts));
        map.insert("num_experts_per_tok".into(), Value::from(self.num_experts_per_tok));
        json
    }
}

impl HfConfig for MoeGpt2Config {
    const FIELDS: &'static [&'static str] = FIELDS;
    fn from_json(value: &Value) -> Result<Self> {
        MoeGpt2Config::from_json(value)
    }

    fn to_json(&self) -> Value {
        MoeGpt2Config::to_json(self)
    }

    fn validate(&self) -> Result<()> {
        MoeGpt2Config::validate(self)
    }
}

impl HfModel for MoeGpt2 {
    type Config = MoeGpt2Config;
    const BASE_PREFIX: &'static str = "transformer.";

    /// Holds the experts of the expert-parallel rank of `cx`; pads the
    /// vocabulary when the tensor-parallel degree does not divide it.
    fn from_config(config: &MoeGpt2Config, cx: &Cx) -> Result<MoeGpt2> {
        let ep = &cx.groups().ep;
        MoeGpt2::with_expert_parallel(config, ep.rank(), ep.size())?.with_vocab_padded_to(padded_vocab(config.gpt2.vocab_size, cx.groups().tp.size()))
    }

    fn with_vocab_padded_to(self, padded: usize) -> Result<MoeGpt2> {
        MoeGpt2::with_vocab_padded_to(self, padded)
    }

    /// GPT-2's names and layouts; the experts are stored as they are.
    fn hf_param(config: &MoeGpt2Config, name: &str) -> HfParam {
        <Gpt2 as HfModel>::hf_param(&config.gpt2, name)
    }

    /// GPT-2's skipped tensors, and the experts other expert-parallel ranks hold.
    fn skips(&self, config: &MoeGpt2Config, tensor: &str) -> bool {
        super::hf::skipped(&config.gpt2, tensor) || held_elsewhere(tensor, ".moe.experts.", self.local_experts())
    }

    fn check_exportable(&self) -> Result<()> {
        check_every_expert_held(self.expert_parallel())
    }
}
