//! Mixtral: Llama's attention with a sparse mixture of SwiGLU experts in
//! place of the MLP.
//!
//! Routing follows Mixtral's: a linear router scores every expert, each
//! token goes to its `num_experts_per_tok` best experts, and their outputs
//! are mixed with the router's softmax over the selected scores. That is
//! exactly Hugging Face's softmax over all scores followed by renormalising
//! the selected ones (`exp(sᵢ) / Σ_selected exp(sⱼ)` either way), which is
//! what [`Moe`] computes, with unlimited capacity (no token is dropped).
//!
//! Parameter names follow Hugging Face's `MixtralForCausalLM` without its
//! `model.` prefix, except for the packed query/key/value projection (as in
//! [`llama`](crate::llama)) and the experts, whose router is `router` (HF:
//! `gate`) and whose weights are `gate`, `up` and `down` (HF: `w1`, `w3`,
//! `w2`); see [`hf`](crate::hf).

mod config;
mod hf;

pub use config::MixtralConfig;

pub use crate::causal_lm::CausalLm;
use crate::error::Result;
use crate::llama::{stack, LlamaAttention};
use tessera::nn::{Moe, RmsNorm};
use tessera::prelude::*;

/// One Mixtral block: RMSNorm, grouped-query attention, RMSNorm, experts.
///
/// The experts are replicated over the tensor-parallel group (each rank
/// routes its tokens through all of them) and can be split over an
/// expert-parallel group instead ([`Mixtral::with_expert_parallel`]).
#[derive(Module)]
pub struct MixtralBlock {
    input_layernorm: RmsNorm,
    self_attn: LlamaAttention,
    post_attention_layernorm: RmsNorm,
    block_sparse_moe: Moe,
}

#[forward]
impl MixtralBlock {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        let h = x + all_reduce(self.self_attn(self.input_layernorm(x)));
        h + self.block_sparse_moe(self.post_attention_layernorm(h))
    }
}

/// Mixtral as a causal language model: [`CausalLm`] over [`MixtralBlock`]s.
/// Pipeline stages and recompute are as in [`Llama`](crate::llama::Llama).
///
/// ```
/// use tessera::module::{self, Act, Cx, Module};
/// use tessera::{Device, Tensor};
/// use tessera_models::mixtral::{Mixtral, MixtralConfig};
///
/// let cx = &mut Cx::new(Device::cpu());
/// let config = MixtralConfig::tiny(64, 32, 4, 2, 48, 4, 2, 2, 16);
/// let model = module::build(Mixtral::new(&config)?, cx)?;
/// let ids = Tensor::from_vec(vec![1u32, 5, 9, 2], [1, 4], cx.device())?;
/// let (logits, _) = model.forward(cx, Act::new(ids))?;
/// assert_eq!(logits.tensor().dims(), &[1, 4, 64]);
/// # Ok::<(), tessera_models::Error>(())
/// ```
pub type Mixtral = CausalLm<MixtralBlock>;

impl CausalLm<MixtralBlock> {
    /// The model `config` describes (validated first) with every expert on
    /// this rank, not yet materialised.
    pub fn new(config: &MixtralConfig) -> Result<Mixtral> {
        Mixtral::with_expert_parallel(config, 0, 1)
    }

    /// The model `config` describes holding only the experts of rank `rank`
    /// of an expert-parallel group of `degree` ranks (the context's
    /// `groups().ep`); `degree` must divide `num_local_experts`.
    pub fn with_expert_parallel(config: &MixtralConfig, rank: usize, degree: usize) -> Result<Mixtral> {
        config.validate()?;
        let (d, eps) = (config.hidden_size, config.rms_norm_eps);
        let block = |_| -> Result<MixtralBlock> {
            let moe = Moe::new(d, config.intermediate_size, config.num_local_experts, config.num_experts_per_tok)?;
            Ok(MixtralBlock {
                input_layernorm: RmsNorm::new(d, eps)?,
                self_attn: LlamaAttention::new(&config.attention())?,
                post_attention_layernorm: RmsNorm::new(d, eps)?,
                block_sparse_moe: moe.with_expert_parallel(rank, degree)?,
            })
        };
        Ok(CausalLm::from_parts(config.vocab_size, d, eps, config.tie_word_embeddings, stack(config.num_hidden_layers, block)?)?)
    }

    /// The global indices of the experts this rank holds (the same in every layer).
    pub fn local_experts(&self) -> std::ops::Range<usize> {
        self.layers.layers()[0].block_sparse_moe.local_experts()
    }

    /// `(rank, degree)` of the expert-parallel split; `(0, 1)` when unsplit.
    pub fn expert_parallel(&self) -> (usize, usize) {
        self.layers.layers()[0].block_sparse_moe.expert_parallel()
    }
}
