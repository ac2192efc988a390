//! GPT-2: learned token and position embeddings, pre-LayerNorm blocks,
//! GELU (tanh approximation) MLP, attention with biased projections, and an
//! output head tied to the token embedding; and [`MoeGpt2`], GPT-2 with a
//! mixture of experts in place of every MLP. Both are one definition,
//! [`Gpt2Lm`], over their blocks.
//!
//! Parameter names follow Hugging Face's `GPT2LMHeadModel` without its
//! `transformer.` prefix (`h.0.attn.c_attn.weight`, ...); see
//! [`hf`](crate::hf) for how each is stored there.

mod config;
mod hf;
mod moe;

pub use config::Gpt2Config;
pub use moe::{MoeGpt2, MoeGpt2Block, MoeGpt2Config, MOE_GPT2_MODEL_TYPE};

use crate::causal_lm::DecoderBlock;
use crate::error::Result;
use tessera::nn::{CausalAttention, Embedding, LayerNorm, Linear, PositionEmbedding, Stack};
use tessera::prelude::*;

/// GPT-2's attention: the query/key/value projection (`c_attn`, column
/// parallel, packed per head as [`CausalAttention`] reads it), causal
/// multi-head attention, and the output projection (`c_proj`, row parallel).
/// `Replicated → PartialSum`: the caller all-reduces. Shared by [`Gpt2`] and
/// [`MoeGpt2`].
#[derive(Module)]
pub struct Gpt2Attention {
    #[shard(column)]
    c_attn: Linear,
    core: CausalAttention,
    #[shard(row)]
    c_proj: Linear,
}

#[forward]
impl Gpt2Attention {
    fn forward(&self, x: Act<Replicated>) -> Act<PartialSum> {
        self.c_proj(self.core(self.c_attn(x)))
    }
}

impl Gpt2Attention {
    /// The attention of a block `config` describes: biased projections, as
    /// many key/value heads as query heads.
    fn new(config: &Gpt2Config) -> tessera::Result<Gpt2Attention> {
        let d = config.n_embd;
        Ok(Gpt2Attention {
            c_attn: Linear::new(d, 3 * d, true)?,
            core: CausalAttention::new(config.n_head, config.n_head, config.head_dim())?,
            c_proj: Linear::new(d, d, true)?,
        })
    }
}

/// GPT-2's MLP: `c_proj(gelu(c_fc(x)))`, column then row parallel.
/// `Replicated → PartialSum`.
#[derive(Module)]
pub struct Gpt2Mlp {
    #[shard(column)]
    c_fc: Linear,
    #[shard(row)]
    c_proj: Linear,
}

#[forward]
impl Gpt2Mlp {
    fn forward(&self, x: Act<Replicated>) -> Act<PartialSum> {
        self.c_proj(gelu(self.c_fc(x)))
    }
}

/// One pre-LayerNorm transformer block of GPT-2.
#[derive(Module)]
pub struct Gpt2Block {
    ln_1: LayerNorm,
    attn: Gpt2Attention,
    ln_2: LayerNorm,
    mlp: Gpt2Mlp,
}

#[forward]
impl Gpt2Block {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        let h = x + all_reduce(self.attn(self.ln_1(x)));
        h + all_reduce(self.mlp(self.ln_2(h)))
    }
}

impl Gpt2Block {
    /// A block of the model `config` describes.
    fn new(config: &Gpt2Config) -> tessera::Result<Gpt2Block> {
        let (d, eps) = (config.n_embd, config.layer_norm_epsilon);
        Ok(Gpt2Block {
            ln_1: LayerNorm::new(d, eps, true)?,
            attn: Gpt2Attention::new(config)?,
            ln_2: LayerNorm::new(d, eps, true)?,
            mlp: Gpt2Mlp { c_fc: Linear::new(d, config.inner(), true)?, c_proj: Linear::new(config.inner(), d, true)? },
        })
    }
}

/// GPT-2 as a causal language model over blocks `B`: token ids
/// `[batch, seq]` (u32) to logits `[batch, seq, vocab]`, split over the
/// vocabulary on a tensor-parallel group (`Act<SplitHidden>`, for
/// [`vocab_parallel_cross_entropy`](tessera::nn::vocab_parallel_cross_entropy)).
///
/// [`Gpt2`] is `Gpt2Lm<Gpt2Block>` and [`MoeGpt2`] is `Gpt2Lm<MoeGpt2Block>`;
/// parameter names follow Hugging Face's (`wte`, `wpe`, `h.{i}..`, `ln_f`,
/// `lm_head`). Pipeline stages: the embeddings on the first, the blocks (`h`)
/// split over the stages, the final norm and head on the last. The blocks
/// declare selective recompute (the attention core is recomputed in the
/// backward);
/// [`Cx::set_recompute_override`](tessera::module::Cx::set_recompute_override)
/// turns it off or into full recompute. With `tie_word_embeddings` the head
/// shares the token embedding's parameter (one parameter, two names).
#[derive(Module)]
pub struct Gpt2Lm<B: DecoderBlock> {
    #[stage(first)]
    #[shard(vocab)]
    wte: Embedding,
    #[stage(first)]
    wpe: PositionEmbedding,
    #[stage(split)]
    #[recompute(selective)]
    h: Stack<B>,
    #[stage(last)]
    ln_f: LayerNorm,
    #[stage(last)]
    #[shard(vocab)]
    lm_head: Linear,
}

#[forward]
impl<B: DecoderBlock> Gpt2Lm<B> {
    fn forward(&self, ids: Act<Replicated>) -> Act<SplitHidden> {
        let x = self.wpe(all_reduce(self.wte(ids)));
        self.lm_head(self.ln_f(self.h(x)))
    }
}

impl<B: DecoderBlock> Gpt2Lm<B> {
    /// The model `config` describes with blocks `h`, not yet materialised.
    fn from_parts(config: &Gpt2Config, h: Stack<B>) -> tessera::Result<Gpt2Lm<B>> {
        let (d, eps) = (config.n_embd, config.layer_norm_epsilon);
        let wte = Embedding::new(config.vocab_size, d)?;
        let mut lm_head = Linear::new(d, config.vocab_size, false)?;
        if config.tie_word_embeddings {
            lm_head.tie_weight(wte.weight())?;
        }
        Ok(Gpt2Lm { wte, wpe: PositionEmbedding::new(config.n_positions, d)?, h, ln_f: LayerNorm::new(d, eps, true)?, lm_head })
    }

    /// This model with its vocabulary padded to `padded` ids (see
    /// [`vocab`](crate::vocab)): the embedding and head grow, the head masks
    /// the padding. Before the model is materialised.
    pub fn with_vocab_padded_to(mut self, padded: usize) -> Result<Gpt2Lm<B>> {
        (self.wte, self.lm_head) = crate::vocab::padded_vocab_layers(&self.wte, &self.lm_head, padded)?;
        Ok(self)
    }

    /// The vocabulary size the model was built with, padding included.
    pub fn padded_vocab(&self) -> usize {
        self.lm_head.out_features()
    }
}

/// GPT-2 as a causal language model: [`Gpt2Lm`] over [`Gpt2Block`]s.
///
/// ```
/// use tessera::module::{self, Act, Cx, Module};
/// use tessera::{DType, Device, Tensor};
/// use tessera_models::gpt2::{Gpt2, Gpt2Config};
///
/// let cx = &mut Cx::new(Device::cpu());
/// let model = module::build(Gpt2::new(&Gpt2Config::tiny(64, 32, 4, 2, 16))?, cx)?;
/// let ids = Tensor::from_vec(vec![1u32, 5, 9, 2], [1, 4], cx.device())?;
/// let (logits, _) = model.forward(cx, Act::new(ids))?;
/// assert_eq!(logits.tensor().dims(), &[1, 4, 64]);
/// # Ok::<(), tessera_models::Error>(())
/// ```
pub type Gpt2 = Gpt2Lm<Gpt2Block>;

impl Gpt2Lm<Gpt2Block> {
    /// The model `config` describes (validated first), not yet materialised:
    /// [`module::build`](tessera::module::build) gives it a rank's values.
    pub fn new(config: &Gpt2Config) -> Result<Gpt2> {
        config.validate()?;
        Ok(Gpt2Lm::from_parts(config, Stack::from_fn(config.n_layer, |_| Gpt2Block::new(config))?)?)
    }
}
