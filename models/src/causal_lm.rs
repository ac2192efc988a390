//! The decoder-only language model Llama and Mixtral share: one definition,
//! generic over its block.

use tessera::module::SelectiveRecomputable;
use tessera::nn::{Embedding, Linear, RmsNorm, Stack};
use tessera::prelude::*;

/// A block of a decoder's residual stream: `Replicated → Replicated`, with
/// an attention core that selective recompute can drop. What [`CausalLm`]
/// and GPT-2's [`Gpt2Lm`](crate::gpt2::Gpt2Lm) stack.
pub trait DecoderBlock: Module<In = Replicated, Out = Replicated> + SelectiveRecomputable {}
impl<B: Module<In = Replicated, Out = Replicated> + SelectiveRecomputable> DecoderBlock for B {}

/// A causal language model over blocks `B`: token ids `[batch, seq]` (u32)
/// to logits `[batch, seq, vocab]`, split over the vocabulary on a
/// tensor-parallel group (`Act<SplitHidden>`).
///
/// [`Llama`](crate::llama::Llama) is `CausalLm<LlamaBlock>` and
/// [`Mixtral`](crate::mixtral::Mixtral) is `CausalLm<MixtralBlock>`; parameter
/// names follow Hugging Face's (`embed_tokens`, `layers.{i}..`, `norm`,
/// `lm_head`). Pipeline stages: the embedding on the first, the blocks split
/// over the stages, the final norm and head on the last. The blocks declare
/// selective recompute, which
/// [`Cx::set_recompute_override`](tessera::module::Cx::set_recompute_override)
/// can turn off or into full recompute. With tied embeddings the head shares
/// the embedding's parameter (one parameter, two names).
#[derive(Module)]
pub struct CausalLm<B: DecoderBlock> {
    #[stage(first)]
    #[shard(vocab)]
    pub(crate) embed_tokens: Embedding,
    #[stage(split)]
    #[recompute(selective)]
    pub(crate) layers: Stack<B>,
    #[stage(last)]
    pub(crate) norm: RmsNorm,
    #[stage(last)]
    #[shard(vocab)]
    pub(crate) lm_head: Linear,
}

#[forward]
impl<B: DecoderBlock> CausalLm<B> {
    fn forward(&self, ids: Act<Replicated>) -> Act<SplitHidden> {
        let h = all_reduce(self.embed_tokens(ids));
        self.lm_head(self.norm(self.layers(h)))
    }
}

impl<B: DecoderBlock> CausalLm<B> {
    /// The model with these layers, not yet materialised; the head shares the
    /// embedding's parameter when `tied`.
    pub(crate) fn from_parts(vocab: usize, d: usize, eps: f64, tied: bool, layers: Stack<B>) -> tessera::Result<CausalLm<B>> {
        let embed_tokens = Embedding::new(vocab, d)?;
        let mut lm_head = Linear::new(d, vocab, false)?;
        if tied {
            lm_head.tie_weight(embed_tokens.weight())?;
        }
        Ok(CausalLm { embed_tokens, layers, norm: RmsNorm::new(d, eps)?, lm_head })
    }

    /// The blocks, first to last.
    pub fn layers(&self) -> &Stack<B> {
        &self.layers
    }

    /// This model with its vocabulary padded to `padded` ids (see
    /// [`vocab`](crate::vocab)): the embedding and head grow, the head masks
    /// the padding. Before the model is materialised.
    pub fn with_vocab_padded_to(mut self, padded: usize) -> crate::Result<CausalLm<B>> {
        (self.embed_tokens, self.lm_head) = crate::vocab::padded_vocab_layers(&self.embed_tokens, &self.lm_head, padded)?;
        Ok(self)
    }

    /// The vocabulary size the model was built with, padding included.
    pub fn padded_vocab(&self) -> usize {
        self.lm_head.out_features()
    }
}
